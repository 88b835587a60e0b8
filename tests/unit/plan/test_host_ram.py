"""The host RAM the planner gives a node for loading: FSDP2's sharded load (finetune/train/sharded_load.py)
holds one checkpoint tensor per rank at a time, the accelerate way holds the whole model once per node; the
70B runs that loaded sharded on H100s (calibration rows) used less than planned."""

from __future__ import annotations

import json

import pytest

from finetune.plan import job_from_recipe, plan_on
from finetune.plan.memory import largest_tensor_bytes
from finetune.plan.types import GIB
from finetune.plan.workload import count_params
from finetune.recipe import load_recipe
from finetune.registry import get_model
from tests.helpers.calibration_rows import predict, preset_for
from tests.helpers.paths import ROOT

PRESET = preset_for("NVIDIA H100 80GB HBM3", gpus_per_node=8)
ARCH = get_model("llama-3.3-70b")


def _recipe(**sections):
    raw = {
        "model": {"name": "llama-3.3-70b", "arch": "llama-3.3-70b"},
        "adapter": {"type": "lora"},
        "data": {"path": "t.jsonl", "packing": True, "max_length": 4096},
        "train": {"global_batch_size": 64, "micro_batch_size": 2, "activation_checkpointing": "on"},
        "hardware": "auto",
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return load_recipe(raw)


def _host(recipe, strategy: str) -> float:
    plan = plan_on(recipe, arch=ARCH, preset=PRESET, source="test")
    (candidate,) = [c for c in plan.candidates if c.strategy == strategy]
    return candidate.host_ram_bytes


def test_fsdp2_loading_sharded_plans_one_tensor_per_rank_not_the_model():
    model = count_params(ARCH).total * 2
    sharded = _host(_recipe(), "fsdp2")
    whole = _host(_recipe(distributed={"sharded_load": False}), "fsdp2")
    print(f"70B LoRA on 8 GPUs, host RAM per node: sharded {sharded / GIB:.1f} GiB, whole {whole / GIB:.1f} GiB")
    assert whole - sharded == pytest.approx(
        model - 8 * largest_tensor_bytes(job_from_recipe(_recipe(), arch=ARCH, preset=PRESET))
    )
    assert sharded < 0.4 * model < whole
    # ZeRO-3 loads the accelerate/DeepSpeed way whatever the switch says
    assert _host(_recipe(), "zero3") == _host(_recipe(distributed={"sharded_load": False}), "zero3")


def test_a_recipe_the_sharded_load_cannot_serve_is_planned_loading_whole():
    dora = _recipe(adapter={"type": "lora", "dora": True})
    assert not job_from_recipe(dora, arch=ARCH, preset=PRESET).sharded_load
    assert job_from_recipe(_recipe(), arch=ARCH, preset=PRESET).sharded_load
    assert job_from_recipe(_recipe(adapter={"type": "full"}), arch=ARCH, preset=PRESET).sharded_load
    full_dpo = _recipe(
        adapter={"type": "full"}, method={"type": "dpo"}, data={"format": "preference", "packing": False}
    )
    assert not job_from_recipe(full_dpo, arch=ARCH, preset=PRESET).sharded_load  # TRL copies it as the reference


@pytest.mark.parametrize("name", ["lora70b-preempt", "qlora70b-fsdp2-2gpu"])
def test_the_70b_runs_that_loaded_sharded_used_less_host_ram_than_planned(name):
    rows = json.loads((ROOT / "tests" / "data" / "gpu_calibration.json").read_text())
    (row,) = [r for r in rows if r["name"] == name]
    plan = predict(row)
    planned = plan.host_ram_gib
    print(f"{name}: node PSS {row['host_pss_node_gib']} GiB, planned {planned:.1f} GiB")
    assert row["host_pss_node_gib"] < planned < 4 * row["host_pss_node_gib"]
