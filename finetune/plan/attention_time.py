"""The step time a masked attention kernel adds by reading its mask: memory traffic the FLOPs do not see.

A kernel that gets an explicit mask (`memory.masked_attention`: sdpa over a packed row's block-diagonal
mask where finetune's varlen kernel falls back, or over padded rows) computes every block of the square
(`workload.executed_attention_positions` counts those FLOPs) and also moves the mask:
  - torch's scaled_dot_product_attention turns a boolean mask into an additive bias in the query's dtype
    (`convert_boolean_attn_mask`) on every call, so once per layer and forward (and again when a
    checkpointed layer recomputes its forward): 1 byte read and `act` bytes written per mask element;
  - the masked kernels (memory-efficient / cuDNN attention) read that bias tile by tile, broadcast over
    the heads: every head reads the whole rows x len^2 bias in the forward, and the backward, which
    recomputes the scores, reads it again. Every read is counted from HBM: a head's pass over an 8k x 8k
    bf16 bias is 128 MiB, beyond an H100's 50 MB L2 (for short rows the L2 may serve part of it, so
    there the term is an upper bound).
Timed at the bandwidth streaming kernels reach (plan/bandwidth.py); 0 where the preset has none. Eager
attention reads its mask in its own passes over the scores (plan/eager_time.py), not here.
"""

from __future__ import annotations

from finetune.plan.bandwidth import memory_seconds
from finetune.plan.memory import masked_attention
from finetune.plan.workload import Job


def mask_seconds(job: Job, *, micro_batch: int, checkpointed_share: float = 0.0) -> float:
    """Seconds one micro-batch's forward and backward spend converting and reading attention mask
    biases, per GPU (0 for unmasked kernels, eager attention, or a preset without memory bandwidth)."""
    masked = masked_attention(job, micro_batch=micro_batch)
    if masked is None or job.attention != "sdpa":
        return 0.0
    arch, a = job.arch, job.act_bytes
    rows, length = masked
    square = rows * length * length
    # layers finetune's varlen kernel still serves (workload.varlen_fallback_layers) get no mask
    layers = arch.num_layers - (min(job.varlen_layers, arch.num_layers) if job.packed else 0)
    convert = square * (1 + a)
    read = arch.num_attention_heads * square * a
    forward = convert + read
    moved = layers * ((1.0 + checkpointed_share) * forward + read)
    return memory_seconds(job.preset, moved)
