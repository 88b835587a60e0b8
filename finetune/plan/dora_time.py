"""The step time DoRA adds to LoRA: memory-bound work that the FLOPs formula does not see.

peft's DoRA (tuners/lora/dora.py, DoraLinearLayer.forward; tuners/lora/variants.py DoraLinearVariant)
runs per targeted module on every training forward (its cache is off while training):
  weight side, once per module and forward, whatever the token count:
    lora_weight = lora_B(lora_A(eye(in))).T   an in x in identity in the adapter dtype, cast to the
                                               compute dtype by autocast, two thin matmuls (2*in^2*r +
                                               2*in*r*out FLOPs) and an in x out product
    .to(x.dtype), W.to(x.dtype)                fp32 copies of the product and the frozen weight where
                                               peft casts the adapter input to fp32 (DDP LoRA)
    W + scaling * lora_weight, its row norms   two elementwise passes and a reduction over in x out
  (the norm is detached: none of this has a backward);
  token side, per token and output feature, beyond LoRA's `result + lora_out * scaling`:
    (m/||.|| - 1) * base_result + m/||.|| * lora_result * scaling, then added to the result and cast back:
    five elementwise passes forward, promoted to the magnitude's dtype (fp32 adapters), and in the
    backward the gradients of both products with respect to the token tensors and to the magnitude
    (a reduction over tokens), the dtype casts between, and the two gradients of the base output summed.
Bytes are counted per pass (read + write, each tensor's own dtype) and timed at the bandwidth a
streaming kernel reaches (plan/bandwidth.py: a share of the preset's datasheet gpu_memory_bandwidth_gbps):
these kernels move bytes, they do not multiply. Counts per token and output feature, with p the
promoted dtype's and a the compute dtype's bytes: forward 3a + 9p (+ a + p for the cast back when
p != a) against LoRA's 5a; backward 16p + 9a where p != a (17a otherwise) against LoRA's 2a.
Activation checkpointing repeats the forward of the checkpointed layers. Not counted: kernel launch
latency (plan/host_time.py counts DoRA's kernels in the host's floor) and peft's fp32 cast of each module's
input, which LoRA with casts pays as well. These passes run below the streaming rate (fp32 broadcasts over the
out-features, dtype copies, reductions): one module timed alone on an H200 (scripts/dora_rates.py) took 1.22-1.80 x
their bytes' time, DORA_PASS_SLOWDOWN the geometric mean; Qwen2.5-1.5B's profile on an H200 (8 x 2 x 2,048 tokens,
docs/results/profiles/qwen2.5-1.5b-dora-h200-2026-11-29.txt against its LoRA twin) measured 1.15 s a step of
elementwise kernels beyond LoRA's, where the bytes with that slowdown plan 0.95 s.
With lora dropout, DoRA cannot reuse the base layer's output (the magnitude scales the dropped-out input's):
DoraLinearVariant.forward computes F.linear(dropout(x), W) again, a second matmul of each targeted weight forward and
for its input gradient backward (recomputed_base_flops_per_token, GEMM FLOPs the step's linear time takes in;
plan/memory.py dora_dropout_weight_bytes for the copy of W it may keep).
"""

from __future__ import annotations

from finetune.plan.bandwidth import memory_seconds
from finetune.plan.workload import Job, computed_tokens_per_micro_batch, targeted_linears

# DoRA's passes (fp32 broadcasts over out-features, dtype copies, reductions) take longer than their bytes at the
# streaming rate: scripts/dora_rates.py on an H200, one module's DoRA forward + backward less its LoRA twin's, 21
# cases of 4,096-16,384 tokens and widths 1,536-8,192 whose difference is 2 ms or more: 1.22-1.80 x the planned
# bytes' time, geometric mean 1.39 (fp32 adapters 1.33, bf16 1.51)
# (docs/results/dora-rates-2026-11-30-h200.json)
DORA_PASS_SLOWDOWN = 1.39


