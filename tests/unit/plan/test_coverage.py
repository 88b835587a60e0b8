"""A plan says whether its setting lies within the GPU calibration's measured range (plan/coverage.py), and that range
is what the calibration rows measured: recomputed from tests/data/gpu_calibration.json, so a row on a new card or
GPU count changes it here first."""

from __future__ import annotations

import json

from finetune.api import plan
from finetune.plan.coverage import (
    MEASURED_CARDS,
    MEASURED_GPUS_PER_NODE,
    MEASURED_NODES,
    MEASURED_SEQ_LEN,
    extrapolations,
)
from finetune.registry import get_preset
from tests.helpers.calibration_rows import row_preset
from tests.helpers.paths import ROOT
from tests.helpers.recipes import shape_recipe, write_preset

ROWS = [r for r in json.loads((ROOT / "tests" / "data" / "gpu_calibration.json").read_text()) if "excluded" not in r]
# rows that ran several "nodes" as loopback processes of one host (scripts/gpu_validate.py's hybrid preset): they
# measured fsdp2-hybrid's layout, not a network between hosts
LOOPBACK_NODES = {"lora3b-hybrid-2x2", "qlora70b-hybrid-2x2"}


def test_the_measured_range_is_the_calibration_rows():
    presets = [row_preset(r) for r in ROWS]
    assert set(MEASURED_CARDS) == {r["card"] for r in ROWS}
    assert MEASURED_GPUS_PER_NODE == max(p.gpus_per_node for p in presets)
    assert MEASURED_SEQ_LEN == max(r["seq_len"] for r in ROWS)
    several = {r["name"] for r, p in zip(ROWS, presets, strict=True) if p.nodes > 1}
    assert several == LOOPBACK_NODES and MEASURED_NODES == 1


def test_a_plan_says_what_it_extrapolates():
    # the 70B recipe on a server of 8 H100s: a measured card, twice the GPUs of any row
    result = plan(shape_recipe("meta-llama/Llama-3.1-70B", "lora", model__arch="llama-3.1-70b"))
    assert result.basis.startswith("extrapolated") and "8 GPUs per node" in result.basis
    assert "H100" not in result.basis.split(" in ", 1)[1]  # the card itself was measured
    assert result.to_json()["basis"] == result.basis
    two_nodes = extrapolations(get_preset("cluster-2x8xh100"), seq_len=131072)
    assert [e.split(" ")[0] for e in two_nodes] == ["8", "2", "131,072-token"]
    assert "RTX 4090" in extrapolations(get_preset("workstation-1x4090"), seq_len=2048)[0]


def test_a_setting_the_rows_cover_is_within_their_bounds(tmp_path):
    one_h200 = row_preset(next(r for r in ROWS if r["card"] == "NVIDIA H200" and r["world_size"] == 1))
    assert extrapolations(one_h200, seq_len=4096) == []
    four = write_preset(tmp_path / "h200x4.yaml", like="server-8xh200", name="h200x4", gpus_per_node=4)
    result = plan(shape_recipe("meta-llama/Llama-3.1-8B", "lora", str(four), model__arch="llama-3.1-8b"))
    assert result.basis.startswith("within") and "+-25%" in result.basis
    result = plan(shape_recipe("meta-llama/Llama-3.1-8B", "lora", "server-8xh200", model__arch="llama-3.1-8b"))
    assert "8 GPUs per node" in result.basis  # the shipped 8-GPU presets are beyond the 4 measured
    cpu = plan(shape_recipe("meta-llama/Llama-3.2-1B", "lora", "cpu", model__arch="llama-3.2-1b"))
    assert "not calibrated" in cpu.basis
