"""Recipe schema and loader: strictness, error messages, extends, --set overrides."""

from pathlib import Path

import pytest
import yaml

from finetune.errors import RecipeError
from finetune.recipe import load_recipe
from finetune.recipe.load import dump_recipe
from tests.helpers.paths import ROOT

RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))
BASE = {"model": {"name": "meta-llama/Llama-3.1-8B"}, "data": {"path": "d.jsonl"}}


def _err(update: dict, overrides=None) -> str:
    raw = {**BASE, **update}
    with pytest.raises(RecipeError) as info:
        load_recipe(raw, overrides=overrides)
    return info.value.render()


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.model.name
    # the first line of each recipe says what it does
    assert path.read_text().startswith("#")


def test_defaults_are_written_out():
    recipe = load_recipe(BASE)
    assert recipe.method.type == "sft" and recipe.adapter.type == "lora"
    assert recipe.train.micro_batch_size == "auto" and recipe.distributed.strategy == "auto"
    assert recipe.data.sources[0].format == "messages"
    # a dump round-trips to the same recipe
    assert load_recipe(yaml.safe_load(dump_recipe(recipe))) == recipe


def test_unknown_key_names_full_path_and_suggestion():
    msg = _err({"train": {"shceduler": "cosine"}})
    assert msg.startswith("train.shceduler: unknown key; did you mean train.scheduler?")


def test_unknown_nested_key_in_list():
    msg = _err({"data": {"sources": [{"path": "a.jsonl", "formatt": "alpaca"}]}})
    assert "data.sources[0].formatt: unknown key; did you mean data.sources[0].format?" in msg


def test_unknown_top_level_key_without_close_match_lists_valid_keys():
    msg = _err({"zzzz": 1})
    assert "zzzz: unknown key" in msg and "valid keys here:" in msg and "train" in msg


def test_wrong_type_names_key_and_value():
    msg = _err({"train": {"lr": "fast"}})
    assert msg.startswith("train.lr:") and "'fast'" in msg and "fix:" in msg


def test_wrong_literal_lists_choices():
    msg = _err({"train": {"optimizer": "sgd"}})
    assert "train.optimizer" in msg and "adamw_8bit" in msg


@pytest.mark.parametrize(
    "update,key,fix",
    [
        ({"method": "dpo"}, "data.sources[0].format", "format: preference"),
        ({"train": {"epochs": 1, "max_steps": 10}}, "train.max_steps", "keep one"),
        (
            {"logging": {"profile_steps": [3, 5], "memory_profile_step": 4}},
            "logging.memory_profile_step",
            "memory_profile_step: 5",
        ),
        (
            {"adapter": {"type": "qlora", "storage_dtype": "uint8"}, "distributed": {"strategy": "fsdp2"}},
            "adapter.storage_dtype",
            "storage_dtype: bfloat16",
        ),
        (
            {
                "model": {"name": "meta-llama/Llama-3.1-8B", "dtype": "float32"},
                "adapter": {"type": "qlora", "storage_dtype": "float32"},
                "distributed": {"strategy": "fsdp2"},
            },
            "adapter.storage_dtype",
            "adapter.storage_dtype to bfloat16",
        ),
        ({"adapter": {"type": "full", "dora": True}}, "adapter.dora", "adapter.type: lora"),
        (
            {"method": "kto", "data": {"path": "p.jsonl", "format": "unpaired", "packing": True}},
            "data.packing",
            "packing: false",
        ),
        ({"data": {"path": "p.jsonl", "format": "preference"}}, "data.sources[0].format", "method: dpo"),
        (
            {
                "method": {"type": "dpo", "reference": "implicit"},
                "adapter": "full",
                "data": {"path": "p.jsonl", "format": "preference"},
            },
            "method.reference",
            "reference: copy",
        ),
        # a tier with no no_sync to skip: refused rather than silently ignored
        (
            {"distributed": {"strategy": "zero2", "sync_each_batch": True}},
            "distributed.sync_each_batch",
            "remove distributed.sync_each_batch or set it to auto",
        ),
        (
            {"distributed": {"strategy": "fsdp2-offload", "sync_each_batch": True}},
            "distributed.sync_each_batch",
            "only fsdp2, fsdp2-hybrid",
        ),
    ],
)
def test_conflicts_say_how_to_fix(update, key, fix):
    msg = _err(update)
    assert msg.startswith(key + ":") and fix in msg


