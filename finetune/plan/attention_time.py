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

The kernels themselves also run slower than the step's FLOPs rate in two cases (`kernel_extra_seconds`),
measured by scripts/attention_rates.py (forward + backward of torch's sdpa, bf16, one packed row of 4,096 and
16,384 tokens, head_dim 64 and 128; on an H200 with torch 2.11 and cuDNN 9.19 every case ran cuDNN's flash
kernels; docs/results/attention-rates-2026-11-28-h200.json):
  - a masked kernel (an explicit bias; cuDNN's masked path): beyond its whole-square FLOPs at the step's
    efficiency and the bias traffic above it took 1.37-1.48x the FLOPs' time (MASKED_KERNEL_SLOWDOWN);
  - attention dropout (a config's attention_dropout > 0, training): the kernel draws a random number per score
    in the forward and again in the backward, 1.38-1.74x the same kernel's time without it, causal or masked
    (DROPOUT_KERNEL_SLOWDOWN; flash_attention_2's dropout is assumed alike, not measured).
"""

from __future__ import annotations

from finetune.plan.bandwidth import memory_seconds
from finetune.plan.memory import masked_attention
from finetune.plan.workload import (
    Job,
    computed_tokens_per_micro_batch,
    executed_attention_positions,
    head_dim,
    masked_row_layers,
)

MASKED_KERNEL_SLOWDOWN = 1.4
DROPOUT_KERNEL_SLOWDOWN = 1.6


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
    layers = masked_row_layers(job)
    convert = square * (1 + a)
    read = arch.num_attention_heads * square * a
    forward = convert + read
    moved = layers * ((1.0 + checkpointed_share) * forward + read)
    return memory_seconds(job.preset, moved)


def kernel_extra_seconds(job: Job, *, micro_batch: int, checkpointed_share: float, flop_seconds: float) -> float:
    """Seconds one micro-batch's attention kernels take beyond their executed FLOPs at `flop_seconds` a FLOP
    (the step's rate): a masked kernel's and attention dropout's slowdowns (see the module docstring). Eager
    attention's passes are plan/eager_time.py's; the varlen kernel has neither a mask nor dropout."""
    arch = job.arch
    if job.attention not in ("sdpa", "flash"):
        return 0.0
    masked = job.attention == "sdpa" and masked_attention(job, micro_batch=micro_batch) is not None
    dropout = DROPOUT_KERNEL_SLOWDOWN if arch.attention_dropout else 1.0
    if not masked and dropout == 1.0:
        return 0.0
    executed = executed_attention_positions(job, micro_batch=micro_batch)
    on_mask = 0.0
    if masked:  # a packed row's layers the varlen kernel still serves run unmasked (workload.masked_row_layers)
        row = micro_batch * job.seq_len * job.sequences_per_sample
        on_mask = masked_row_layers(job) * row if job.packed else executed
    # forward 4, backward 8 FLOPs a score position and width; a checkpointed layer's forward and the forwards
    # without gradients (the reference's, KTO's KL completion) again
    passes = 12 + 4 * checkpointed_share + 4 * job.forward_only_passes
    per_position = (
        passes * arch.num_attention_heads * head_dim(arch) * computed_tokens_per_micro_batch(job, micro_batch)
    )
    slower = on_mask * (MASKED_KERNEL_SLOWDOWN * dropout - 1) + (executed - on_mask) * (dropout - 1)
    return per_position * slower * flop_seconds
