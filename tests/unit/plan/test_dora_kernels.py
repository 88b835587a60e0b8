"""DoRA's kernels in the host's launch floor (plan/host_time.py KERNELS_PER_DORA_LINEAR): counted here as the non-view
aten ops one peft DoRA Linear runs, forward and backward under bf16 autocast, beyond a LoRA Linear as finetune runs it
(peft's fp32 input cast off; DoRA keeps it: train/model.py adapter_input_casting). A narrow model's short GPU work a
micro-batch exposes them: Qwen2.5-1.5B DoRA on an H200 (calibration row 257) ran at 0.77 of the speed planned
without them."""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import replace

import pytest
import torch

from finetune.plan.host_time import KERNELS_PER_DORA_LINEAR, kernels_per_micro_batch
from finetune.plan.workload import targeted_linears
from finetune.registry import get_preset
from tests.helpers.aten_ops import KernelOps
from tests.helpers.recipes import shape_job


def _ops(*, dora: bool, cast: bool) -> Counter:
    from peft import LoraConfig, get_peft_model
    from peft.helpers import disable_input_dtype_casting

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 96, bias=False)

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["proj"], use_dora=dora, lora_dropout=0.0)
    model = get_peft_model(One().to(torch.bfloat16), config)
    model.train()
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)  # a layer input: its gradient flows
    casting = contextlib.nullcontext() if cast else disable_input_dtype_casting(model)
    counter = KernelOps()
    with casting:
        for counting in (False, True):  # the first pass warms peft's lazy state
            with counter if counting else contextlib.nullcontext():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = model(x)
                y.float().sum().backward()
    return counter.ops


def test_the_dora_kernel_count_is_peft_s_dora_layer_beyond_finetune_s_lora_layer():
    lora = sum(_ops(dora=False, cast=False).values())
    dora = sum(_ops(dora=True, cast=True).values())
    assert dora - lora == pytest.approx(KERNELS_PER_DORA_LINEAR, abs=3), (dora, lora)


def test_dora_adds_its_kernels_to_every_targeted_linear_of_the_floor():
    job = shape_job("qwen3-8b", "lora", get_preset("server-8xh100"), global_batch=8)
    dora = replace(job, dora=True, fused_lora=False, fused_lora_groups=False)
    plain = replace(job, fused_lora=False, fused_lora_groups=False)
    targeted = sum(n for n, _, _ in targeted_linears(job.arch, job.lora_targets))
    extra = kernels_per_micro_batch(dora, strategy="ddp", checkpointed_layers=0) - kernels_per_micro_batch(
        plain, strategy="ddp", checkpointed_layers=0
    )
    assert extra == pytest.approx(targeted * KERNELS_PER_DORA_LINEAR)