def test_missing_section():
    with pytest.raises(RecipeError) as info:
        load_recipe({"model": {"name": "x"}})
    assert info.value.render().startswith("data: required key is missing")


def test_overrides_are_type_checked():
    recipe = load_recipe(BASE, overrides=["train.lr=3e-4", "adapter.r=32", "distributed.strategy=zero3"])
    assert recipe.train.lr == 3e-4 and recipe.adapter.r == 32
    assert recipe.distributed.strategy == "zero3"
    assert "adapter.r:" in _err({}, overrides=["adapter.r=many"])
    assert "did you mean adapter.alpha" in _err({}, overrides=["adapter.alhpa=8"])
    with pytest.raises(RecipeError, match="KEY=VALUE"):
        load_recipe(BASE, overrides=["train.lr"])


def test_extends_merges_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({**BASE, "train": {"lr": 1e-4, "seed": 7}}))
    (tmp_path / "child.yaml").write_text("extends: base.yaml\ntrain:\n  lr: 5.0e-5\n")
    recipe = load_recipe(tmp_path / "child.yaml")
    assert recipe.train.lr == 5e-5 and recipe.train.seed == 7


def test_extends_cycle_and_missing_file(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: nowhere.yaml\n")
    with pytest.raises(RecipeError, match="file not found"):
        load_recipe(tmp_path / "c.yaml")


def test_yaml_syntax_error_names_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  name: x\n data: [\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert str(path) in info.value.render() and "line" in info.value.render()


def test_resolved_section_is_not_for_users():
    msg = _err({"resolved": {"hardware": "cpu"}})
    assert msg.startswith("resolved:") and "planner" in msg


def test_chat_template_is_jinja_text_or_a_file_path():
    from finetune.recipe.paths import is_inline_template

    for text in (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "{# only a comment #}",
        "line one\nline two",
    ):
        assert is_inline_template(text), text
    for path in ("templates/chat.jinja", "/abs/llama3.jinja", "~/t.jinja", "chat{1}.jinja"):
        assert not is_inline_template(path), path


def test_relative_paths_are_anchored_at_the_recipe_folder(tmp_path, monkeypatch):
    from finetune.recipe.paths import anchored

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert anchored("data/x.jsonl", tmp_path) == tmp_path / "data" / "x.jsonl"
    assert anchored("/abs/x.jsonl", tmp_path) == Path("/abs/x.jsonl")
    assert anchored("~/x.jsonl", tmp_path) == tmp_path / "home" / "x.jsonl"


@pytest.mark.parametrize(
    "method,adapter,reference,expected",
    [
        ("sft", "lora", "auto", "none"),
        ("dpo", "lora", "auto", "implicit"),
        ("dpo", "qlora", "auto", "implicit"),
        ("dpo", "full", "auto", "copy"),
        ("dpo", "lora", "copy", "copy"),
        ("dpo", "full", "precompute", "precompute"),
    ],
)
def test_dpo_reference_auto_is_decided_once(method, adapter, reference, expected):
    from finetune.plan import job_from_recipe
    from finetune.recipe.schema import dpo_reference
    from finetune.registry import get_model, get_preset

    fmt = "preference" if method == "dpo" else "messages"
    recipe = load_recipe(
        {
            **BASE,
            "method": {"type": method, "reference": reference},
            "adapter": adapter,
            "data": {"path": "p.jsonl", "format": fmt},
        }
    )
    assert dpo_reference(recipe) == expected
    job = job_from_recipe(recipe, arch=get_model("llama-3.1-8b"), preset=get_preset("server-8xh100"))
    assert job.reference == expected  # the planner asks the same function as the trainer


def test_every_schema_field_is_described_and_the_reference_is_current():
    import subprocess
    import sys

    from pydantic import BaseModel

    from finetune.recipe import schema

    sections = [
        c
        for c in vars(schema).values()
        if isinstance(c, type) and issubclass(c, BaseModel) and c.__module__ == schema.__name__
    ]
    undocumented = [
        f"{c.__name__}.{name}"
        for c in sections
        for name, info in c.model_fields.items()
        if not (info.description or "").strip()
    ]
    assert undocumented == []
    proc = subprocess.run(
        [sys.executable, "scripts/recipe_reference.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
