"""The knobs users port: 8-bit base + LoRA, more optimizers and Adam settings, LoRA+, regex targets,
NEFTune, RoPE scaling, dataset mixing by weight, `split` slicing on local files, and the planner's
view of them (8-bit weights, regex targets, the optimizer substitution under offload)."""

from __future__ import annotations

import json

import pytest

from finetune.data.sources import load_source
from finetune.data.splits import slice_rows
from finetune.errors import RecipeError
from finetune.recipe.load import load_recipe
from finetune.recipe.schema import DataSource
from tests.helpers.paths import QUICKSTART_DATA, SAMPLES
from tests.helpers.recipes import resolve_recipe, tiny_recipe


@pytest.mark.parametrize(
    "split,expect",
    [
        ("train", list(range(10))),
        ("train[:80%]", list(range(8))),
        ("train[80%:]", [8, 9]),
        ("train[2:4]", [2, 3]),
        ("train[-3:]", [7, 8, 9]),
        ("validation[:1]", [0]),
    ],
)
def test_split_slices(split, expect):
    assert slice_rows(list(range(10)), split) == expect


def test_split_slicing_is_honoured_on_local_files():
    path = str(SAMPLES / "alpaca.jsonl")
    whole = load_source(DataSource(path=path, format="alpaca"), base_dir=SAMPLES).records
    head = load_source(DataSource(path=path, format="alpaca", split="train[:25%]"), base_dir=SAMPLES).records
    assert len(head) == round(len(whole) / 4) and head[0]["_row"] == 1
    with pytest.raises(RecipeError, match="is not a split"):
        load_recipe(tiny_recipe(data={"sources": [{"path": path, "split": "train[:80"}]}))


def test_bad_knob_combinations_name_the_key():
    with pytest.raises(RecipeError, match="adapter.load_in_8bit"):
        load_recipe(tiny_recipe(adapter={"type": "full", "load_in_8bit": True}))
    with pytest.raises(RecipeError, match="adapter.loraplus_lr_ratio"):
        load_recipe(tiny_recipe(adapter={"type": "full", "loraplus_lr_ratio": 16}))
    with pytest.raises(RecipeError, match="not a valid regular expression"):
        load_recipe(tiny_recipe(adapter={"target_modules": "(q_proj"}))
    with pytest.raises(RecipeError, match="adapter.target_modules: an empty list targets no module"):
        load_recipe(tiny_recipe(adapter={"target_modules": []}))


def _job(**sections):
    from finetune.plan import job_from_recipe
    from finetune.registry import get_model, get_preset

    return job_from_recipe(
        load_recipe(tiny_recipe(**sections)), arch=get_model("llama-3.1-8b"), preset=get_preset("server-8xh100")
    )


def test_planner_reads_regex_targets_and_8bit_weights():
    from finetune.plan.memory import weight_bytes

    assert _job(adapter={"target_modules": r".*\.(q_proj|v_proj)"}).lora_targets == ("q_proj", "v_proj")
    bf16, int8 = (
        _job(model={"dtype": "bfloat16"}, train={"precision": "bf16"}),
        _job(adapter={"load_in_8bit": True}, model={"dtype": "bfloat16"}, train={"precision": "bf16"}),
    )
    assert 0.5 * weight_bytes(bf16) < weight_bytes(int8) < 0.6 * weight_bytes(bf16)


def test_plan_prints_the_optimizer_substitution_under_offload():
    from finetune.plan import plan, render_plan_table

    recipe = load_recipe(
        tiny_recipe(
            model={"name": "x", "arch": "llama-3.1-70b", "dtype": "bfloat16"},
            adapter={"type": "full"},
            distributed={"strategy": "zero3-offload"},
            train={"optimizer": "adamw_8bit", "precision": "bf16", "micro_batch_size": 1},
            data={"max_length": 2048},
        )
    )
    result = plan(recipe, hardware="server-8xh100")
    assert result.fits
    assert "substituted: train.optimizer adamw_8bit -> DeepSpeed's CPU AdamW" in render_plan_table(result)
    assert result.to_json()["substitutions"]


