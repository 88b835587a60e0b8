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
  - a masked kernel (an explicit bias; cuDNN's masked path): beyond its whole-square FLOPs at sdpa's
    unmasked rate (below) and the bias traffic above it took 1.37-1.48x the FLOPs' time (MASKED_KERNEL_SLOWDOWN);
    the memory-efficient kernel, where the run turns cuDNN's attention off, 2.2x cuDNN's masked kernel's time
    (EFFICIENT_KERNEL_SLOWDOWN);
  - attention dropout (a config's attention_dropout > 0, training): the kernel draws a random number per score
    in the forward and again in the backward, 1.38-1.74x the same kernel's time without it, causal or masked
    (DROPOUT_KERNEL_SLOWDOWN; flash_attention_2's dropout is assumed alike, not measured).
The varlen kernel that runs packed rows (finetune/train/attention.py: torch's flash-attention-2 varlen kernel; the
flash_attention_2 package runs the same algorithm) is slower per FLOP than sdpa's: 0.17-0.28 of the card's peak
where sdpa's kernel reaches 0.45 (`VARLEN_RATES`), the slower the shorter the examples; packed examples long enough to
run on cuDNN's causal kernel instead (finetune/kernels.py) have its own rates (`CUDNN_RATES`). sdpa's cuDNN kernel on
one unpadded row reached 0.40-0.47 at 4k and 16k tokens (the sdpa cases above): plan/timing.py's
ATTENTION_EFFICIENCY (0.45), the rate every attention FLOP starts from.
"""

from __future__ import annotations

import math

from finetune.kernels import CUDNN_MIN_EXAMPLE_TOKENS, cudnn_padded_length
from finetune.plan.bandwidth import memory_seconds
from finetune.plan.memory import masked_attention
from finetune.plan.workload import (
    Job,
    computed_tokens_per_micro_batch,
    executed_attention_positions,
    head_dim,
    kernel_example_tokens,
    masked_row_layers,
    sliding_causal_positions,
)

MASKED_KERNEL_SLOWDOWN = 1.4
DROPOUT_KERNEL_SLOWDOWN = 1.6
# sdpa's memory-efficient kernel, which takes the masked rows where the run turns cuDNN's attention off
# (Job.cudnn_attention: ORPO's and CPO's padded pairs, plan.cudnn_attention_off), over cuDNN's masked kernel on the
# same rows: 2.14-2.50x (median 2.22) for 8 padded rows of 1,000-4,000 tokens at head_dim 64 and 128 through
# transformers' masked path (repeated key/value heads, a boolean mask), on an H200 with torch 2.11
# (scripts/attention_rates.py --padded, docs/results/attention-padded-rates-2026-11-30-h200.json). The factor
# applies to the kernel's work, its FLOPs and its reads of the bias; the mask's conversion is sdpa's, not the kernel's
EFFICIENT_KERNEL_SLOWDOWN = 2.2
# finetune's varlen path, forward + backward, as a fraction of the card's dense bf16 peak, by head_dim and the
# examples' length: one 65,536-token row of causal examples of that length, grouped key/value heads (24/8 at 64,
# 32/8 at 128), on an H200 with torch 2.11 (scripts/attention_rates.py --varlen,
# docs/results/attention-varlen-rates-2026-11-29-h200.json; the 4,096 points from the later call of
# attention-varlen-cudnn-rates-2026-11-29-h200.json, whose other points agree within 1%). Where long examples make
# attention most of a step (57k-token examples: 56% of an 8B LoRA step's FLOPs), the step's rate planned
# long-context runs 1.15-1.33x too fast (docs/validation.md, twenty-second session). Other cards are assumed to
# reach the same fraction of their peak.
# Head_dim 256 (Gemma's: 16/8 heads) from a later call (docs/results/attention-varlen-window-rates-2026-11-29-h200.json,
# where the 128 points at 8k and 16k came back within 1% of these): slower than 128 at every length, held beyond 16k.
VARLEN_RATES: dict[int, tuple[tuple[int, float], ...]] = {
    64: ((2048, 0.171), (4096, 0.211), (8192, 0.232), (16384, 0.247), (32768, 0.251), (65536, 0.255)),
    128: ((2048, 0.207), (4096, 0.236), (8192, 0.259), (16384, 0.272), (32768, 0.280), (65536, 0.283)),
    256: ((2048, 0.179), (4096, 0.208), (16384, 0.230)),
}


# finetune's path with its long examples on cuDNN (64k-token rows of examples of one length, each a power of two, so
# unpadded), forward + backward, as a fraction of the peak, by head_dim and example length (scripts/attention_rates.py
# --varlen on an H200, torch 2.11, cuDNN 9.19: docs/results/attention-varlen-cudnn-rates-2026-11-29-h200.json)
CUDNN_RATES: dict[int, tuple[tuple[int, float], ...]] = {
    64: ((8192, 0.265), (16384, 0.339), (32768, 0.357), (65536, 0.371)),
    128: ((8192, 0.332), (16384, 0.418), (32768, 0.447), (65536, 0.470)),
}


# the varlen path as a sliding-window layer calls it (flash-attention's window_size), forward + backward, as a
# fraction of the peak, by head_dim and window: the band's rate once the examples are longer than the window, where
# it hardly depends on their length (the median over 64k-token rows of examples from twice the window to 64k tokens:
# each within 8% of it from four times the window on, 14% at twice;
# docs/results/attention-varlen-windows-2026-11-29-h200.json, scripts/attention_rates.py
# --varlen --windows 512 1024 4096 on an H200, torch 2.11). A band runs slower than a causal example twice the window
# long, the more so the narrower the window and the smaller the heads: at head_dim 64 a 1,024-token window ran 0.144
# against causal 2,048's 0.171, at 128 0.191 against 0.207. Head_dim 256 has its 1,024 window measured alone (0.177
# over 16k-token examples, attention-varlen-window-rates-2026-11-29-h200.json); at other windows it is assumed to
# change as 128's does (`band_rate`), not measured.
WINDOW_RATES: dict[int, tuple[tuple[int, float], ...]] = {
    64: ((512, 0.104), (1024, 0.144), (4096, 0.198)),
    128: ((512, 0.141), (1024, 0.191), (4096, 0.250)),
    256: ((1024, 0.177),),
}


def _by_length(points: tuple[tuple[int, float], ...], length: float) -> float:
    """The rate at `length` tokens (an example's length; WINDOW_RATES: the window's), linear in log2(length) between
    the measured points, held at the end ones (VARLEN_RATES spans 2,048 to 65,536 tokens: shorter examples are
    planned at the 2,048 figure; WINDOW_RATES 512 to 4,096)."""
    if length <= points[0][0]:
        return points[0][1]
    for (lo, low), (hi, high) in zip(points, points[1:]):
        if length <= hi:
            return low + (high - low) * math.log2(length / lo) / math.log2(hi / lo)
    return points[-1][1]


def _by_head_dim(rates: dict[int, tuple[tuple[int, float], ...]], head_dim: int, tokens: float) -> float:
    """A rate table's figure at `tokens` (an example's length; WINDOW_RATES: the window's): linear in head_dim between
    the measured head sizes around it, held at the end ones outside them (MLA's 192 lies between 128 and 256 in
    VARLEN_RATES; CUDNN_RATES has 64 and 128 only)."""
    dims = sorted(rates)
    if head_dim <= dims[0]:
        return _by_length(rates[dims[0]], tokens)
    for small, large in zip(dims, dims[1:]):
        if head_dim <= large:
            at_small, at_large = (_by_length(rates[d], tokens) for d in (small, large))
            return at_small + (head_dim - small) / (large - small) * (at_large - at_small)
    return _by_length(rates[dims[-1]], tokens)


def varlen_rate(head_dim: int, example_tokens: float) -> float:
    """The varlen kernel's forward + backward rate as a fraction of peak (`VARLEN_RATES`)."""
    return _by_head_dim(VARLEN_RATES, head_dim, example_tokens)


def packed_attention_rate(job: Job, example_tokens: float) -> float:
    """The rate of the kernel examples of `example_tokens` run on, per FLOP of their own triangles: the varlen
    kernel's, or cuDNN's (`Job.cudnn_long_examples`, finetune/kernels.py) over its padded length's triangle."""
    if job.cudnn_long_examples and example_tokens >= CUDNN_MIN_EXAMPLE_TOKENS:
        padded = cudnn_padded_length(round(example_tokens))
        return _by_head_dim(CUDNN_RATES, head_dim(job.arch), example_tokens) * (example_tokens / padded) ** 2
    return varlen_rate(head_dim(job.arch), example_tokens)


def _band_rates() -> dict[int, tuple[tuple[int, float], ...]]:
    """WINDOW_RATES with a head size measured at one window alone (256) given, at the other windows, that rate scaled
    as the nearest head size measured at several (128) changes between the two windows."""
    shaped = max(d for d, points in WINDOW_RATES.items() if len(points) > 1)
    scale = WINDOW_RATES[shaped]
    return {
        d: points
        if len(points) > 1
        else tuple((w, points[0][1] * _by_length(scale, w) / _by_length(scale, points[0][0])) for w, _ in scale)
        for d, points in WINDOW_RATES.items()
    }


BAND_RATES = _band_rates()  # derived once: windowed_rate is called for every plan the search evaluates


def band_rate(head: int, window: float) -> float:
    """A sliding layer's band rate at `head` dims and `window` tokens (BAND_RATES)."""
    return _by_head_dim(BAND_RATES, head, window)


def windowed_rate(job: Job, example_tokens: float) -> float:
    """The varlen kernel's rate on a sliding layer: the causal rate of the examples where they fit in the window, the
    band's (`band_rate`, never faster than the examples' causal rate) from twice the window on, and between the two
    linear in log2 of the length (the kernel's work turns from triangle to band there, and so does its rate)."""
    head = head_dim(job.arch)
    window = job.arch.sliding_window or example_tokens
    causal = varlen_rate(head, example_tokens)
    if example_tokens <= window:
        return causal
    band = min(causal, band_rate(head, window))
    if example_tokens >= 2 * window:
        return band
    start = varlen_rate(head, window)
    return start + (band - start) * math.log2(example_tokens / window)


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
    # the memory-efficient kernel's reads run as much slower than cuDNN's as its FLOPs (EFFICIENT_KERNEL_SLOWDOWN)
    read = arch.num_attention_heads * square * a * (1.0 if job.cudnn_attention else EFFICIENT_KERNEL_SLOWDOWN)
    forward = convert + read
    moved = layers * ((1.0 + checkpointed_share) * forward + read)
    return memory_seconds(job.preset, moved)


def kernel_extra_seconds(job: Job, *, micro_batch: int, checkpointed_share: float, flop_seconds: float) -> float:
    """Seconds one micro-batch's attention kernels take beyond their executed FLOPs at `flop_seconds` a FLOP
    (the step's rate): a masked kernel's and attention dropout's slowdowns, and the varlen kernel's own rate (see
    the module docstring). Eager attention's passes are plan/eager_time.py's; the varlen kernel has neither a
    mask nor dropout."""
    arch = job.arch
    if job.attention not in ("sdpa", "flash", "varlen"):
        return 0.0
    masked = job.attention == "sdpa" and masked_attention(job, micro_batch=micro_batch) is not None
    dropout = DROPOUT_KERNEL_SLOWDOWN if arch.attention_dropout else 1.0
    executed = executed_attention_positions(job, micro_batch=micro_batch)
    on_mask = 0.0
    if masked:  # a packed row's layers the varlen kernel still serves run unmasked (workload.masked_row_layers)
        # the row as executed_attention_positions counts it (the real tokens, padding included), so that the served
        # layers' share below is what is left of it
        row = computed_tokens_per_micro_batch(job, micro_batch)
        on_mask = masked_row_layers(job) * row if job.packed else executed
    # the positions the varlen (or flash) kernel computes: every layer of theirs, a packed row's served layers
    varlen = executed if job.attention in ("flash", "varlen") else (executed - on_mask if job.packed else 0.0)
    # forward 4, backward 8 FLOPs a score position and width; a checkpointed layer's forward and the forwards
    # without gradients (the reference's, KTO's KL completion) again
    passes = 12 + 4 * checkpointed_share + 4 * job.forward_only_passes
    per_position = (
        passes * arch.num_attention_heads * head_dim(arch) * computed_tokens_per_micro_batch(job, micro_batch)
    )
    masked_kernel = MASKED_KERNEL_SLOWDOWN * (1.0 if job.cudnn_attention else EFFICIENT_KERNEL_SLOWDOWN)
    slower = on_mask * (masked_kernel * dropout - 1) + (executed - on_mask) * (dropout - 1)
    extra = per_position * slower * flop_seconds
    if varlen:
        tokens = kernel_example_tokens(job, micro_batch)
        # the sliding layers' bands (the kernel's window; never cuDNN's, which has none) at their own rate
        windowed = sliding_causal_positions(arch, tokens) if job.attention in ("flash", "varlen") else 0.0
        rates = ((varlen - windowed, packed_attention_rate(job, tokens)), (windowed, windowed_rate(job, tokens)))
        extra += per_position * sum(n * (1 / (job.peak_tflops * 1e12 * rate) - flop_seconds) for n, rate in rates)
    return extra
