"""Step-time estimate: compute vs communication (intra-node, inter-node) vs offload traffic.

FLOPs per trained token: `model_flops_per_token` (the one formula; the MFU of `finetune plan`,
scripts/bench.py and scripts/gpu_validate.py all use it), plus work that is not useful model FLOPs:
  checkpointing: + 2N + 4*L*a*s   (one extra forward per layer; x k/L when k of L layers are)
  target_experts: + 2 per active routed expert parameter (the folded experts' weight gradient: plan/moe_time.py)
  dpo:         the policy on chosen + rejected (2 sequences per sample) plus a reference forward
               (2N + 4*L*a*s per token) unless the reference log-probs are precomputed.
  kto:         the policy on each completion (1 sequence per sample), a forward without gradients on its
               mismatched KL completion, and the reference's forwards on both (Job.forward_only_passes).
The step time counts the attention FLOPs the kernels execute (`executed_attention_positions`): a causal
kernel (flash, varlen, sdpa on one unpadded row) computes the triangle, about half the s x s the MFU
counts; a masked kernel every block, and on a packed row of micro_batch x seq tokens (a model
finetune's varlen kernel does not serve, or sdpa/eager chosen) the whole square of the row.
Compute time: the linears' FLOPs (the decoder's, the routed experts', the lm_head's) at the rate GEMMs reach
(GEMM_EFFICIENCY of the card's bf16 peak), the attention kernels' FLOPs at theirs (ATTENTION_EFFICIENCY, replaced
by the varlen and cuDNN paths' measured rates: plan/attention_time.py), and the streaming passes around the
linears (norms, residual adds, activations, LoRA's adapter reads and adds, the loss's chunks of logits) as bytes
over the bandwidth streaming kernels reach (`linear_traffic_seconds`, plan/bandwidth.py): values per input and output
feature of each linear, where its FLOPs are the product of the two, so a narrow model (Qwen2.5-0.5B's 896 features)
spends a larger share of its step streaming than a wide one (Llama-70B's 8,192), and a card with less bandwidth per
FLOP a larger share than one with more. A full fine-tune's weight gradients are GEMMs with no pass of their own.
QLoRA also dequantizes NF4 on every matmul; small micro-batches underuse the GPU; float32 compute runs at
FP32_GPU_EFFICIENCY of the card's FP32 rate. Other memory-bound work the FLOPs do not show is timed at the same
bandwidth: DoRA's weight norms and elementwise passes (plan/dora_time.py), a masked attention kernel's mask bias
(plan/attention_time.py, with the masked and dropout kernels' own slowdowns), the norms, RoPE and SwiGLU where Liger
does not fuse them (plan/unfused_time.py), and an MoE layer's dispatch, whose expert GEMMs also run at a lower
efficiency for their few rows per expert (plan/moe_time.py). A packed row's varlen attention is the triangle of its
examples' token-weighted length where the data's lengths are known (data.example_tokens).
GEMM_EFFICIENCY and LINEAR_TRAFFIC_PASSES are fitted together on the calibration rows' steady tokens/s
(tests/data/gpu_calibration.json; the two trade along a ridge, 0.60 with 4 values to 0.75 with 7 fit almost alike).
They replaced one blended efficiency (0.45 of the peak, measured on 8B LoRA) which planned LoRA on one GPU at hidden
4.6-5.4k 0.77-0.88 of its measured speed (70B QLoRA 0.79) and MoE models of hidden 2k up to 1.24 of it.

The GPU's busy time is the soft maximum of that compute and the host's time to launch its kernels
(plan/host_time.py; `soft_max` below): eager PyTorch launches each kernel from the host, a short
micro-batch's GPU work waits for it, and where the two take about as long each waits on the other in turn.

Collectives (ring algorithms; NCCL's bus-bandwidth convention): with `bus_bandwidth` the per-GPU
figure nccl-tests reports, an all-reduce of S bytes over n ranks takes 2(n-1)/n * S / bus_bandwidth,
an all-gather or reduce-scatter of S bytes (the full, gathered size) (n-1)/n * S / bus_bandwidth.
For n = 2 the all-reduce is S / bandwidth, the simple bytes/bandwidth figure. Across nodes the
per-node fabric carries the same fractions with n = number of nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune import strategies
from finetune.plan.attention_time import kernel_extra_seconds, mask_seconds
from finetune.plan.bandwidth import memory_seconds
from finetune.plan.dora_time import dora_seconds, recomputed_base_flops_per_token
from finetune.plan.eager_time import eager_seconds
from finetune.plan.host_time import host_seconds
from finetune.plan.lora_time import fused_lora_saved_seconds, fused_lora_share
from finetune.plan.memory import (
    adapter_input_casts,
    checkpointed_layers,
    params_16bit,
    state_bytes,
    weight_bytes,
)
from finetune.plan.moe_time import moe_seconds, routed_active_params
from finetune.plan.offload_time import offload_seconds
from finetune.plan.unfused_time import unfused_seconds
from finetune.plan.workload import (
    Job,
    attended_positions,
    computed_tokens_per_micro_batch,
    count_params,
    executed_attention_positions,
    head_dim,
    job_attention_span,
    linear_features_per_token,
    trainable_params,
)
from finetune.registry.schema import ModelArch

# The linears' FLOPs on a GPU, as a share of the bf16 peak: fitted with LINEAR_TRAFFIC_PASSES (see the docstring). The
# profiles' GEMM kernels alone ran at 0.72 (8B LoRA, H200: docs/results/profiles/lora8b-finetune-h200.txt) and 0.78
# (3B full FSDP2 on 2 H200s: full3b-fsdp2-h200x2.txt); the fitted rate is below those by the gaps between kernels
# and the GEMMs' own start and tail, which no term here times apart.
GEMM_EFFICIENCY = 0.60
# The streaming kernels around each linear (the norm before it, the residual add after it, the activation, LoRA's
# reads of the input and adds to the output, the loss's chunks of logits after the lm_head) move, per token and
# pass, this many of the compute dtype's values per input and output feature of the linear (fitted).
LINEAR_TRAFFIC_PASSES = 4.0
# sdpa's cuDNN kernel on one unpadded row ran at 0.40-0.47 of the peak (scripts/attention_rates.py, H200: the sdpa
# cases of docs/results/attention-rates-2026-11-28-h200.json); the masked and dropout kernels' slowdowns are measured
# against that rate, the varlen and cuDNN paths' rates replace it (plan/attention_time.py)
ATTENTION_EFFICIENCY = 0.45
# A run computing in float32 (Job.computes_fp32: matmuls at the card's FP32 rate): its matmuls are so slow that the
# streaming passes which hold a bf16 8B LoRA step to about 0.45 of the peak hardly count. From the profile of full 1B
# in fp32 on an H200 (docs/results/profiles/llama1b-full-fp32-compute-h200-2026-11-28.txt): the SGEMMs ran at 0.82 of
# the FP32 peak and elementwise kernels took 3% of the GPU time; the masked fp32 attention kernel (0.41 of the peak
# there) is the attention FLOPs' time with plan/attention_time.py's masked-kernel terms. One model shape so far.
FP32_GPU_EFFICIENCY = 0.80
CPU_EFFICIENCY = 0.30
QLORA_EFFICIENCY = 0.95  # dequantizing NF4 weights on every matmul: measured 0.99 of LoRA's tokens/s (H200)
MICRO_BATCH_HALF_TOKENS = 512  # efficiency x tokens/(tokens + this): small micro-batches underuse the GPU
ZERO3_COMM_FACTOR = 1.2  # DeepSpeed's parameter fetching overlaps less than FSDP2's prefetch
OVERLAP_LEAK = 0.1  # share of the smaller of compute/communication that is not hidden
# The host launches kernels while the GPU runs queued ones: two stages of a pipeline whose queue every
# host sync drains (17 a step in the 8B LoRA profile), each faster in some stretches of a step and slower in
# others. Their shared time is a soft maximum, (compute^p + host^p)^(1/p): the larger one where the other is
# small, up to 2^(1/p) of it where they balance. The calibration rows' steady speeds say so: rows whose host
# time is 0.85-1.05 of their compute ran 1.13-1.58x slower than the larger of the two, rows below 0.5 or
# above 2 as planned. p minimizes the rows' mean |log(predicted / measured)| (flat from 3 to 4: 0.130-0.131,
# 0.150 with the plain maximum).
HOST_GPU_OVERLAP_P = 3.5
# The Trainer's own work per micro-batch on the host (collate, training_step, the loss's bookkeeping; the
# optimizer's Python): on a GPU it runs while queued kernels do (the GPU efficiency above includes the
# gaps it leaves); on a CPU the same cores do both, one after the other. Measured with the quickstart on
# 2 cores: ~33 ms a step (another run: ~53 ms), of which the forward, backward and AdamW step took ~13 ms.
CPU_HOST_S_PER_MICRO_BATCH = 0.02


def soft_max(a: float, b: float, *, p: float) -> float:
    """(a^p + b^p)^(1/p): max(a, b) where one is small against the other, 2^(1/p) x either where they are equal."""
    return (a**p + b**p) ** (1 / p)


def allreduce_time_s(nbytes: float, *, n: int, bus_bandwidth_gbps: float) -> float:
    """Ring all-reduce of `nbytes` over `n` ranks: 2(n-1)/n * nbytes / bus bandwidth (GB/s = 1e9 B/s)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (bus_bandwidth_gbps * 1e9)


