"""Data formats, preflight errors (file + row), tokenization masks and the tokenized-data cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from finetune.checkpoints.resume import latest_checkpoint, resolve_resume
from finetune.data.sources import load_source
from finetune.errors import DataError
from finetune.recipe.load import load_recipe
from finetune.recipe.schema import DataSource
from tests.helpers.paths import QUICKSTART_DATA, ROOT, SAMPLES, TINY_MODEL
from tests.helpers.recipes import resolve_recipe, tiny_recipe


def _state():
    from accelerate import PartialState

    return PartialState(cpu=True)


def _tokenizer(path=TINY_MODEL):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize(
    "fmt,expect",
    [
        ("alpaca", "messages"),
        ("sharegpt", "messages"),
        ("text", "text"),
        ("prompt_completion", "prompt"),
        ("preference", "chosen"),
    ],
)
def test_every_sample_format_converts(fmt, expect):
    src = load_source(DataSource(path=str(SAMPLES / f"{fmt}.jsonl"), format=fmt), base_dir=Path("."))
    first = src.records[0]
    assert expect in first and first["_row"] == 1 and first["_file"].endswith(f"{fmt}.jsonl")
    if expect == "messages":
        assert [m["role"] for m in first["messages"]] == ["user", "assistant"]
        assert first["messages"][1]["content"].isupper()
    if fmt == "alpaca":  # instruction and input are both in the user turn
        raw = json.loads((SAMPLES / "alpaca.jsonl").read_text().splitlines()[0])
        assert raw["instruction"] in first["messages"][0]["content"]
        assert raw["input"] in first["messages"][0]["content"]


def test_messages_format_and_column_mapping(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps(
            {
                "conv": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "HI"},
                ]
            }
        )
        + "\n"
    )
    src = load_source(DataSource(path=str(path), format="messages", columns={"messages": "conv"}), base_dir=tmp_path)
    assert [m["role"] for m in src.records[0]["messages"]] == ["system", "user", "assistant"]


def _write(tmp_path, lines: list[str], name="bad.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + ("\n" if lines else ""))
    return path


GOOD = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "A"}]})


@pytest.mark.parametrize(
    "lines,fmt,row,words",
    [
        ([GOOD, GOOD, '{"messages": [ broken'], "messages", 3, "not valid JSON"),
        ([GOOD, json.dumps({"msgs": []})], "messages", 2, "column 'messages'"),
        ([json.dumps({"instruction": "x"})], "alpaca", 1, "column 'output'"),
        ([GOOD, json.dumps({"messages": [{"role": "human", "content": "a"}]})], "messages", 2, "role 'human'"),
        ([json.dumps({"messages": [{"role": "user", "content": "a"}]})], "messages", 1, "no assistant"),
        ([json.dumps({"conversations": [{"from": "alien", "value": "x"}]})], "sharegpt", 1, "role 'alien'"),
    ],
)
def test_bad_rows_name_file_and_row(tmp_path, lines, fmt, row, words):
    path = _write(tmp_path, lines)
    with pytest.raises(DataError) as info:
        load_source(DataSource(path=str(path), format=fmt), base_dir=tmp_path)
    text = info.value.render()
    assert str(path) in text and f"row {row}:" in text and words in text, text


def test_empty_file_and_missing_file(tmp_path):
    path = _write(tmp_path, [])
    with pytest.raises(DataError, match="empty") as info:
        load_source(DataSource(path=str(path)), base_dir=tmp_path)
    assert str(path) in info.value.render()
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(DataError, match="no examples"):
        load_source(DataSource(path=str(blank)), base_dir=tmp_path)
    with pytest.raises(DataError, match="file not found"):
        load_source(DataSource(path="nope/missing.jsonl"), base_dir=tmp_path)


def test_assistant_mask_with_and_without_generation_markers():
    from trl.chat_template_utils import has_generation_markers

    from finetune.train.tokenize import sft_features

    tok = _tokenizer()
    assert has_generation_markers(tok.chat_template)
    conv = {
        "messages": [
            {"role": "user", "content": "abc"},
            {"role": "assistant", "content": "ABC"},
            {"role": "user", "content": "de"},
            {"role": "assistant", "content": "DE"},
        ]
    }
    marked = sft_features(conv, tok, assistant_only_loss=True)
    # the same template with the markers removed takes the turn-by-turn rendering path
    tok.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    plain = sft_features(conv, tok, assistant_only_loss=True)
    assert marked == plain
    learned = tok.decode([t for t in marked["labels"] if t != -100])
    assert learned == "ABC<|end|>DE<|end|>"  # both answers and their end-of-turn, no user text
    full = sft_features(conv, tok, assistant_only_loss=False)
    assert full["labels"] == full["input_ids"]


def _byte_bpe_tokenizer(template: str):
    # byte-level BPE splits a multi-byte character into tokens that share its offsets
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        ["hello world, the answer is 42", "ünïcödé text and more words"] * 20,
        trainer=trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|end|>", "<|s|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|end|>", bos_token="<|s|>", chat_template=template)


def test_batched_tokenization_equals_record_by_record():
    from finetune.train.tokenize import sft_features, sft_features_batch

    records = [json.loads(line) for line in (QUICKSTART_DATA / "train.jsonl").read_text().splitlines()[:40]]
    records += [
        {
            "messages": [
                {"role": "system", "content": ""},
                {"role": "user", "content": "héllo 😀"},
                {"role": "assistant", "content": "😀 ünïcödé 漢字"},
                {"role": "user", "content": " "},
                {"role": "assistant", "content": "🙂"},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "yes"},
                {"role": "user", "content": "z"},
                {"role": "assistant", "content": ""},
            ]
        },  # an empty span
        {"text": "plain text"},
        {"prompt": "the answer", "completion": " is 42"},
    ]
    tiny = _tokenizer()
    template = tiny.chat_template
    # spans ending inside a character that several byte tokens share (the answers end with emoji)
    content_only = template.replace("<|end|>{% endgeneration %}", "{% endgeneration %}<|end|>")
    assert content_only != template
    no_markers = template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    for tok in (
        tiny,
        _byte_bpe_tokenizer(template),
        _byte_bpe_tokenizer(content_only),
        _byte_bpe_tokenizer(no_markers),
    ):
        for assistant_only_loss in (True, False):
            one = [sft_features(r, tok, assistant_only_loss=assistant_only_loss) for r in records]
            assert sft_features_batch(records, tok, assistant_only_loss=assistant_only_loss, chunk=7) == one
            assert any(t == -100 for f in one for t in f["labels"]) == assistant_only_loss


def _prepare(tmp_path, **sections):
    from finetune.train.model import load_tokenizer
    from finetune.train.preflight import prepare_data

    path = resolve_recipe(tiny_recipe(**sections), run_dir=tmp_path / "run")
    recipe = load_recipe(path, allow_resolved=True)
    return prepare_data(recipe, load_tokenizer(recipe), state=_state())


def test_too_many_long_examples_is_an_error_with_the_count(tmp_path):
    lines = [GOOD] * 8 + [
        json.dumps({"messages": [{"role": "user", "content": "x" * 60}, {"role": "assistant", "content": "y"}]})
    ] * 2
    path = _write(tmp_path, lines, "long.jsonl")
    with pytest.raises(DataError) as info:
        _prepare(tmp_path, data={"sources": [{"path": str(path)}], "eval_sources": [], "max_length": 32})
    text = info.value.render()
    assert "2 of 10 train examples" in text and "row 9:" in text and str(path) in text, text
    # under the threshold they are dropped with a note instead
    data = _prepare(
        tmp_path,
        data={"sources": [{"path": str(path)}], "eval_sources": [], "max_length": 32, "max_too_long_fraction": 0.25},
    )
    assert len(data.train) == 8 and "dropped 2 of 10" in data.notes[0]


def test_chat_format_without_template_is_an_error(tmp_path):
    model = tmp_path / "notemplate"
    shutil.copytree(TINY_MODEL, model)
    (model / "chat_template.jinja").unlink()
    with pytest.raises(DataError) as info:
        _prepare(tmp_path, model={"name": str(model)})
    assert "chat template" in info.value.render() and "data.chat_template" in info.value.render()
    # an inline template fixes it
    data = _prepare(
        tmp_path,
        model={"name": str(model)},
        data={"chat_template": "{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}"},
    )
    assert len(data.train) == 64


def test_cache_hit_on_second_run_and_miss_with_another_tokenizer(tmp_path, caplog):
    first = _prepare(tmp_path)
    assert not first.cache_hit
    with caplog.at_level("INFO", logger="finetune.train"):
        second = _prepare(tmp_path)
    assert second.cache_hit and second.cache_key == first.cache_key
    assert f"tokenized data: cache hit {first.cache_key}" in caplog.text
    assert second.train["input_ids"] == first.train["input_ids"]
    # another tokenizer (one extra token changes the vocabulary) never reuses the entry
    other = tmp_path / "other-tok"
    tok = _tokenizer()
    tok.add_tokens(["<|extra|>"])
    shutil.copytree(TINY_MODEL, other)
    tok.save_pretrained(other)
    third = _prepare(tmp_path, model={"name": str(other)})
    assert not third.cache_hit and third.cache_key != first.cache_key


def test_eval_fraction_splits_train(tmp_path):
    data = _prepare(tmp_path, data={"eval_sources": [], "eval_fraction": 0.25})
    assert len(data.train) == 48 and len(data.eval) == 16


def test_resume_discovery_skips_incomplete_checkpoints(tmp_path):
    from finetune.checkpoints.marker import write_marker

    root = tmp_path / "checkpoints"
    for step, complete in ((2, True), (4, True), (6, False)):
        (root / f"checkpoint-{step}").mkdir(parents=True)
        if complete:  # complete = trainer_state.json + finetune's commit marker (finetune/checkpoints/marker.py)
            (root / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
            write_marker(root / f"checkpoint-{step}", step=step, world_size=1, strategy="ddp", fields={})
    assert latest_checkpoint(tmp_path).name == "checkpoint-4"
    assert resolve_resume("never", tmp_path) is None
    assert resolve_resume(str(root / "checkpoint-2"), tmp_path).name == "checkpoint-2"
    with pytest.raises(Exception, match="not a complete checkpoint"):
        resolve_resume(str(root / "checkpoint-6"), tmp_path)


def test_quickstart_recipe_validates():
    recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml")
    assert recipe.data.task_eval.n == 100
    assert (QUICKSTART_DATA / "eval.jsonl").exists()


def test_the_run_says_when_its_tokenizer_counts_other_lengths_than_the_plan(tmp_path):
    """The planner counts the data's lengths with the model's tokenizer.json; the run tokenizes every row with the
    tokenizer transformers builds (which can be rebuilt by class: a qwen2-typed directory holding another
    tokenizer.json trained 17% fewer tokens than planned on a GPU run). Preflight compares the two."""
    from finetune.train.preflight import planned_lengths_note

    packed = _prepare(tmp_path, data={"packing": True, "example_tokens": 10_000.0})
    (note,) = [n for n in packed.notes if "example_tokens" in n]
    assert "less memory and time than planned" in note and "set data.example_tokens:" in note, note
    measured = float(note.split("set data.example_tokens: ")[1].split()[0])
    agrees = _prepare(tmp_path / "again", data={"packing": True, "example_tokens": measured})
    assert not [n for n in agrees.notes if "example_tokens" in n], agrees.notes

    # unpacked sequences (DPO's, or SFT without packing): the longest sets the memory peak
    padded = load_recipe(
        tiny_recipe(data={"packing": False, "sequence_tokens": {"mean": 10, "longest": 20}, "max_length": 64})
    )
    assert "data.sequence_tokens.longest" in planned_lengths_note(padded, [12, 30, 18])
    assert "more memory and time than planned" in planned_lengths_note(padded, [12, 30, 18])
    assert planned_lengths_note(padded, [12, 21, 18]) == ""  # within 10%
    # packed examples planned a row each (data.sequence_tokens on a packed recipe): their longest is checked too
    rows = load_recipe(
        tiny_recipe(
            data={
                "packing": True,
                "example_tokens": 25.0,
                "sequence_tokens": {"mean": 24, "longest": 26},
                "max_length": 40,
            }
        )
    )
    assert planned_lengths_note(rows, [24, 25, 26]) == ""
    assert "data.sequence_tokens.longest" in planned_lengths_note(rows, [25] * 20 + [29])  # examples agree


def test_eval_rows_holds_out_that_many_rows(tmp_path):
    data = _prepare(tmp_path, data={"eval_sources": [], "eval_rows": 12})
    assert len(data.train) == 52 and len(data.eval) == 12
    with pytest.raises(DataError) as caught:
        _prepare(tmp_path / "all", data={"eval_sources": [], "eval_rows": 64})
    assert caught.value.key == "data.eval_rows" and "64 asked for the eval set" in caught.value.message


def test_one_way_of_holding_out_eval_rows_at_a_time():
    from finetune.errors import RecipeError

    base = {"model": {"name": "m", "arch": "llama-3.1-8b"}}
    for data in (
        {"path": "t.jsonl", "eval_fraction": 0.1, "eval_rows": 10},
        {"path": "t.jsonl", "eval_rows": 10, "eval_sources": [{"path": "e.jsonl"}]},
    ):
        with pytest.raises(RecipeError, match="set one of data.eval_sources, data.eval_fraction and data.eval_rows"):
            load_recipe(base | {"data": data})


def test_a_missing_column_is_mapped_with_that_sources_columns(tmp_path):
    """The fix names the source's own `columns:` (data.columns, data.sources[i].columns, data.task_eval.columns),
    not the shorthand's data.columns, which a recipe listing sources does not have."""
    path = _write(tmp_path, [json.dumps({"instruction": "x"})])
    with pytest.raises(DataError) as info:
        load_source(DataSource(path=str(path), format="alpaca"), base_dir=tmp_path)
    assert "map it with that source's columns: {output: <your column>}" in info.value.render()


def test_an_eval_split_the_local_rows_cannot_give_is_refused_before_launch(tmp_path):
    """The handbooks' test_split_size: 1000 converts to data.eval_rows: 1000; on 64 local rows the pre-launch data
    check refuses it (it had been the rank, after the launch and the model load)."""
    from finetune.data.check import check_data
    from tests.helpers.recipes import tiny_recipe

    raw = tiny_recipe(data={"eval_sources": [], "eval_rows": 1000})
    with pytest.raises(DataError) as caught:
        check_data(load_recipe(raw))
    assert (
        caught.value.key == "data.eval_rows" and "64 training rows, 1000 asked for the eval set" in caught.value.message
    )
    assert check_data(load_recipe(tiny_recipe(data={"eval_sources": [], "eval_rows": 12}))).rows == 64
