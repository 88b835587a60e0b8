"""The planner's per-GPU peak against peaks measured on real GPUs.

Every row of tests/data/gpu_calibration.json is one `finetune run` on an H100 80GB or H200 with
`--hardware auto`. The recipe is rebuilt here with the run's pins (strategy, micro-batch, no activation
checkpointing) on the preset `--hardware auto` synthesizes for that card and GPU count, and the
prediction must lie in [0.95, 1.20] x the measured max reserved of the worst rank: never more than 5%
below it, never more than 20% above it. Rows with an `excluded` key are superseded measurements.
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune import strategies
from finetune.plan import job_from_recipe, plan_job
from finetune.recipe import load_recipe
from finetune.registry import get_model
from finetune.registry.detect import parse_nvidia_smi, synthesize_preset

DATA = Path(__file__).resolve().parent / "data" / "gpu_calibration.json"
LOW, HIGH = 0.95, 1.20
# `nvidia-smi --query-gpu=name,memory.total --format=csv,noheader` on the measured cards
MEMORY_TOTAL = {"NVIDIA H100 80GB HBM3": "81559 MiB", "NVIDIA H200": "143771 MiB"}


def _rows() -> list[dict]:
    return [r for r in json.loads(DATA.read_text()) if "excluded" not in r]


def _predict(row: dict):
    nodes = row.get("nodes", 1)  # hybrid rows: loopback "nodes" of one host (scripts/gpu_validate.py)
    smi = "\n".join([f"{row['card']}, {MEMORY_TOTAL[row['card']]}"] * (row["world_size"] // nodes))
    preset = synthesize_preset(parse_nvidia_smi(smi), ram_gib=1024)
    if nodes > 1:
        preset = preset.model_copy(update={"nodes": nodes, "inter_node_fabric": "ethernet",
                                           "inter_node_bandwidth_gbps": 25})
    dpo = row["method"] == "dpo"
    raw = {
        # rows measured before finetune chose varlen attention and skipped peft's input casts carry neither key
        "model": {"name": row["arch"], "arch": row["arch"], "dtype": "bfloat16",
                  "attn_implementation": row.get("attn_implementation", "sdpa")},
        "method": {"type": row["method"]},
        "adapter": {"type": row["adapter"], "r": 16, "alpha": 32, "dropout": row.get("lora_dropout", 0.0),
                    "cast_adapter_inputs": row.get("cast_adapter_inputs", True)},
        # SFT packs padding-free; DPO pads chosen/rejected (pairs filling max_length)
        "data": {"path": "train.jsonl", "max_length": row["seq_len"], "packing": not dpo,
                 "format": "preference" if dpo else "messages"},
        "train": {"global_batch_size": row["micro_batch_size"] * row["gradient_accumulation_steps"]
                  * row["world_size"], "micro_batch_size": row["micro_batch_size"],
                  "activation_checkpointing": "on" if row["activation_checkpointing"] else "off",
                  "liger": "on" if row.get("liger") else "off"},
        "distributed": {"strategy": row["strategy"], **(
            {"nvme_path": "/tmp/nvme-swap"} if strategies.info(row["strategy"]).offload == "nvme" else {})},
        "hardware": "auto",
    }
    recipe = load_recipe(raw)
    return plan_job(job_from_recipe(recipe, arch=get_model(row["arch"]), preset=preset))


def test_calibration_data_is_present():
    rows = _rows()
    assert len(rows) >= 7
    assert {r["strategy"] for r in rows} >= {"ddp", "fsdp2", "fsdp2-hybrid", "zero3", "zero3-offload", "zero3-nvme"}
    assert {r["adapter"] for r in rows} >= {"full", "lora", "qlora"}


def test_predicted_peak_within_bounds_of_measured_reserved():
    lines, bad = [], []
    for row in _rows():
        p = _predict(row)
        # the plan reproduces the run's configuration, or the comparison means nothing
        assert (p.strategy, p.micro_batch_size, p.gradient_accumulation_steps, p.world_size) == (
            row["strategy"], row["micro_batch_size"], row["gradient_accumulation_steps"], row["world_size"])
        measured = row["measured_max_reserved_gib"]
        ratio = p.per_gpu_memory_gib / measured
        line = (f"{row['name']:14} {row['card'][:20]:20} x{row['world_size']} {row['strategy']:6} "
                f"mb{row['micro_batch_size']}  predicted {p.per_gpu_memory_gib:6.2f}  reserved {measured:6.2f}"
                f"  allocated {row['measured_max_allocated_gib']:6.2f}  ratio {ratio:.3f}")
        lines.append(line)
        if not LOW <= ratio <= HIGH:
            bad.append(line)
    table = "\n".join(lines)
    assert not bad, f"outside [{LOW}, {HIGH}] x measured max reserved:\n" + "\n".join(bad) + "\n\n" + table