def _weight_side_bytes(
    *,
    fin: int,
    fout: int,
    r: int,
    adapter: int,
    compute: int,
    x: int,
    weight: float,
    dequantize: float,
    recomputes_base: bool = False,
) -> float:
    """One module's weight-norm recomputation, bytes moved (see the module docstring)."""
    square, io, thin = fin * fin, fin * fout, fin * r
    moved: float = adapter * square  # torch.eye
    if adapter != compute:
        moved += (adapter + compute) * square  # autocast's cast of the identity
    moved += compute * square + compute * thin  # lora_A(eye)
    moved += compute * thin + compute * io  # lora_B(...)
    moved += dequantize * io  # QLoRA: the NF4 weight dequantized to 16 bits
    if x != compute:
        moved += (compute + x) * io  # lora_weight.to(x.dtype)
    if x != weight:
        moved += (weight + x) * io  # W.to(x.dtype)
    if recomputes_base and x != compute:
        moved += (x + compute) * io  # autocast's cast of that copy for the recomputed base output
    moved += 2 * x * io + 3 * x * io + x * io  # scaling * BA, W + it, the row norms
    return moved


def _token_side_bytes(*, promoted: int, compute: int) -> tuple[float, float]:
    """(forward, backward) bytes per token and output feature beyond LoRA's."""
    p, a = promoted, compute
    cast = p + a if p != a else 0
    forward = 3 * a + 9 * p + cast - 5 * a
    backward = (16 * p + 9 * a if p != a else 17 * a) - 2 * a
    return forward, backward


def dora_seconds(
    job: Job, *, micro_batch: int, casts: bool, checkpointed_share: float = 0.0, params_16bit: bool = False
) -> float:
    """Seconds one micro-batch's forward and backward spend on DoRA beyond LoRA, per GPU (0 when the
    preset has no memory bandwidth or the job has no DoRA); `params_16bit`: as Job.dora_dtype_bytes."""
    bandwidth = job.preset.gpu_memory_bandwidth_gbps
    if not job.dora or job.adapter == "full" or not bandwidth:
        return 0.0
    a = job.act_bytes
    # the module's input is cast to the adapters' dtype with them (Job.dora_dtype_bytes)
    adapter, promoted = job.dora_dtype_bytes(casts=casts, params_16bit=params_16bit)
    x = adapter
    qlora = job.adapter == "qlora"
    weight_side = token_out = 0.0
    flops = 0.0
    for n, fin, fout in targeted_linears(job.arch, job.lora_targets):
        weight_side += n * _weight_side_bytes(
            fin=fin,
            fout=fout,
            r=job.lora_r,
            adapter=adapter,
            compute=a,
            x=x,
            weight=a if qlora else job.weight_bytes,
            dequantize=(0.5 + 2) if qlora else 0.0,
            recomputes_base=job.dora_recomputes_base,
        )
        flops += n * 2 * fin * job.lora_r * (fin + fout)
        token_out += n * fout
    forward, backward = _token_side_bytes(promoted=promoted, compute=a)
    tokens = computed_tokens_per_micro_batch(job, micro_batch)
    repeat = 1.0 + checkpointed_share
    moved = repeat * weight_side + tokens * token_out * (repeat * forward + backward)
    return DORA_PASS_SLOWDOWN * memory_seconds(job.preset, moved) + repeat * flops / (job.peak_tflops * 1e12)


def recomputed_base_flops_per_token(job: Job, *, checkpointed_share: float = 0.0) -> float:
    """With lora dropout, peft's DoRA cannot reuse the base layer's output (its input is not the dropped-out one
    the magnitude scales): DoraLinearVariant.forward computes F.linear(dropout(x), W) again, a second matmul of
    every targeted weight forward (again for the recomputed layers) and its input gradient backward. GEMM FLOPs per
    token (scripts/dora_rates.py on an H200: the dropout's extra time is 0.8-0.9 of the module's LoRA forward and
    backward at 4,096-16,384 tokens and widths 4,096-8,192)."""
    if not job.dora_recomputes_base:
        return 0.0
    targeted = sum(n * fin * fout for n, fin, fout in targeted_linears(job.arch, job.lora_targets))
    return 2 * targeted * (1.0 + checkpointed_share) + 2 * targeted
