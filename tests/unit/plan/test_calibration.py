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

import pytest

from finetune import strategies
from finetune.plan import job_from_recipe, plan_job
from finetune.recipe import load_recipe
from finetune.registry import get_model
from finetune.registry.detect import parse_nvidia_smi, synthesize_preset

DATA = Path(__file__).resolve().parents[3] / "tests" / "data" / "gpu_calibration.json"
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


# --- steady tokens/s (issue 13: within +-25% of the planner's tokens/s, the one step-time model of
# finetune/plan/timing.py) and the tighter memory bound (-5% / +15%), row by row ---------------
SPEED_LOW, SPEED_HIGH = 0.75, 1.25  # predicted / measured steady tokens/s
MEMORY_LOW, MEMORY_HIGH = 0.95, 1.15  # predicted / measured max reserved
# Rows the current models miss, by _row_id. Not fitted away: the lead decides with new GPU data.
SPEED_MISSES = {
    "14-qlora8b-fsdp2": "QLoRA under FSDP2 on 2 GPUs: predicted faster than measured",
    "17-full3b-fsdp2": ("full 3B FSDP2: predicted ~9x faster; row 18, the same setting without a mid-run "
                        "checkpoint in the measured window, holds"),
    "21-lora3b-hybrid-2x2": "fsdp2-hybrid on two loopback 'nodes' of one host: predicted ~3.6x faster",
    "22-lora8b-zero3-offload": "ZeRO-3 CPU offload: predicted ~2x faster (fetch stalls, CPU Adam)",
    "24-full8b-zero3-offload": "ZeRO-3 CPU offload: predicted ~2x faster (fetch stalls, CPU Adam)",
    "25-lora8b-zero3-nvme": "ZeRO-Infinity NVMe offload: predicted slower than measured",
    "27-qlora70b-1gpu": ("70B QLoRA on one H100, checkpointing every layer at seq 4096: predicted slower "
                         "than measured"),
}
MEMORY_MISSES = {
    "01-dpo8b": "DPO LoRA on H100 predicted more than 15% over the measured max reserved",
}


def _indexed_rows() -> list[tuple[str, dict]]:
    return [(f"{i:02d}-{r['name']}", r) for i, r in enumerate(json.loads(DATA.read_text())) if "excluded" not in r]


def _params(rows: list[tuple[str, dict]], misses: dict[str, str], figures):
    out = []
    for row_id, row in rows:
        marks = ()
        if row_id in misses:
            marks = pytest.mark.xfail(reason=f"{misses[row_id]}: {figures(row)}", strict=False)
        out.append(pytest.param(row, id=row_id, marks=marks))
    return out


def _speed_figures(row: dict) -> str:
    p = _predict(row)
    measured = row["steady_tokens_per_second"]
    return (f"measured {measured:,.0f} tokens/s, predicted {p.tokens_per_second:,.0f} "
            f"(ratio {p.tokens_per_second / measured:.3f})")


def _memory_figures(row: dict) -> str:
    p = _predict(row)
    measured = row["measured_max_reserved_gib"]
    ratio = p.per_gpu_memory_gib / measured
    return f"measured {measured:.2f} GiB, predicted {p.per_gpu_memory_gib:.2f} (ratio {ratio:.3f})"


def _speed_rows():
    rows = [(i, r) for i, r in _indexed_rows() if r.get("steady_tokens_per_second")]
    return _params(rows, SPEED_MISSES, _speed_figures)


def _memory_rows():
    return _params(_indexed_rows(), MEMORY_MISSES, _memory_figures)


def test_every_listed_miss_is_a_row():
    ids = {i for i, _ in _indexed_rows()}
    assert set(SPEED_MISSES) <= ids and set(MEMORY_MISSES) <= ids
    assert len([r for _, r in _indexed_rows() if r.get("steady_tokens_per_second")]) >= 9


@pytest.mark.parametrize("row", _speed_rows())
def test_predicted_steady_tokens_per_second_within_25_percent(row):
    p = _predict(row)
    ratio = p.tokens_per_second / row["steady_tokens_per_second"]
    assert SPEED_LOW <= ratio <= SPEED_HIGH, _speed_figures(row)


@pytest.mark.parametrize("row", _memory_rows())
def test_predicted_peak_within_minus_5_plus_15_percent_of_measured_reserved(row):
    p = _predict(row)
    ratio = p.per_gpu_memory_gib / row["measured_max_reserved_gib"]
    assert MEMORY_LOW <= ratio <= MEMORY_HIGH, _memory_figures(row)
