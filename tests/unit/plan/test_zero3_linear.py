"""Under ZeRO-3 every frozen base linear keeps its input (plan/memory.py linears_keep_inputs), measured on CPU.

`deepspeed.zero.Init`, which loads a model under ZeRO-3, swaps torch's linear for DeepSpeed's
LinearFunctionForZeroStage3 for the rest of the process. A child process measures one peft LoRA layer's kept bytes per
token (saved-tensor hooks: tests/helpers/saved_tensors.py) before and after entering zero.Init once, on DeepSpeed's
CPU accelerator, against the planner's count without and with the rule. (Without it, the planner counts the MLP's norm
output as kept where lora dropout leaves untargeted gate/up projections: a safe-side simplification.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from finetune.plan.memory import activation_bytes_per_token_layer, linears_keep_inputs
from finetune.plan.workload import ALL_LINEAR
from tests.helpers.paths import ROOT

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
pytestmark = pytest.mark.slow  # a child process each, DeepSpeed imported

CASES = {"all-linear": list(ALL_LINEAR), "attention-only": ATTENTION}


def _measure() -> dict:
    """In this (child) process: each case's LoRA layer's kept bytes per token with lora dropout, before and after
    zero.Init (whose swap of torch's linear lasts for the process, so every case is measured before it)."""
    import deepspeed
    import torch

    from tests.helpers.saved_tensors import per_token_bytes
    from tests.unit.plan.test_memory import _model

    def builder(targets):  # DeepSpeed trains 16-bit adapters (plan/memory.py params_16bit): no fp32 adapters or casts
        return lambda: _model(dora=False, dropout=0.1, fp32_adapters=False, targets=tuple(targets))

    seen = {case: {"before": per_token_bytes(builder(targets))} for case, targets in CASES.items()}
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        torch.nn.Linear(4, 4)  # what transformers builds under ZeRO-3; torch's linear stays swapped after
    for case, targets in CASES.items():
        seen[case].update(after=per_token_bytes(builder(targets)), linear=torch.nn.functional.linear.__module__)
    return seen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def measured() -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DS_ACCELERATOR": "cpu",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    done = subprocess.run(
        [sys.executable, "-m", __name__], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_zero3s_linear_keeps_the_inputs_the_planner_adds(case, measured):
    from tests.unit.plan.test_memory import INTER, H, _job

    seen = measured[case]
    assert seen["linear"].startswith("deepspeed"), seen  # zero.Init swapped torch's linear

    job = _job(lora_targets=tuple(CASES[case]), lora_dropout=0.1)
    assert linears_keep_inputs(job, "zero3") and not linears_keep_inputs(job, "fsdp2")
    plain, zero3 = activation_bytes_per_token_layer(job), activation_bytes_per_token_layer(job, keeps_inputs=True)
    # the swap keeps at least the SwiGLU product (640 bf16 features a token) that nothing kept before
    assert seen["after"] - seen["before"] >= 2 * INTER, seen
    assert seen["before"] == pytest.approx(plain, rel=0.03), (seen, plain)
    assert seen["after"] == pytest.approx(zero3, rel=0.03), (seen, zero3)
    if case == "all-linear":  # both norm outputs (2 x 256) and the product (640), in bf16, exactly
        assert zero3 - plain == seen["after"] - seen["before"] == 2 * (2 * H + INTER)


if __name__ == "__main__":  # the child of the fixture above
    print(json.dumps(_measure()))