def test_plan_says_a_paged_optimizer_steps_unpaged_on_the_cpu():
    """bitsandbytes pages optimizer states between GPU memory and host RAM; on the CPU it falls back to its unpaged
    optimizer with a library warning only, which the plan says first."""
    from finetune.plan import plan

    for optimizer, said in (("paged_adamw_8bit", "adamw_8bit"), ("paged_adamw_32bit", "bitsandbytes' unpaged")):
        result = plan(load_recipe(tiny_recipe(train={"optimizer": optimizer})), hardware="cpu")
        assert any(s.startswith(f"train.optimizer {optimizer} -> {said}") for s in result.substitutions)
    assert not plan(load_recipe(tiny_recipe(train={"optimizer": "adamw_8bit"})), hardware="cpu").substitutions


@pytest.mark.parametrize(
    "optimizer,optim",
    [
        ("adafactor", "adafactor"),
        ("paged_adamw_32bit", "paged_adamw_32bit"),
        ("adamw_torch_fused", "adamw_torch_fused"),
    ],
)
def test_optimizers_and_adam_settings_reach_the_trainer(tmp_path, optimizer, optim):
    from finetune.train.trainers import training_args

    raw = tiny_recipe(
        train={"optimizer": optimizer, "adam_beta2": 0.95, "adam_epsilon": 1e-6, "neftune_noise_alpha": 5.0}
    )
    recipe = load_recipe(resolve_recipe(raw, run_dir=tmp_path), allow_resolved=True)
    args = training_args(recipe, run_dir=tmp_path, has_eval=False)
    assert args.optim == optim and args.adam_beta2 == 0.95 and args.adam_epsilon == 1e-6
    assert args.neftune_noise_alpha == 5.0


@pytest.mark.slow
def test_8bit_lora_plus_with_neftune_rope_regex_and_mixed_sources(tmp_path):
    from finetune.train.run import run_rank

    raw = tiny_recipe(
        model={"rope_scaling": {"type": "linear", "factor": 2.0}},
        adapter={"load_in_8bit": True, "loraplus_lr_ratio": 16.0, "target_modules": r".*\.(q_proj|v_proj|down_proj)"},
        data={
            "sources": [
                {"path": str(QUICKSTART_DATA / "train.jsonl"), "split": "train[:48]", "weight": 3.0},
                {"path": str(SAMPLES / "alpaca.jsonl"), "format": "alpaca", "split": "train[:16]", "weight": 1.0},
            ],
            "max_length": 64,
        },
        train={"max_steps": 6, "neftune_noise_alpha": 5.0, "optimizer": "adamw_torch_fused", "adam_beta2": 0.95},
    )
    run_dir = tmp_path / "run"
    summary = run_rank(resolve_recipe(raw, run_dir=run_dir), resume="never")
    assert summary["steps"] == 6 and summary["final_train_loss"] < summary["first_train_loss"]
    config = json.loads((run_dir / "adapter_config.json").read_text())
    assert config["target_modules"] == r".*\.(q_proj|v_proj|down_proj)"


def test_attention_dropout_override_reaches_the_loaded_model(tmp_path):
    """model.attention_dropout replaces config.json's in the model training loads (its attention layers read
    the config's value), and the planner plans the same value (tests/unit/plan/test_fallback.py)."""
    from finetune.train.model import load_model

    raw = tiny_recipe(model={"attention_dropout": 0.25})
    recipe = load_recipe(resolve_recipe(raw, run_dir=tmp_path), allow_resolved=True)
    model = load_model(recipe)
    assert model.config.attention_dropout == 0.25
    assert {layer.self_attn.attention_dropout for layer in model.model.layers} == {0.25}
