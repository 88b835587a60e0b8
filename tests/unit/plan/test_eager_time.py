"""Eager attention's passes over the materialized scores (plan/eager_time.py), checked against the ops
transformers' Gemma-2 eager attention really runs (traced on CPU) and against the hand count."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune.plan.attention_time import kernel_extra_seconds, mask_seconds
from finetune.plan.bandwidth import ACHIEVED_BANDWIDTH
from finetune.plan.eager_time import eager_seconds, score_pass_bytes
from finetune.plan.timing import attention_efficiency, step_time
from tests.helpers.recipes import shape_job

B, HEADS, KV_HEADS, S, D = 1, 4, 2, 32, 16
VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.detach.default", "aten.expand.default"}
VIEWS |= {"aten.transpose.int", "aten.slice.Tensor"}


def _score_ops(run, sizes: tuple[int, ...] = ()) -> list[str]:
    """The non-view aten ops whose output is score-shaped (B x heads x S x S, or one of `sizes` elements)
    while `run()` executes."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Trace(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(o, torch.Tensor) and o.numel() in (B * HEADS * S * S, *sizes) and str(func) not in VIEWS:
                    self.ops.append(str(func).removeprefix("aten.").split(".")[0])
            return out

    with Trace() as trace:
        result = run()
    return trace.ops, result


def test_the_modelled_passes_are_the_ops_gemma2_eager_attention_runs():
    torch = pytest.importorskip("torch")
    from transformers import Gemma2Config
    from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, eager_attention_forward

    config = Gemma2Config(
        hidden_size=HEADS * D,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=D,
        intermediate_size=128,
        num_hidden_layers=1,
        vocab_size=128,
        attn_logit_softcapping=50.0,
    )
    module = Gemma2Attention(config, 0).train()
    q = torch.randn(B, HEADS, S, D, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, KV_HEADS, S, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    mask = torch.zeros(1, 1, S, S, dtype=torch.bfloat16)
    forward, (out, _) = _score_ops(
        lambda: eager_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=D**-0.5, softcap=50.0)
    )
    backward, _ = _score_ops(lambda: out.float().sum().backward())
    # CPU runs the fp32 casts around softmax as kernels of their own; CUDA fuses them into softmax
    # (half_to_float), which is what eager_time counts
    assert forward == ["bmm", "mul", "div", "tanh", "mul", "add", "_to_copy", "_softmax", "_to_copy"]
    assert backward == ["bmm", "_to_copy", "_softmax_backward_data", "_to_copy", "mul", "tanh_backward", "div", "mul"]


def test_the_modelled_passes_are_the_ops_gpt_oss_eager_attention_runs():
    """The sinks' variant (score_pass_bytes: 14a forward, 19a backward): the sink logit joins the scores as one
    more key, so the ops after the mask are (keys + 1) wide; softmax runs in the compute dtype."""
    torch = pytest.importorskip("torch")
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, eager_attention_forward

    config = GptOssConfig(
        hidden_size=HEADS * D, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=D, num_hidden_layers=1
    )
    module = GptOssAttention(config, 0).train().to(torch.bfloat16)
    q = torch.randn(B, HEADS, S, D, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, KV_HEADS, S, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    mask = torch.zeros(1, 1, S, S, dtype=torch.bfloat16)
    wide = B * HEADS * S * (S + 1)
    forward, (out, _) = _score_ops(
        lambda: eager_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=D**-0.5), sizes=(wide,)
    )
    backward, _ = _score_ops(lambda: out.float().sum().backward(), sizes=(wide,))
    assert forward == ["bmm", "mul", "add", "cat", "sub", "_softmax"]  # + the max's read and the PV matmul's
    assert backward == [
        "bmm",
        "slice_backward",
        "_softmax_backward_data",
        "neg",
        "new_zeros",
        "scatter",
        "add",
        "mul",
    ]  # + QK^T's two reads
    sinks = replace(_job("llama-3.1-8b"), arch=replace_arch("llama-3.1-8b", attention_sinks=True))
    assert score_pass_bytes(sinks) == (14 * 2, 19 * 2)


def replace_arch(key: str, **changes):
    from finetune.registry import get_model

    return get_model(key).model_copy(update=changes)


def _job(arch: str):
    return replace(shape_job(arch, "lora"), attention="eager", packed=True, varlen_layers=0)


def test_bytes_per_score_element_follow_the_hand_count():
    gemma = _job("gemma-2-9b")  # soft-capped
    assert score_pass_bytes(gemma) == (15 * 2 + 8, 15 * 2 + 12)
    llama = _job("llama-3.1-8b")
    assert score_pass_bytes(llama) == (9 * 2 + 8, 8 * 2 + 12)


def test_eager_seconds_scale_with_the_executed_square_and_repeat_the_checkpointed_forward():
    job = _job("gemma-2-9b")
    bandwidth = ACHIEVED_BANDWIDTH * job.preset.gpu_memory_bandwidth_gbps * 1e9
    arch = job.arch
    one = eager_seconds(job, micro_batch=1)
    elements = arch.num_attention_heads * job.seq_len * arch.num_layers * job.seq_len
    assert one == pytest.approx(elements * sum(score_pass_bytes(job)) / bandwidth)
    # a packed micro-batch of two rows under one mask computes a square twice as wide: four times the work
    assert eager_seconds(job, micro_batch=2) == pytest.approx(4 * one)
    forward, _ = score_pass_bytes(job)
    assert eager_seconds(job, micro_batch=1, checkpointed_share=1.0) == pytest.approx(
        one + elements * forward / bandwidth
    )
    assert eager_seconds(replace(job, attention="sdpa"), micro_batch=1) == 0.0


def test_step_time_charges_the_passes_to_eager_jobs_only():
    job = _job("gemma-2-9b")
    eager = step_time(job, strategy="ddp", micro_batch=1, grad_accum=4, checkpointing=False)
    sdpa = step_time(replace(job, attention="sdpa"), strategy="ddp", micro_batch=1, grad_accum=4, checkpointing=False)
    # the same FLOPs (both compute the whole masked square); sdpa reads its mask bias instead, and its masked
    # kernel runs below the FLOPs' rate (attention_time.kernel_extra_seconds)
    masked = replace(job, attention="sdpa")
    flop_seconds = 1 / (job.peak_tflops * 1e12 * attention_efficiency(job, micro_batch=1))
    sdpa_only = mask_seconds(masked, micro_batch=1) + kernel_extra_seconds(
        masked, micro_batch=1, checkpointed_share=0.0, flop_seconds=flop_seconds
    )
    assert eager.compute_s == pytest.approx(sdpa.compute_s - 4 * sdpa_only + 4 * eager_seconds(job, micro_batch=1))
