"""The step time a masked attention kernel adds by reading its mask: memory traffic the FLOPs do not see.

A kernel that gets an explicit mask (`memory.masked_attention`: sdpa over a packed row's block-diagonal
mask where finetune's varlen kernel falls back, or over padded rows) computes every block of the square
(`workload.executed_attention_positions` counts those FLOPs) and also moves the mask:
  - torch's scaled_dot_product_attention turns a boolean mask into an additive bias in the query's dtype
    (`convert_boolean_attn_mask`) on every call, so once per layer and forward (and again when a
    checkpointed layer recomputes its forward): 1 byte read and `act` bytes written per mask element;
  - the masked kernels (memory-efficient / cuDNN attention) read that bias tile by tile, broadcast over
    the heads: every head reads the whole rows x len^2 bias in the forward, and the backward, which
    recomputes the scores, reads it again. A head's pass over a 4k x 4k bf16 bias is 32 MiB and 8k x 8k
    128 MiB, beyond what the L2 keeps for the next head, so each read comes from HBM.
Timed at the card's memory bandwidth (the preset's gpu_memory_bandwidth_gbps); 0 where the preset has
none. Not counted: eager attention's own score-matrix traffic (scores, fp32 softmax and their gradients,
several passes per head), which is larger still.
"""

from __future__ import annotations

from finetune.plan.memory import masked_attention
from finetune.plan.workload import Job


def mask_seconds(job: Job, *, micro_batch: int, checkpointed_share: float = 0.0) -> float:
    """Seconds one micro-batch's forward and backward spend converting and reading attention mask
    biases, per GPU (0 for unmasked kernels, eager attention, or a preset without memory bandwidth)."""
    bandwidth = job.preset.gpu_memory_bandwidth_gbps
    masked = masked_attention(job, micro_batch=micro_batch)
    if masked is None or job.attention != "sdpa" or not bandwidth:
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
    return moved / (bandwidth * 1e9)
