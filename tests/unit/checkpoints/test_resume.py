"""Resume safety: the commit marker records world size, strategy, versions and the recipe; a changed
recipe is refused naming the keys (exit 2) unless only safe keys changed; another world size is
allowed for DDP/FSDP2 and refused for ZeRO-3. Plus: data path safety."""

from __future__ import annotations

import os

import pytest

from finetune.checkpoints.fields import recipe_fields
from finetune.checkpoints.marker import MARKER, read_marker, write_marker
from finetune.checkpoints.resume import check_resume, is_complete, latest_checkpoint
from finetune.checkpoints.retention import retain
from finetune.errors import DataError, RecipeError
from finetune.recipe.load import load_recipe
from finetune.recipe.paths import check_data_path
from tests.helpers.paths import ROOT
from tests.helpers.recipes import resolve_recipe, tiny_recipe, write_recipe


def _ckpt(tmp_path, recipe, *, step=4, world_size=1, strategy="ddp"):
    ckpt = tmp_path / "run" / "checkpoints" / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(b"x" * 100)
    write_marker(ckpt, step=step, world_size=world_size, strategy=strategy, fields=recipe_fields(recipe))
    return ckpt


@pytest.fixture
def recipe(tmp_path):
    return load_recipe(resolve_recipe(tiny_recipe(), run_dir=tmp_path / "run"), allow_resolved=True)


def test_marker_records_what_resume_needs(tmp_path, recipe):
    marker = read_marker(_ckpt(tmp_path, recipe))
    assert marker["world_size"] == 1 and marker["strategy"] == "ddp" and marker["step"] == 4
    assert {"torch", "transformers", "trl", "peft", "accelerate"} <= set(marker["versions"])
    assert len(marker["recipe_hash"]) == 16 and marker["files"]["model.safetensors"] == 100


def test_truncated_file_makes_a_checkpoint_incomplete(tmp_path, recipe):
    ckpt = _ckpt(tmp_path, recipe)
    assert is_complete(ckpt)
    (ckpt / "model.safetensors").write_bytes(b"x" * 10)
    assert not is_complete(ckpt) and latest_checkpoint(tmp_path / "run") is None


def test_retention_keeps_the_newest_complete(tmp_path, recipe):
    for step in (2, 4, 6):
        _ckpt(tmp_path, recipe, step=step)
    (tmp_path / "run" / "checkpoints" / "checkpoint-8").mkdir()  # being written: never counted
    removed = retain(tmp_path / "run", keep=1)
    assert [p.name for p in removed] == ["checkpoint-2", "checkpoint-4"]
    assert latest_checkpoint(tmp_path / "run").name == "checkpoint-6"


def test_changed_training_keys_are_refused_by_name(tmp_path, recipe):
    ckpt = _ckpt(tmp_path, recipe)
    changed = recipe.model_copy(deep=True)
    changed.train.lr = 1e-2
    changed.adapter.r = 4
    with pytest.raises(RecipeError) as info:
        check_resume(ckpt, changed)
    text = info.value.render()
    assert "train.lr (0.003 -> 0.01)" in text and "adapter.r (8 -> 4)" in text and info.value.exit_code == 2


def test_safe_changes_continue_and_are_reported(tmp_path, recipe):
    ckpt = _ckpt(tmp_path, recipe)
    changed = recipe.model_copy(deep=True)
    changed.train.max_steps = 10
    changed.output.keep = 5
    changed.train.logging_steps = 3
    # another machine may resolve other kernels for the same math
    changed.model.attn_implementation = "varlen"
    changed.train.liger = "on"
    notes = check_resume(ckpt, changed)
    assert any("train.liger" in n for n in notes) and any("model.attn_implementation" in n for n in notes)
    assert any(n.startswith("train.max_steps (6 -> 10)") for n in notes), notes
    assert any("output.keep" in n for n in notes) and any("train.logging_steps" in n for n in notes)
    fewer = recipe.model_copy(deep=True)
    fewer.train.max_steps = 3
    with pytest.raises(RecipeError, match="train.max_steps"):
        check_resume(ckpt, fewer)


@pytest.mark.parametrize(
    "strategy,allowed",
    [
        ("ddp", True),
        ("fsdp2", True),
        ("zero3", False),
        ("zero3-offload", False),
        ("zero2", False),
        ("zero3-optim-offload", False),
        ("fsdp2-offload", True),
    ],
)
def test_other_world_size(tmp_path, recipe, strategy, allowed):
    recipe.distributed.strategy = strategy
    ckpt = _ckpt(tmp_path, recipe, world_size=8, strategy=strategy)
    if allowed:
        notes = check_resume(ckpt, recipe, world_size=4)
        assert any("world size 8 -> 4" in n for n in notes), notes
    else:
        with pytest.raises(RecipeError, match="partitioned per rank"):
            check_resume(ckpt, recipe, world_size=4)
    with pytest.raises(RecipeError, match="distributed.strategy"):
        other = recipe.model_copy(deep=True)
        other.distributed.strategy = "ddp" if strategy != "ddp" else "fsdp2"
        check_resume(ckpt, other, world_size=8)


def test_data_paths_outside_the_project_are_refused(tmp_path):
    base = tmp_path / "proj" / "recipes"
    base.mkdir(parents=True)
    (tmp_path / "proj" / "pyproject.toml").write_text("")
    (tmp_path / "proj" / "data.jsonl").write_text("{}\n")
    secret = tmp_path / "secret.jsonl"
    secret.write_text("{}\n")
    guard = dict(key="data.sources[0].path", base_dir=base, cwd=base)
    assert check_data_path(base / ".." / "data.jsonl", **guard) == (tmp_path / "proj" / "data.jsonl")
    with pytest.raises(DataError, match="outside the recipe's directory"):
        check_data_path(base / ".." / ".." / "secret.jsonl", **guard)
    with pytest.raises(DataError, match="outside"):
        check_data_path(secret, **guard)
    os.symlink(secret, base / "link.jsonl")
    with pytest.raises(DataError, match="through a symlink"):
        check_data_path(base / "link.jsonl", **guard)
    assert check_data_path(base / "link.jsonl", allow_paths=[str(tmp_path)], **guard) == secret
    assert check_data_path(secret, allow_outside=True, **guard) == secret


def test_shipped_quickstart_paths_are_inside_its_project():
    from finetune.data.check import check_data

    check_data(load_recipe(ROOT / "recipes" / "quickstart.yaml"))  # ../data/... is inside the repository


def test_validate_refuses_an_escaping_data_path(tmp_path, capsys):
    from finetune.cli import main

    (tmp_path / "secret.jsonl").write_text('{"messages": []}\n')
    sub = tmp_path / "proj"
    sub.mkdir()
    (sub / "pyproject.toml").write_text("")
    recipe = write_recipe(sub / "recipe.yaml", data={"sources": [{"path": "../secret.jsonl"}]})
    cwd = os.getcwd()
    os.chdir(sub)
    try:
        rc = main(["validate", str(recipe)])
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert rc == 2 and "data.sources[0].path" in err and "allow_paths" in err, err
    assert MARKER == "finetune_complete.json"
