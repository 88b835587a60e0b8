"""The MoE step-time terms (finetune/plan/moe_time.py): the routed passes' byte count against the aten
ops transformers' grouped_mm experts really run (forward and backward, CPU, bf16), the grouped GEMM
efficiency against the published figures it is set from, and the term's place in the step time."""

from __future__ import annotations

import dataclasses

import pytest

from finetune.plan.moe_time import (
    GROUPED_HALF_ROWS,
    dispatch_bytes_per_token,
    grouped_gemm_share,
    moe_seconds,
    routed_pass_bytes,
    routed_rows,
)
from finetune.plan.timing import GEMM_EFFICIENCY, MICRO_BATCH_HALF_TOKENS, efficiency, step_time
from finetune.plan.workload import Job
from finetune.registry import get_model
from tests.helpers.calibration_rows import preset_for

H100 = preset_for("NVIDIA H100 80GB HBM3", gpus_per_node=1)
E, K, H, W, T = 8, 2, 256, 128, 512  # experts, top-k, hidden, expert width, tokens


def _traced_bytes() -> tuple[int, int]:
    """(forward, backward) bytes of every aten op of grouped_mm_experts_forward but the grouped GEMMs
    and views, each tensor counted once (a broadcast view by its storage, an allocation by its output),
    index vectors and per-copy scalars (1-D, or a last dimension of 1) left out."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from transformers.integrations.moe import grouped_mm_experts_forward

    class Moved(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name not in ("_grouped_mm", "_unsafe_view") and not func.is_view:
                # an allocation reads nothing: its output only
                touched = out if name in ("new_zeros", "zeros_like", "new_empty", "empty_like") else (args, kwargs, out)
                for t in tree_flatten(touched)[0]:
                    if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] > 1:
                        Moved.total += min(t.numel() * t.element_size(), t.untyped_storage().nbytes())
            return out

    class Experts(torch.nn.Module):
        num_experts, has_gate, has_bias, is_transposed = E, True, False, False
        has_post_expert_norm, _is_expert_parallel = False, False

        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * W, H, dtype=torch.bfloat16), requires_grad=False)
            self.down_proj = torch.nn.Parameter(torch.randn(E, H, W, dtype=torch.bfloat16), requires_grad=False)

        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.nn.functional.silu(gate) * up

    torch.manual_seed(0)
    experts = Experts()
    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    index = torch.randint(0, E, (T, K))
    weights = torch.rand(T, K, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.ones(T, H, dtype=torch.bfloat16)
    with Moved():
        y = grouped_mm_experts_forward(experts, x, index, weights)
    forward, Moved.total = Moved.total, 0
    with Moved():
        y.backward(grad)
    return forward, Moved.total


def _job(**changes) -> Job:
    arch = get_model("mixtral-8x7b").model_copy(
        update={"family": "qwen3_moe", "hidden_size": H, "moe_intermediate_size": W, "num_experts": E}
    )
    base = Job(arch=arch, preset=H100, seq_len=T, packed=True, attention="varlen", liger=False)
    return dataclasses.replace(base, **changes)


def test_routed_pass_bytes_match_what_transformers_grouped_experts_move():
    forward, backward = _traced_bytes()
    planned_forward, planned_backward = routed_pass_bytes(_job())
    assert forward == pytest.approx(T * planned_forward)
    assert backward == pytest.approx(T * planned_backward)


def test_dispatch_counts_only_what_a_dense_mlp_does_not_move():
    job = _job()
    routed = routed_pass_bytes(job)
    router = (2 + 20) * E / 2
    # the dense efficiency holds Liger's fused SwiGLU passes (it was measured with them), so the experts' eager
    # gating counts beyond those, with Liger or without (a dense MLP's own eager passes: plan/unfused_time.py)
    for liger in (False, True):
        forward, backward = dispatch_bytes_per_token(dataclasses.replace(job, liger=liger))
        assert forward == pytest.approx(routed[0] - K * 3 * 2 * W + router)
        assert backward == pytest.approx(routed[1] - K * 5 * 2 * W + router)


def test_grouped_gemm_efficiency_reproduces_the_published_h100_figures():
    peak = H100.peak_bf16_tflops
    # CUTLASS sm90 grouped GEMM, 512 rows per expert: ~160 TFLOP/s; torch grouped_mm MoE forward,
    # 2048 rows per expert, dispatch included: 242 TFLOP/s (the GEMMs alone faster; the dispatch passes of that
    # forward are about a third of its time)
    assert GEMM_EFFICIENCY * peak * 512 / (512 + GROUPED_HALF_ROWS) == pytest.approx(160, rel=0.05)
    assert 242 < GEMM_EFFICIENCY * peak * 2048 / (2048 + GROUPED_HALF_ROWS) < 1.5 * 242


def test_moe_time_follows_the_rows_per_expert():
    job = _job(arch=get_model("mixtral-8x7b"), seq_len=4096)
    assert routed_rows(job, micro_batch=2) == 2 * 4096 * 2 / 8
    small = grouped_gemm_share(job, micro_batch=1, half_tokens=MICRO_BATCH_HALF_TOKENS)
    large = grouped_gemm_share(job, micro_batch=8, half_tokens=MICRO_BATCH_HALF_TOKENS)
    assert 0 < small < large <= 1
    # more experts for the same tokens: fewer rows each, slower
    many = dataclasses.replace(job, arch=job.arch.model_copy(update={"num_experts": 64}))
    fewer = grouped_gemm_share(many, micro_batch=2, half_tokens=512)
    assert fewer < grouped_gemm_share(job, micro_batch=2, half_tokens=512)
    dense = _job(arch=get_model("llama-3.1-8b"))
    assert moe_seconds(dense, micro_batch=2, efficiency=0.45, half_tokens=512) == 0.0


def test_moe_time_is_in_the_step():
    job = _job(arch=get_model("mixtral-8x7b"), seq_len=2048, adapter="qlora")
    st = step_time(job, strategy="ddp", micro_batch=2, grad_accum=3, checkpointing=False)
    extra = moe_seconds(job, micro_batch=2, efficiency=efficiency(job, micro_batch=2), half_tokens=512)
    assert extra > 0
    # checkpointing repeats the forward's share of it
    again = moe_seconds(job, micro_batch=2, efficiency=efficiency(job, micro_batch=2), half_tokens=512, repeat=2.0)
    assert extra < again < 2 * extra
    without = step_time(
        dataclasses.replace(job, preset=H100.model_copy(update={"gpu_memory_bandwidth_gbps": None})),
        strategy="ddp",
        micro_batch=2,
        grad_accum=3,
        checkpointing=False,
    )
    assert st.compute_s > without.compute_s
