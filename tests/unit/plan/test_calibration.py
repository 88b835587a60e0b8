"""The planner's per-GPU peak and steady tokens/s against what real GPUs measured.

Every row of tests/data/gpu_calibration.json is one `finetune run` on an H100 80GB or H200 with
`--hardware auto`. Its plan is rebuilt here (tests/helpers/calibration_rows.py): from the run's whole
recipe.resolved.yaml where the row carries it (`resolved`), else from the few fields older rows kept, on
the preset `--hardware auto` synthesizes for that card and GPU count. The plan must reproduce the run's
configuration (strategy, micro-batch, accumulation, world size, checkpointed layers) before anything is
compared. Memory: the prediction lies in [0.95, 1.20] x the measured max reserved of the worst rank
(the issue-13 bound, [0.95, 1.15], per row below). Rows with an `excluded` key are superseded measurements.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.calibration_rows import memory_figures, memory_miss, pin_mismatch, predict, speed_figures, speed_miss

DATA = Path(__file__).resolve().parents[3] / "tests" / "data" / "gpu_calibration.json"


def _rows() -> list[dict]:
    return [r for r in json.loads(DATA.read_text()) if "excluded" not in r]


def _predict(row: dict):
    plan = predict(row)
    # the plan reproduces the run's configuration, or the comparison means nothing
    mismatch = pin_mismatch(row, plan)
    assert not mismatch, f"{row['name']}: the rebuilt plan is not the run's: {mismatch}"
    return plan


def test_calibration_data_is_present():
    rows = _rows()
    assert len(rows) >= 7
    assert {r["strategy"] for r in rows} >= {"ddp", "fsdp2", "fsdp2-hybrid", "zero3", "zero3-offload", "zero3-nvme"}
    assert {r["adapter"] for r in rows} >= {"full", "lora", "qlora"}


# --- steady tokens/s (within +-25% of the planner's tokens/s, the one step-time model of
# finetune/plan/timing.py) and the tighter memory bound (-5% / +15%), row by row: tests/helpers/calibration_rows.py.
# Rows the current models miss, by _row_id. Not fitted away: the models change only with new GPU data.
SPEED_MISSES = {
    "14-qlora8b-fsdp2": "QLoRA under FSDP2 on 2 GPUs: predicted faster than measured",
    "17-full3b-fsdp2": (
        "full 3B FSDP2: predicted ~9x faster; row 18, the same setting without a mid-run "
        "checkpoint in the measured window, holds"
    ),
    "21-lora3b-hybrid-2x2": "fsdp2-hybrid on two loopback 'nodes' of one host: predicted ~3.6x faster",
    "22-lora8b-zero3-offload": (
        "ZeRO-3 CPU offload, LoRA: the modelled PCIe traffic (two blocking 16-bit "
        "fetches per micro-batch at 45 GB/s) is 0.38 s and CPU Adam negligible; about "
        "1 s per step is not explained (the fetch rate, or stalls between the copies)"
    ),
    "24-full8b-zero3-offload": (
        "ZeRO-3 CPU offload, full: with DeepSpeed's fetch and gradient traffic "
        "modelled, CPU Adam's assumed 2e9 params/s per node is what remains; the "
        "row implies ~0.9e9 on a host shared with another run"
    ),
    "25-lora8b-zero3-nvme": "ZeRO-Infinity NVMe offload: predicted slower than measured",
    "43-qwen-moe-a2.7b-lora": (
        "MoE (60 experts, top-4): the small grouped expert GEMMs (~1,100 rows per expert) and the "
        "dispatch traffic (finetune/plan/moe_time.py) explain about half of the gap to the active "
        "parameters' FLOPs at the dense rate; the rest is not identified without a profile"
    ),
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
    return speed_figures(row, _predict(row))


def _memory_figures(row: dict) -> str:
    return memory_figures(row, _predict(row))


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
    miss = speed_miss(row, _predict(row))
    assert not miss, miss


@pytest.mark.parametrize("row", _memory_rows())
def test_predicted_peak_within_minus_5_plus_15_percent_of_measured_reserved(row):
    miss = memory_miss(row, _predict(row))
    assert not miss, miss
