"""Preference data as the peers and the Hub store it, converted to TRL's explicit-prompt form;
the shipped DPO recipes validated against a local file in their dataset's layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.data.preference import extract_prompt
from finetune.data.sources import load_source
from finetune.errors import DataError
from finetune.recipe.load import load_recipe
from finetune.recipe.schema import DataSource
from tests.helpers.paths import ROOT, SAMPLES

U = {"role": "user", "content": "abc"}


def _first(name: str, fmt: str = "preference") -> dict:
    src = load_source(DataSource(path=str(SAMPLES / name), format=fmt), base_dir=ROOT)
    return {k: v for k, v in src.records[0].items() if not k.startswith("_")}


def test_ultrafeedback_prompt_string_with_lists_that_repeat_the_user_turn():
    assert _first("preference_ultrafeedback.jsonl") == {
        "prompt": [{"role": "user", "content": "daczsb"}],
        "chosen": [{"role": "assistant", "content": "DACZSB"}],
        "rejected": [{"role": "assistant", "content": "bszcad"}],
    }


def test_hh_rlhf_implicit_prompt_as_text_keeps_whole_answers():
    assert _first("preference_hh.jsonl") == {
        "prompt": "\n\nHuman: daczsb\n\nAssistant:",
        "chosen": " DACZSB",
        "rejected": " bszcad",
    }


def test_hh_text_answers_that_start_alike_are_split_at_the_turn_marker(tmp_path):
    path = tmp_path / "hh.jsonl"
    path.write_text(
        json.dumps(
            {
                "chosen": "\n\nHuman: sky?\n\nAssistant: It is blue.",
                "rejected": "\n\nHuman: sky?\n\nAssistant: It is green.",
            }
        )
        + "\n"
    )
    rec = load_source(DataSource(path=str(path), format="preference"), base_dir=tmp_path).records[0]
    assert (rec["prompt"], rec["chosen"], rec["rejected"]) == (
        "\n\nHuman: sky?\n\nAssistant:",
        " It is blue.",
        " It is green.",
    )


def test_llamafactory_conversations_with_chosen_rejected_objects():
    assert _first("preference_llamafactory.jsonl") == {
        "prompt": [{"role": "user", "content": "daczsb"}],
        "chosen": [{"role": "assistant", "content": "DACZSB"}],
        "rejected": [{"role": "assistant", "content": "bszcad"}],
    }


@pytest.mark.parametrize(
    "row",
    [
        {
            "chosen": [U, {"role": "assistant", "content": "ABC"}],
            "rejected": [U, {"role": "assistant", "content": "x"}],
        },
        {
            "prompt": [U],
            "chosen": {"role": "assistant", "content": "ABC"},
            "rejected": {"role": "assistant", "content": "x"},
        },
        {"prompt": [U], "chosen": "ABC", "rejected": "x"},
        {
            "prompt": [U],
            "chosen": [U, {"role": "assistant", "content": "ABC"}],
            "rejected": [U, {"role": "assistant", "content": "x"}],
        },
    ],
)
def test_message_layouts_all_become_the_same_row(tmp_path, row):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(row) + "\n")
    rec = load_source(DataSource(path=str(path), format="preference"), base_dir=tmp_path).records[0]
    assert rec["prompt"] == [U]
    assert rec["chosen"] == [{"role": "assistant", "content": "ABC"}]
    assert rec["rejected"] == [{"role": "assistant", "content": "x"}]


def test_unpaired_rows_with_a_boolean_label():
    rec = _first("unpaired.jsonl", "unpaired")
    assert rec == {
        "prompt": [{"role": "user", "content": "daczsb"}],
        "completion": [{"role": "assistant", "content": "DACZSB"}],
        "label": True,
    }


@pytest.mark.parametrize(
    "row,words",
    [
        ({"chosen": "same", "rejected": "same"}, "chosen and rejected are the same"),
        ({"prompt": [U], "chosen": [{"role": "assistant", "content": "A"}], "rejected": [U]}, "rejected has no answer"),
        ({"chosen": "abc", "rejected": "xyz"}, "no prompt"),
        ({"prompt": "p", "chosen": [U], "rejected": "x"}, "both be strings or both be messages"),
        ({"prompt": "p", "rejected": "x"}, "column 'chosen'"),
    ],
)
def test_bad_preference_rows_name_the_row(tmp_path, row, words):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as info:
        load_source(DataSource(path=str(path), format="preference"), base_dir=tmp_path)
    assert "row 2:" in info.value.render() and words in info.value.render(), info.value.render()


def test_unpaired_label_must_be_boolean(tmp_path):
    path = tmp_path / "kto.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b", "label": "maybe"}) + "\n")
    with pytest.raises(DataError, match="row 1: label must be true or false"):
        load_source(DataSource(path=str(path), format="unpaired"), base_dir=tmp_path)


@pytest.mark.parametrize(
    "chosen,rejected",
    [
        ("\n\nHuman: q\n\nAssistant: It is blue.", "\n\nHuman: q\n\nAssistant: It is green."),
        ([U, {"role": "assistant", "content": "A"}], [U, {"role": "assistant", "content": "B"}]),
        ("same start, then a", "same start, then b"),
    ],
)
def test_prompt_extraction_matches_trl(chosen, rejected):
    from trl.data_utils import maybe_extract_prompt

    assert extract_prompt(chosen, rejected) == maybe_extract_prompt({"chosen": chosen, "rejected": rejected})


@pytest.mark.parametrize("name", ["llama8b-dpo-lora.yaml", "llama70b-dpo-lora.yaml"])
def test_shipped_dpo_recipes_validate_against_their_dataset_layout(name):
    from finetune.data.check import check_data

    sample = SAMPLES / "preference_ultrafeedback.jsonl"
    recipe = load_recipe(
        ROOT / "recipes" / name, overrides=[f"data.sources[0].path={sample}", f"data.eval_sources[0].path={sample}"]
    )
    assert recipe.data.sources[0].path == str(sample) and recipe.data.sources[0].split == "train_prefs"
    check_data(recipe)  # every row converts in the recipe's own format
    src = load_source(recipe.data.sources[0], base_dir=Path(ROOT))
    assert src.records[0]["prompt"][-1]["role"] == "user"


def test_shipped_dpo_recipe_validates_from_the_cli(capsys):
    from finetune.cli import main

    sample = SAMPLES / "preference_ultrafeedback.jsonl"
    rc = main(
        [
            "validate",
            str(ROOT / "recipes" / "llama8b-dpo-lora.yaml"),
            "--set",
            f"data.sources[0].path={sample}",
            "--set",
            f"data.eval_sources[0].path={sample}",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert "valid (dpo / lora" in capsys.readouterr().out