def allgather_time_s(nbytes: float, *, n: int, bus_bandwidth_gbps: float) -> float:
    """Ring all-gather (or reduce-scatter) whose gathered size is `nbytes`: (n-1)/n * nbytes / bw."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / (bus_bandwidth_gbps * 1e9)


def model_flops_per_token(arch: ModelArch, *, span: float, adapter: str, trainable_params: int = 0) -> float:
    """Useful training FLOPs per token, the numerator of every MFU finetune reports (torchtitan's
    `get_nparams_and_flops` convention). N = parameters a token multiplies with (decoder layers with the
    routed experts only, plus the lm_head); L layers, a = heads x head_dim, s = `span`, the positions a token attends to
    (`workload.attention_span`: the sequence length, or the data's token-weighted example length where packed
    examples or shorter sequences are measured: attention across a packed row's examples is masked, not useful):

      full:        6N + 12*L*a*s        (forward 2N, backward 4N; attention scores and values, PaLM
                                         appendix B)
      lora/qlora:  4N + 12*L*a*s + 6*T  (the frozen base gets no weight gradients: forward 2N plus the
                                         backward w.r.t. activations 2N; T = `trainable_params`, the
                                         adapter's parameters, trained at 6 FLOPs each)

    Sliding-window layers (GPT-OSS) attend to at most their window (`attended_positions`).
    The attention term is not halved for the causal mask: a causal kernel skips about half of the
    score blocks, but torchtitan, PaLM and Megatron's published MFU figures count the full s x s
    product, so the figures here compare with theirs (and an adapter's attention backward still
    computes input gradients through every score, so no 2/3 either).
    """
    n = count_params(arch).matmul_active
    attn = attention_width_positions(arch, span)
    if adapter == "full":
        return 6 * n + 12 * attn
    return 4 * n + 12 * attn + 6 * trainable_params


def attention_width_positions(arch: ModelArch, span: float) -> float:
    """a x L x s of the useful attention FLOPs (12 of them a token, `model_flops_per_token`): the heads' width over
    every layer's attended positions (`attended_positions`: sliding layers to their window)."""
    return arch.num_attention_heads * head_dim(arch) * attended_positions(arch, span)


def job_model_flops_per_token(job: Job) -> float:
    return model_flops_per_token(
        job.arch,
        span=job_attention_span(job),
        adapter=job.adapter,
        trainable_params=trainable_params(job, active=True) if job.adapter != "full" else 0,
    )


def attention_flops_per_token(job: Job, *, checkpointing: bool | int, micro_batch: int | None = None) -> float:
    """The attention scores' and values' share of `flops_per_token` (12 a position and width, again 4 for every
    forward a checkpointed layer or a forward without gradients repeats): what the attention kernels compute, timed
    at their own rates (ATTENTION_EFFICIENCY, plan/attention_time.py), not the GEMMs'. With `micro_batch` the
    positions the kernels execute (`executed_attention_positions`), else the useful ones."""
    arch = job.arch
    if micro_batch is None:
        attn = attention_width_positions(arch, job_attention_span(job))
    else:
        attn = arch.num_attention_heads * head_dim(arch) * executed_attention_positions(job, micro_batch=micro_batch)
    forwards = checkpointed_layers(job, checkpointing) / arch.num_layers + job.forward_only_passes
    return (12 + 4 * forwards) * attn


def linear_flops_per_token(job: Job, *, checkpointing: bool | int) -> float:
    """The linears' share of `flops_per_token` (the useful FLOPs less attention's, again 2N for every forward a
    checkpointed layer or a forward without gradients repeats, and the folded experts' weight gradients): what
    the GEMMs compute."""
    arch = job.arch
    n = count_params(arch).matmul_active
    flops = job_model_flops_per_token(job) - 12 * attention_width_positions(arch, job_attention_span(job))
    # activation checkpointing (True: every layer, or the count of checkpointed layers) re-runs their forward
    share = checkpointed_layers(job, checkpointing) / arch.num_layers
    flops += (share + job.forward_only_passes) * 2 * n
    if job.adapter != "full":  # adapter.target_experts: the folded copies' weight gradients
        flops += 2 * routed_active_params(job.arch, layers=job.lora_expert_layers)
    # DoRA with lora dropout multiplies each targeted weight again (plan/dora_time.py)
    return flops + recomputed_base_flops_per_token(job, checkpointed_share=share)


def flops_per_token(job: Job, *, checkpointing: bool | int, micro_batch: int | None = None) -> float:
    """Training FLOPs per token of one sequence: the useful FLOPs plus recomputation and the forwards without
    gradients (DPO's and KTO's reference, KTO's KL completion: see the module docstring). With `micro_batch`,
    the attention FLOPs the kernels execute (`executed_attention_positions`: a masked packed row computes all of
    its T x T blocks) replace the useful ones."""
    linear = linear_flops_per_token(job, checkpointing=checkpointing)
    return linear + attention_flops_per_token(job, checkpointing=checkpointing, micro_batch=micro_batch)


def mfu(*, tokens_per_second: float, flops_per_token: float, peak_tflops: float, gpus: int) -> float:
    """Model FLOPs utilisation: achieved useful FLOP/s per GPU over the card's dense bf16 peak."""
    return tokens_per_second * flops_per_token / (peak_tflops * 1e12 * max(gpus, 1))


def micro_batch_fill(job: Job, micro_batch: int) -> float:
    """tokens / (tokens + MICRO_BATCH_HALF_TOKENS): the share of a rate a micro-batch of that many tokens reaches."""
    tokens = computed_tokens_per_micro_batch(job, micro_batch)
    return tokens / (tokens + MICRO_BATCH_HALF_TOKENS)


def linear_traffic_seconds(job: Job, *, micro_batch: int, checkpointed_share: float = 0.0) -> float:
    """Seconds one micro-batch's streaming kernels around the linears take (LINEAR_TRAFFIC_PASSES values per input
    and output feature, per token and pass: workload.linear_features_per_token), on a GPU's bandwidth: every
    forward (again for the recomputed layers and the forwards without gradients: Job.forward_only_passes) and the
    input-gradient backward. A full fine-tune's weight gradients are bare GEMMs, with no such pass of their own.
    0 on a CPU, whose CPU_EFFICIENCY is a blended rate."""
    if job.preset.vendor == "cpu":
        return 0.0
    tokens = computed_tokens_per_micro_batch(job, micro_batch)
    passes = 2.0 + checkpointed_share + job.forward_only_passes
    values = LINEAR_TRAFFIC_PASSES * linear_features_per_token(job.arch) * tokens * passes
    return memory_seconds(job.preset, values * job.act_bytes)


def efficiency(job: Job, *, micro_batch: int) -> float:
    if job.preset.vendor == "cpu":
        base = CPU_EFFICIENCY
    else:
        base = FP32_GPU_EFFICIENCY if job.computes_fp32 else GEMM_EFFICIENCY
    if job.adapter == "qlora":
        base *= QLORA_EFFICIENCY
    return base * micro_batch_fill(job, micro_batch)


def attention_efficiency(job: Job, *, micro_batch: int) -> float:
    """The attention kernels' reference rate (ATTENTION_EFFICIENCY; float32 compute and CPUs keep the step's)."""
    if job.preset.vendor == "cpu" or job.computes_fp32:
        return efficiency(job, micro_batch=micro_batch)
    return ATTENTION_EFFICIENCY * micro_batch_fill(job, micro_batch)


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    intra_s: float
    inter_s: float
    offload_s: float
    step_s: float
    bottleneck: str  # compute | intra-node | inter-node | offload | host (the Trainer on a CPU)


def _sharded_collectives(
    *, gather: float, reduce: float, n_intra: int, n_nodes: int, intra_bw: float, inter_bw: float, hybrid: bool
) -> tuple[float, float]:
    """(intra, inter) seconds of one micro-batch: gather params twice (forward, backward), reduce grads."""
    intra = 2 * allgather_time_s(gather, n=n_intra, bus_bandwidth_gbps=intra_bw) + allgather_time_s(
        reduce, n=n_intra, bus_bandwidth_gbps=intra_bw
    )
    if n_nodes <= 1:
        return intra, 0.0
    if hybrid:  # replicas across nodes: all-reduce the gradients only
        return intra, allreduce_time_s(reduce, n=n_nodes, bus_bandwidth_gbps=inter_bw)
    inter = 2 * allgather_time_s(gather, n=n_nodes, bus_bandwidth_gbps=inter_bw) + allgather_time_s(
        reduce, n=n_nodes, bus_bandwidth_gbps=inter_bw
    )
    return intra, inter


def step_time(
    job: Job,
    *,
    strategy: str,
    micro_batch: int,
    grad_accum: int,
    checkpointing: bool | int,
    sync_each_batch: bool = False,
) -> StepTime:
    """Seconds per optimizer step (grad_accum micro-batches on every rank); `sync_each_batch`: FSDP2
    reduce-scatters every micro-batch (accelerate's sync_each_batch) instead of once per step."""
    p = job.preset
    tokens = computed_tokens_per_micro_batch(job, micro_batch) * grad_accum
    rate = efficiency(job, micro_batch=micro_batch)
    flop_seconds = 1 / (job.peak_tflops * 1e12 * rate)  # a linear's FLOP at the GEMMs' rate
    # the attention kernels' FLOPs at their reference rate (their own rates: plan/attention_time.py)
    attention_seconds = 1 / (job.peak_tflops * 1e12 * attention_efficiency(job, micro_batch=micro_batch))
    attention = attention_flops_per_token(job, checkpointing=checkpointing, micro_batch=micro_batch)
    linear = linear_flops_per_token(job, checkpointing=checkpointing)
    compute = (linear * flop_seconds + attention * attention_seconds) * tokens
    checkpointed = checkpointed_layers(job, checkpointing)
    share = checkpointed / job.arch.num_layers
    compute += grad_accum * linear_traffic_seconds(job, micro_batch=micro_batch, checkpointed_share=share)
    # adapter.fused_lora: peft's scale-and-add passes, which the FLOPs' calibrated time includes, do not run
    compute -= fused_lora_share(
        compute,
        grad_accum
        * fused_lora_saved_seconds(job, strategy=strategy, micro_batch=micro_batch, checkpointed_share=share),
    )
    # memory-bound work the FLOPs do not show: attention mask biases (plan/attention_time.py), DoRA's
    # weight norms and elementwise passes (plan/dora_time.py)
    compute += grad_accum * mask_seconds(job, micro_batch=micro_batch, checkpointed_share=share)
    # masked kernels, attention dropout and the varlen kernel run below the step's FLOPs rate (plan/attention_time.py)
    compute += grad_accum * kernel_extra_seconds(
        job, micro_batch=micro_batch, checkpointed_share=share, flop_seconds=attention_seconds
    )
    # mixture of experts: small per-expert GEMMs and the dispatch traffic (plan/moe_time.py)
    compute += grad_accum * moe_seconds(
        job,
        micro_batch=micro_batch,
        efficiency=rate,
        half_tokens=MICRO_BATCH_HALF_TOKENS,
        repeat=1.0 + share,
    )
    # norms, RoPE and SwiGLU as chains of elementwise kernels where Liger does not fuse them (plan/unfused_time.py)
    compute += grad_accum * unfused_seconds(job, micro_batch=micro_batch, checkpointed_share=share)
    if job.dora:
        compute += grad_accum * dora_seconds(
            job,
            micro_batch=micro_batch,
            casts=adapter_input_casts(job, strategy),
            checkpointed_share=share,
            params_16bit=params_16bit(strategy),
        )
    if job.attention == "eager":  # passes over the materialized scores (plan/eager_time.py)
        compute += grad_accum * eager_seconds(job, micro_batch=micro_batch, checkpointed_share=share)
    states = state_bytes(job, strategy)
    grad_bytes = states.trainable_params * (4 if job.adapter != "full" else 2)
    intra_bw, inter_bw = p.intra_node_bandwidth_gbps, p.inter_node_bandwidth_gbps or 1.0
    intra = inter = offload = 0.0
    tier = strategies.info(strategy)
    if tier.backend == "ddp":
        # one all-reduce per optimizer step (no_sync while accumulating); hierarchical across nodes
        intra = allreduce_time_s(grad_bytes, n=p.gpus_per_node, bus_bandwidth_gbps=intra_bw)
        inter = allreduce_time_s(grad_bytes, n=p.nodes, bus_bandwidth_gbps=inter_bw)
    elif tier.zero_stage == 2:
        # no parameter gathering: DeepSpeed reduce-scatters the 16-bit gradients every micro-batch and
        # all-gathers the updated parameters once per optimizer step
        grads16 = states.trainable_params * 2
        per_step = allgather_time_s(
            states.trainable_params * job.weight_bytes, n=p.gpus_per_node, bus_bandwidth_gbps=intra_bw
        )
        intra = (
            allgather_time_s(grads16, n=p.gpus_per_node, bus_bandwidth_gbps=intra_bw) * grad_accum + per_step
        ) * ZERO3_COMM_FACTOR
        inter = (
            allgather_time_s(grads16, n=p.nodes, bus_bandwidth_gbps=inter_bw) * grad_accum
            + allgather_time_s(states.trainable_params * job.weight_bytes, n=p.nodes, bus_bandwidth_gbps=inter_bw)
        ) * ZERO3_COMM_FACTOR
    else:
        fsdp = tier.backend == "fsdp"
        # accelerate's FSDP2 reduces in the compute dtype and, under the Trainer's no_sync, only on the
        # last micro-batch of a step (every micro-batch with sync_each_batch, overlapped with the backward
        # like the others); DeepSpeed reduce-scatters every micro-batch (counted in fp32)
        reduce = states.trainable_params * (job.act_bytes if fsdp else 4)
        reductions = 1 if fsdp and not sync_each_batch else grad_accum
        g_intra, g_inter = _sharded_collectives(
            gather=weight_bytes(job),
            reduce=0.0,
            n_intra=p.gpus_per_node,
            n_nodes=p.nodes,
            intra_bw=intra_bw,
            inter_bw=inter_bw,
            hybrid=tier.hybrid,
        )
        r_intra, r_inter = _sharded_collectives(
            gather=0.0,
            reduce=reduce,
            n_intra=p.gpus_per_node,
            n_nodes=p.nodes,
            intra_bw=intra_bw,
            inter_bw=inter_bw,
            hybrid=tier.hybrid,
        )
        factor = 1.0 if fsdp else ZERO3_COMM_FACTOR
        intra = (g_intra * grad_accum + r_intra * reductions) * factor
        inter = (g_inter * grad_accum + r_inter * reductions) * factor
        if p.world_size == 1:
            intra = inter = 0.0
    fetch = 0.0
    if tier.offload != "none":
        # fetch: host-to-device copies prefetched like the all-gathers they feed (FSDP2); offload: the
        # CPU optimizer step, NVMe swaps and DeepSpeed's blocking copies, not overlapped
        fetch, offload = offload_seconds(job, strategy=strategy, grad_accum=grad_accum)
    comm = intra + inter + fetch
    # on a GPU the host launches the kernels while queued ones run: the GPU waits when the host is slower
    # (plan/host_time.py); on a CPU the host runs the Trainer's Python between the kernels, not beside them
    if p.vendor == "cpu":
        host = grad_accum * CPU_HOST_S_PER_MICRO_BATCH
        busy, serial = compute, host
    else:
        host = host_seconds(job, strategy=strategy, grad_accum=grad_accum, checkpointed_layers=checkpointed)
        busy, serial = soft_max(compute, host, p=HOST_GPU_OVERLAP_P), 0.0
    overlapped = max(busy, comm) + OVERLAP_LEAK * min(busy, comm)
    total = overlapped + offload + serial
    offload += fetch
    parts = {"compute": compute, "intra-node": intra, "inter-node": inter, "offload": offload, "host": host}
    bottleneck = max(parts, key=lambda name: parts[name])
    return StepTime(compute, intra, inter, offload, total, bottleneck)
