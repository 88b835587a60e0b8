"""The step time a decoder layer's RMSNorms, RoPE and SwiGLU add when Liger does not fuse them.

The GPU step time (plan/timing.py: its GEMM rate and streaming passes) was fitted on runs with Liger's kernels,
finetune's default wherever liger-kernel patches the model (train.liger): one kernel for each norm, RoPE and SwiGLU,
forward and backward. Without them (train.liger: off, or a model type Liger does not patch, as most MoE families)
transformers runs them as chains of elementwise kernels, each a pass over the activations through HBM. Bytes per
element of the tensor each works on (a: the activation dtype's bytes), every kernel's inputs and outputs, forward
and backward as autograd runs them (counted from the aten ops of transformers' own modules with a dispatch mode:
tests/unit/plan/test_unfused_time.py):
  - RMSNorm (upcast to fp32, pow, mean, times rsqrt, cast back, times the weight): 28 + 4a forward, 72 + 8a
    backward; Liger's kernels 2a and 3a. Per layer its norms (`norms_per_layer`) and the QK norms over the query
    and key widths where the model has them;
  - RoPE (q * cos + rotate_half(q) * sin for the queries and keys): 10a forward, 14a backward; Liger's in-place
    kernel 2a and 2a;
  - SwiGLU (act(gate) * up) of each dense MLP and shared expert: plan/moe_time.py's EAGER_SWIGLU against
    FUSED_SWIGLU (a routed expert's gating is in moe_time's dispatch bytes).
The difference is timed at the bandwidth streaming kernels reach (plan/bandwidth.py). Not on the cpu preset, whose
efficiency was measured without Liger. The MoE rows without Liger (Qwen-MoE, Granite, OLMoE) are on their plans
with it; dense models are planned pessimistically: 8B LoRA on an H200 with Liger off ran at 0.918 of Liger's speed
(docs/benchmarks.md) where this term plans 0.838, and the dense calibration rows without Liger (8B, Qwen2.5-7B)
at 1.08-1.11x their plan: those eager chains ran faster than their bytes at the streaming rate.
"""

from __future__ import annotations

from finetune.plan.bandwidth import memory_seconds
from finetune.plan.moe_time import EAGER_SWIGLU, FUSED_SWIGLU
from finetune.plan.workload import Job, attention_widths, computed_tokens_per_micro_batch, moe_layer_count


def eager_norm_bytes(a: int) -> tuple[float, float]:
    """(forward, backward) bytes per element of transformers' eager RMSNorm (a frozen weight)."""
    return 28 + 4 * a, 72 + 8 * a


def eager_rope_bytes(a: int) -> tuple[float, float]:
    """(forward, backward) bytes per element of q and k of transformers' eager RoPE."""
    return 10 * a, 14 * a


def _beyond_liger(eager: tuple[float, float], liger: tuple[float, float]) -> tuple[float, float]:
    return eager[0] - liger[0], eager[1] - liger[1]


def unfused_bytes_per_token(job: Job) -> tuple[float, float]:
    """(forward, backward) bytes per token, over all decoder layers, of the unfused norms, RoPE and SwiGLU
    beyond Liger's kernels: the norms and RoPE without Liger, the SwiGLU wherever Liger's SwiGLU does not run
    (Job.liger_swiglu: also on the model types whose Liger patch would swap the routed experts)."""
    arch, a = job.arch, job.act_bytes
    forward = backward = 0.0
    q, k, _ = attention_widths(arch)
    norm_f, norm_b = _beyond_liger(eager_norm_bytes(a), (2 * a, 3 * a))
    # the q/k norms run eager wherever Liger does not patch them (Job.liger_qk_norms), with Liger on as well
    norm_elements = q + k if arch.qk_norm and not job.liger_qk_norms else 0
    if not job.liger:
        rope_f, rope_b = _beyond_liger(eager_rope_bytes(a), (2 * a, 2 * a))
        norm_elements += arch.norms_per_layer * arch.hidden_size
        forward += arch.num_layers * rope_f * (q + k)
        backward += arch.num_layers * rope_b * (q + k)
    forward += arch.num_layers * norm_f * norm_elements
    backward += arch.num_layers * norm_b * norm_elements
    if not job.liger_swiglu:
        moe = moe_layer_count(arch)
        mlp_width = (arch.num_layers - moe) * arch.intermediate_size + moe * arch.shared_expert_intermediate_size
        forward += (EAGER_SWIGLU[0] - FUSED_SWIGLU[0]) * a * mlp_width
        backward += (EAGER_SWIGLU[1] - FUSED_SWIGLU[1]) * a * mlp_width
    return forward, backward


def unfused_seconds(job: Job, *, micro_batch: int, checkpointed_share: float = 0.0) -> float:
    """Seconds one micro-batch spends in unfused norm, RoPE and SwiGLU passes beyond Liger's, per GPU
    (forwards again: `checkpointed_share` of the layers recomputed, and the forwards without gradients:
    Job.forward_only_passes)."""
    if job.preset.vendor == "cpu":
        return 0.0
    forward, backward = unfused_bytes_per_token(job)
    tokens = computed_tokens_per_micro_batch(job, micro_batch)
    forwards = 1.0 + checkpointed_share + job.forward_only_passes
    return memory_seconds(job.preset, tokens * (forwards * forward + backward))
