"""The calibration test's rebuild of a row from its `resolved` recipe (tests/helpers/calibration_rows.py), proved
on rows made here the way the GPU machine makes them: the real planner and compiler write the run
directory of a recipe (on presets `--hardware auto` synthesizes for an H100/H200), scripts/gpu_validate.py's
`collect()` reads it back into a row, and the model folder it planned from is then removed, as a GPU
machine's path does not exist on this one. The rows' "measurements" are the compile-time prediction, so
a faithful rebuild reproduces it exactly; no GPU figure is invented."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from finetune.compile import compile_run
from finetune.plan import plan_on
from finetune.recipe import load_recipe
from finetune.registry import resolve_model
from tests.helpers.calibration_rows import (
    memory_miss,
    pin_mismatch,
    predict,
    preset_for,
    speed_miss,
)
from tests.helpers.paths import ROOT

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
# a Qwen2.5-1.5B-shaped config.json: not a registry entry, so the row must carry it
QWEN_1_5B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


def _collect():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gpu_validate import collect
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return collect


def _row(
    tmp: Path, name: str, *, arch: str | None, config: dict | None, card: str, gpus: int, nodes: int = 1, **sections
) -> dict:
    """Plan and compile `sections` on a model folder of the "GPU machine", collect the run directory
    into a row, then remove the folder."""
    model = tmp / "gpu-machine" / (arch or name)
    model.mkdir(parents=True)
    if config is not None:
        (model / "config.json").write_text(json.dumps(config))
    raw = {
        "model": {"name": str(model), **({"arch": arch} if arch else {})},
        "data": {"path": str(tmp / "train.jsonl"), "max_length": 2048, "packing": True},
        "hardware": "auto",
        **sections,
    }
    recipe = load_recipe(raw)
    arch_obj = resolve_model(recipe.model)
    preset = preset_for(card, gpus_per_node=gpus, nodes=nodes)
    plan = plan_on(recipe, arch=arch_obj, preset=preset, source="auto")
    assert plan.fits, plan.why
    run_dir = tmp / name
    compile_run(recipe, plan, run_dir=run_dir, arch=arch_obj, preset=preset)
    row = {"name": name, "arch": arch, **_collect()(run_dir)}
    shutil.rmtree(model)
    # what collect() reads from the ranks' memory files and metrics, here the prediction itself
    row.update(
        card=card,
        measured_max_reserved_gib=row["predicted_gib"],
        measured_max_allocated_gib=row["predicted_gib"],
        steady_tokens_per_second=row["predicted_tokens_per_s"],
    )
    return row


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("calibration-rows")
    return {
        # DoRA at r 128 and seq 8192 on one H100: a tight fit, the planner checkpoints k of 32 layers
        "dora-r128-partial": _row(
            tmp,
            "dora-r128-partial",
            arch="llama-3.1-8b",
            config=None,
            card=H100,
            gpus=1,
            adapter={"type": "lora", "r": 128, "alpha": 256, "dora": True},
            data={"path": str(tmp / "train.jsonl"), "max_length": 8192, "packing": True},
            train={"global_batch_size": 8},
        ),
        # a model the registry does not have, full fine-tune on 2 x H200 as the planner chose it
        "full-qwen1.5b-config": _row(
            tmp,
            "full-qwen1.5b-config",
            arch=None,
            config=QWEN_1_5B,
            card=H200,
            gpus=2,
            adapter={"type": "full"},
            train={"global_batch_size": 16},
        ),
        # hybrid shard over 2 loopback nodes x 2 GPUs, pinned
        "lora3b-hybrid": _row(
            tmp,
            "lora3b-hybrid",
            arch="llama-3.2-3b",
            config=None,
            card=H200,
            gpus=2,
            nodes=2,
            train={"global_batch_size": 8},
            distributed={"strategy": "fsdp2-hybrid"},
        ),
    }


def test_collect_keeps_the_resolved_recipe_and_an_unregistered_models_config(rows):
    dora = rows["dora-r128-partial"]
    assert "model_config" not in dora  # planned from the registry entry the model folder matches
    assert dora["resolved"]["adapter"]["dora"] is True and dora["resolved"]["adapter"]["r"] == 128
    k = dora["resolved"]["resolved"]["checkpoint_layers"]
    assert 0 < k < 32 and dora["resolved"]["train"]["activation_checkpointing"] == "on"
    assert rows["full-qwen1.5b-config"]["model_config"] == QWEN_1_5B
    assert rows["lora3b-hybrid"]["resolved"]["resolved"]["num_nodes"] == 2


@pytest.mark.parametrize("name", ["dora-r128-partial", "full-qwen1.5b-config", "lora3b-hybrid"])
def test_a_row_rebuilds_to_the_plan_its_run_was_compiled_with(rows, name):
    row = rows[name]
    assert not Path(row["resolved"]["model"]["name"]).exists()
    plan = predict(row)
    assert pin_mismatch(row, plan) == ""
    assert plan.per_gpu_memory_gib == pytest.approx(row["predicted_gib"], abs=0.006)
    assert plan.tokens_per_second == pytest.approx(row["predicted_tokens_per_s"], rel=1e-4)  # plan.json rounds
    assert memory_miss(row, plan) == "" and speed_miss(row, plan) == ""


def test_partial_checkpointing_is_rebuilt_as_k_of_l_not_every_layer(rows):
    row = rows["dora-r128-partial"]
    plan = predict(row)
    assert plan.checkpoint_layers == row["resolved"]["resolved"]["checkpoint_layers"] < plan.num_layers


def test_a_plan_that_is_not_the_runs_configuration_is_reported(rows):
    row = json.loads(json.dumps(rows["lora3b-hybrid"]))
    row["resolved"]["resolved"]["gradient_accumulation_steps"] = 3  # the run says 3, its batch says 1
    assert "gradient_accumulation_steps: ran 3, planned 1" in pin_mismatch(row, predict(row))


def test_a_measurement_outside_the_bounds_is_reported_with_its_figures(rows):
    row = dict(rows["full-qwen1.5b-config"])
    row["measured_max_reserved_gib"] = row["predicted_gib"] / 0.9  # predicted 10% under what ran
    row["steady_tokens_per_second"] = row["predicted_tokens_per_s"] / 1.3
    plan = predict(row)
    assert "ratio 0.900" in memory_miss(row, plan)
    assert "ratio 1.300" in speed_miss(row, plan)


def test_a_resolved_row_without_a_model_is_refused(rows):
    row = {k: v for k, v in rows["full-qwen1.5b-config"].items() if k != "model_config"}
    with pytest.raises(ValueError, match="neither `arch` nor `model_config`"):
        predict(row)
