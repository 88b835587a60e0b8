"""Real-shape runs on CUDA GPUs through `finetune run` (skipped without CUDA).

Run on a GPU machine with `bash scripts/gpu_tests.sh`. Each test trains a real architecture with
random weights for a few steps (scripts/gpu_validate.py) and checks what the planner promised: the
run fits, the loss falls, the adapter is not empty, and the measured peak is inside the calibration
bounds (the prediction at most 5% below and 20% above the max reserved memory).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu


def _gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _gpu_memory_gib() -> float:
    import torch

    return torch.cuda.get_device_properties(0).total_memory / 2**30


def _validate(name: str, tmp_path: Path, steps: int = 10, extra: tuple[str, ...] = ()) -> dict:
    out = tmp_path / "validation.json"
    proc = subprocess.run([sys.executable, "scripts/gpu_validate.py", name, "--steps", str(steps),
                           "--out", str(out), *extra], cwd=ROOT, timeout=1800)
    assert proc.returncode == 0
    row = json.loads(out.read_text())[-1]
    assert row["exit_code"] == 0, row
    return row


def _check(row: dict) -> None:
    assert row["last_loss"] < row["first_loss"], row
    if row["adapter"] != "full":
        assert row["adapter_bytes"] and row["adapter_bytes"] > 1_000_000  # not an empty adapter
    ratio = row["predicted_gib"] / row["measured_max_reserved_gib"]
    assert 0.95 <= ratio <= 1.20, row


@pytest.mark.parametrize("name", ["lora8b", "qlora8b", "dpo8b"])
def test_one_gpu(name, tmp_path):
    if _gpus() < 1:
        pytest.skip("needs a CUDA GPU")
    _check(_validate(name, tmp_path))


@pytest.mark.parametrize("name", ["full3b-fsdp2", "lora8b-fsdp2", "qlora8b-fsdp2", "lora8b-zero3", "full3b-zero3",
                                  "lora3b-zero3-offload", "lora3b-zero3-nvme"])
def test_two_gpus(name, tmp_path):
    if _gpus() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    _check(_validate(name, tmp_path))


@pytest.mark.parametrize("name", ["full3b-zero2", "full3b-zero3-optim-offload", "full3b-fsdp2-offload"])
def test_two_gpus_partial_offload_tiers(name, tmp_path):
    if _gpus() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    _check(_validate(name, tmp_path))


@pytest.mark.parametrize("name", ["lora8b-zero3-offload", "lora8b-zero3-nvme", "full8b-zero3",
                                  "full8b-zero3-offload"])
def test_two_gpus_8b_zero3(name, tmp_path):
    """Run 6 at the issue's 8B shape. No mid-run checkpoint: a full 8B ZeRO-3 checkpoint with its
    optimizer states is ~112 GB of disk per save."""
    if _gpus() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    if name == "full8b-zero3" and _gpu_memory_gib() < 120:
        pytest.skip("full 8B ZeRO-3 without offload needs ~104 GiB per GPU on 2 GPUs (an H200; not an H100)")
    steps = 6 if name == "full8b-zero3-offload" else 10
    _check(_validate(name, tmp_path, steps=steps, extra=("--set", "output.save_every=null")))


@pytest.mark.parametrize("name", ["lora3b-fsdp2-2to1", "lora3b-fsdp2-1to2"])
def test_checkpoint_moves_between_gpu_counts(name, tmp_path):
    if _gpus() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    row = _validate(name, tmp_path, steps=10)
    assert row["resumed_from"] and row["resumed_from"].endswith("checkpoint-5"), row
    assert row["steps"] == 10
    _check(row)


def test_hybrid_shard_two_nodes_of_two(tmp_path):
    if _gpus() < 4:
        pytest.skip("needs 4 CUDA GPUs (two loopback nodes of 2)")
    _check(_validate("lora3b-hybrid-2x2", tmp_path))
