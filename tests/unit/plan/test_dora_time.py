"""DoRA's extra step time (finetune/plan/dora_time.py): its byte count against what a real peft DoRA
layer's aten ops read and write (a dispatch mode over forward and backward, CPU, autocast bf16 with
peft's fp32 adapters and input cast), the matmul lora dropout makes it add (torch's FLOP counter over the
same layer), and its place in the planner's step time."""

from __future__ import annotations

import dataclasses

import pytest

from finetune.plan.dora_time import _token_side_bytes, _weight_side_bytes, dora_seconds, recomputed_base_flops_per_token
from finetune.plan.memory import adapter_input_casts
from finetune.plan.timing import step_time
from finetune.plan.workload import Job, targeted_linears
from finetune.registry import get_model
from tests.helpers.calibration_rows import preset_for

H100 = preset_for("NVIDIA H100 80GB HBM3", gpus_per_node=1)
FIN, FOUT, R = 256, 192, 8
_VIEWS = {
    "view",
    "t",
    "transpose",
    "expand",
    "detach",
    "alias",
    "_unsafe_view",
    "unsqueeze",
    "squeeze",
    "as_strided",
    "permute",
    "slice",
    "select",
    "reshape",
    "_reshape_alias",
    "lift_fresh",
    "empty",
    "empty_like",
    "zeros_like",
    "ones_like",
    "new_zeros",
    "new_ones",
    "new_empty",
    "empty_strided",
}


def _dora_module(*, dora: bool = True, dropout: float = 0.0):
    """One bf16 Linear under a peft LoRA/DoRA adapter (fp32 adapters, peft's default), in training mode."""
    import torch
    from peft import LoraConfig, get_peft_model

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(FIN, FOUT, bias=False)

        def forward(self, x):
            return self.lin(x)

    torch.manual_seed(0)
    config = LoraConfig(r=R, lora_alpha=16, target_modules=["lin"], use_dora=dora, lora_dropout=dropout)
    model = get_peft_model(One().to(torch.bfloat16), config)
    torch.nn.init.normal_(model.base_model.model.lin.lora_B["default"].weight)
    return model.train()


def _bytes_moved(*, dora: bool, tokens: int) -> int:
    """Bytes every non-view aten op of one peft LoRA/DoRA Linear reads and writes, forward + backward."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Moved(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ not in _VIEWS:
                tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
                Moved.total += sum(t.numel() * t.element_size() for t in tensors)
            return out

    model = _dora_module(dora=dora)
    x = torch.randn(tokens, FIN, dtype=torch.bfloat16, requires_grad=True)
    with Moved():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        y.float().sum().backward()
    return Moved.total


def test_byte_count_matches_what_peft_dora_moves():
    extra = {t: _bytes_moved(dora=True, tokens=t) - _bytes_moved(dora=False, tokens=t) for t in (256, 1024)}
    per_token = (extra[1024] - extra[256]) / (1024 - 256)
    fixed = extra[256] - 256 * per_token
    forward, backward = _token_side_bytes(promoted=4, compute=2)
    assert per_token == pytest.approx(FOUT * (forward + backward))  # exactly: 116 B per output feature
    planned = _weight_side_bytes(fin=FIN, fout=FOUT, r=R, adapter=4, compute=2, x=4, weight=2, dequantize=0)
    # the weight side leaves out the casts of the r-wide adapter matrices themselves (under 1%)
    assert planned == pytest.approx(fixed, rel=0.015)


def test_dora_with_dropout_multiplies_the_base_weight_again_forward_and_backward():
    """peft's DoRA with lora dropout computes F.linear(dropout(x), W) besides the base layer's own output: per
    token 2 x in x out FLOPs forward and 2 x in x out for the input gradient, counted by torch's FLOP counter."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    def flops(dropout: float, tokens: int = 512) -> int:
        model = _dora_module(dropout=dropout)
        x = torch.randn(tokens, FIN, dtype=torch.bfloat16, requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(x)
            y.float().sum().backward()
        return counter.get_total_flops()

    assert (flops(0.1) - flops(0.0)) / 512 == 4 * FIN * FOUT
    job = _job(lora_dropout=0.1)
    targeted = sum(n * fin * fout for n, fin, fout in targeted_linears(job.arch, job.lora_targets))
    assert recomputed_base_flops_per_token(job) == 4 * targeted
    # a checkpointed layer runs that forward twice
    assert recomputed_base_flops_per_token(job, checkpointed_share=1.0) == 6 * targeted
    assert recomputed_base_flops_per_token(_job()) == 0.0  # no dropout: DoRA reuses the base output
    assert recomputed_base_flops_per_token(_job(lora_dropout=0.1, dora=False)) == 0.0
    slower = step_time(job, strategy="ddp", micro_batch=2, grad_accum=4, checkpointing=False)
    assert (
        slower.compute_s > step_time(_job(), strategy="ddp", micro_batch=2, grad_accum=4, checkpointing=False).compute_s
    )


def _job(**changes) -> Job:
    base = Job(
        arch=get_model("llama-3.1-8b"),
        preset=H100,
        adapter="lora",
        dora=True,
        seq_len=2048,
        packed=True,
        attention="varlen",
        liger=True,
        global_batch_size=8,
        micro_batch=2,
    )
    return dataclasses.replace(base, **changes)


def test_dora_time_is_added_to_the_step_and_needs_a_bandwidth():
    job = _job()
    casts = adapter_input_casts(job, "ddp")
    assert casts  # finetune keeps peft's fp32 input casts for DoRA under DDP
    extra = dora_seconds(job, micro_batch=2, casts=casts)
    with_dora = step_time(job, strategy="ddp", micro_batch=2, grad_accum=4, checkpointing=False)
    without = step_time(
        dataclasses.replace(job, dora=False), strategy="ddp", micro_batch=2, grad_accum=4, checkpointing=False
    )
    assert extra > 0.1  # 8B, all seven projections: ~0.3 s per 4096-token micro-batch on an H100
    # DoRA's magnitude adds trained parameters (6 FLOPs each) besides the memory-bound time
    assert with_dora.compute_s - without.compute_s == pytest.approx(4 * extra, rel=0.01)
    assert with_dora.step_s > without.step_s
    no_bandwidth = _job(preset=H100.model_copy(update={"gpu_memory_bandwidth_gbps": None}))
    assert dora_seconds(no_bandwidth, micro_batch=2, casts=casts) == 0.0
    assert dora_seconds(_job(dora=False), micro_batch=2, casts=casts) == 0.0
    # checkpointing repeats the forward: more time, less than twice
    again = dora_seconds(job, micro_batch=2, casts=casts, checkpointed_share=1.0)
    assert extra < again < 2 * extra
