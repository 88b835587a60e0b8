"""Step-time estimate: compute vs communication (intra-node, inter-node) vs offload traffic.

FLOPs per trained token (N = parameters a token multiplies with: decoder layers with the routed
experts only, plus the lm_head; L layers, a = heads x head_dim, s = sequence length):
  full:        6N + 12*L*a*s      (forward 2N, backward 4N; attention scores and values, PaLM appendix B)
  lora/qlora:  4N + 12*L*a*s + 6*T   (the frozen base gets no weight gradients: forward 2N plus
               backward w.r.t. activations 2N; T = LoRA params)
  checkpointing: + 2N + 4*L*a*s   (one extra forward per layer)
  dpo:         the policy on chosen + rejected (2 sequences per sample) plus a reference forward
               (2N + 4*L*a*s per token) unless the reference log-probs are precomputed.
Compute time = FLOPs / (peak x efficiency). Efficiency is an HF-stack MFU: 0.45 on GPUs for a full
fine-tune; LoRA/QLoRA with finetune's GPU defaults (varlen attention, Liger, no peft input casts) reach
about the same (their extra elementwise adapter kernels are balanced by the frozen base's cheaper
backward); QLoRA also dequantizes NF4 on every matmul; small micro-batches underuse the GPU.
Calibrated on the second-pass runs in tests/data/gpu_calibration.json (H200, tokens/s over 20-30 steps,
start-up included): 8B LoRA 1 GPU 13.4k tokens/s (steady 13.7k), QLoRA 13.2k = 0.99 of LoRA's, 3B full
FSDP2 on 2 GPUs 39.2k (steady 52.1k).

Collectives (ring algorithms; NCCL's bus-bandwidth convention): with `bus_bandwidth` the per-GPU
figure nccl-tests reports, an all-reduce of S bytes over n ranks takes 2(n-1)/n * S / bus_bandwidth,
an all-gather or reduce-scatter of S bytes (the full, gathered size) (n-1)/n * S / bus_bandwidth.
For n = 2 the all-reduce is S / bandwidth, the simple bytes/bandwidth figure. Across nodes the
per-node fabric carries the same fractions with n = number of nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from finetune.plan.memory import OFFLOADED, state_bytes, tokens_per_micro_batch, weight_bytes
from finetune.plan.workload import Job, count_params, head_dim, trainable_params

GPU_EFFICIENCY = 0.45
CPU_EFFICIENCY = 0.30
# x GPU_EFFICIENCY for LoRA/QLoRA: 8B LoRA on 1 x H200 measured 13.4k tokens/s over a 20-step run,
# predicted 8.4k at 0.65 (the factor fitted to the old sdpa + fp32-cast defaults' 6.7k on H100)
ADAPTER_EFFICIENCY = 1.0
QLORA_EFFICIENCY = 0.95  # dequantizing NF4 weights on every matmul: measured 0.99 of LoRA's tokens/s (H200)
MICRO_BATCH_HALF_TOKENS = 512  # efficiency x tokens/(tokens + this): small micro-batches underuse the GPU
ZERO3_COMM_FACTOR = 1.2  # DeepSpeed's parameter fetching overlaps less than FSDP2's prefetch
OVERLAP_LEAK = 0.1  # share of the smaller of compute/communication that is not hidden
CPU_ADAM_PARAMS_PER_S = 2e9  # DeepSpeedCPUAdam on one node's cores, parameters per second


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


def flops_per_token(job: Job, *, checkpointing: bool) -> float:
    """Training FLOPs per token of one sequence (see the module docstring)."""
    arch = job.arch
    n = count_params(arch).matmul_active
    attn = arch.num_layers * arch.num_attention_heads * head_dim(arch) * job.seq_len
    if job.adapter == "full":
        flops = 6 * n + 12 * attn
    else:
        flops = 4 * n + 12 * attn + 6 * trainable_params(job)
    if checkpointing:
        flops += 2 * n + 4 * attn
    if job.reference in ("implicit", "copy"):  # dpo/kto: a reference forward
        flops += 2 * n + 4 * attn
    return flops


def model_flops_per_token(job: Job) -> float:
    """The useful FLOPs (no recomputation, no reference model) for MFU."""
    n = count_params(job.arch).matmul_active
    attn = job.arch.num_layers * job.arch.num_attention_heads * head_dim(job.arch) * job.seq_len
    return (6 if job.adapter == "full" else 4) * n + 12 * attn


def efficiency(job: Job, *, micro_batch: int) -> float:
    base = CPU_EFFICIENCY if job.preset.vendor == "cpu" else GPU_EFFICIENCY
    if job.adapter != "full" and job.preset.vendor != "cpu":
        base *= ADAPTER_EFFICIENCY
    if job.adapter == "qlora":
        base *= QLORA_EFFICIENCY
    tokens = tokens_per_micro_batch(job, micro_batch)
    return base * tokens / (tokens + MICRO_BATCH_HALF_TOKENS)


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    intra_s: float
    inter_s: float
    offload_s: float
    step_s: float
    bottleneck: str  # compute | intra-node | inter-node | offload


def _sharded_collectives(*, gather: float, reduce: float, n_intra: int, n_nodes: int,
                         intra_bw: float, inter_bw: float, hybrid: bool) -> tuple[float, float]:
    """(intra, inter) seconds of one micro-batch: gather params twice (forward, backward), reduce grads."""
    intra = 2 * allgather_time_s(gather, n=n_intra, bus_bandwidth_gbps=intra_bw) \
        + allgather_time_s(reduce, n=n_intra, bus_bandwidth_gbps=intra_bw)
    if n_nodes <= 1:
        return intra, 0.0
    if hybrid:  # replicas across nodes: all-reduce the gradients only
        return intra, allreduce_time_s(reduce, n=n_nodes, bus_bandwidth_gbps=inter_bw)
    inter = 2 * allgather_time_s(gather, n=n_nodes, bus_bandwidth_gbps=inter_bw) \
        + allgather_time_s(reduce, n=n_nodes, bus_bandwidth_gbps=inter_bw)
    return intra, inter


def step_time(job: Job, *, strategy: str, micro_batch: int, grad_accum: int,
              checkpointing: bool) -> StepTime:
    """Seconds per optimizer step (grad_accum micro-batches on every rank)."""
    p = job.preset
    tokens = tokens_per_micro_batch(job, micro_batch) * grad_accum
    compute = flops_per_token(job, checkpointing=checkpointing) * tokens / (
        p.peak_bf16_tflops * 1e12 * efficiency(job, micro_batch=micro_batch))
    states = state_bytes(job)
    grad_bytes = states.trainable_params * (4 if job.adapter != "full" else 2)
    intra_bw, inter_bw = p.intra_node_bandwidth_gbps, p.inter_node_bandwidth_gbps or 1.0
    intra = inter = offload = 0.0
    if strategy == "ddp":
        # one all-reduce per optimizer step (no_sync while accumulating); hierarchical across nodes
        intra = allreduce_time_s(grad_bytes, n=p.gpus_per_node, bus_bandwidth_gbps=intra_bw)
        inter = allreduce_time_s(grad_bytes, n=p.nodes, bus_bandwidth_gbps=inter_bw)
    else:
        gather = weight_bytes(job)
        reduce = states.trainable_params * 4  # reduce-scatter in fp32
        per_intra, per_inter = _sharded_collectives(
            gather=gather, reduce=reduce, n_intra=p.gpus_per_node, n_nodes=p.nodes,
            intra_bw=intra_bw, inter_bw=inter_bw, hybrid=strategy == "fsdp2-hybrid")
        factor = ZERO3_COMM_FACTOR if strategy.startswith("zero3") else 1.0
        intra, inter = per_intra * grad_accum * factor, per_inter * grad_accum * factor
        if p.world_size == 1:
            intra = inter = 0.0
    if strategy in OFFLOADED:
        offload = _offload_time(job, strategy=strategy, grad_accum=grad_accum)
    comm = intra + inter
    overlapped = max(compute, comm) + OVERLAP_LEAK * min(compute, comm)
    # the CPU optimizer step and NVMe swaps run after backward, not overlapped with it
    total = overlapped + offload
    parts = {"compute": compute, "intra-node": intra, "inter-node": inter, "offload": offload}
    bottleneck = max(parts, key=parts.get)
    return StepTime(compute, intra, inter, offload, total, bottleneck)


def _offload_time(job: Job, *, strategy: str, grad_accum: int) -> float:
    p = job.preset
    states = state_bytes(job)
    world = p.world_size
    # every rank fetches its parameter shard over PCIe for forward and backward, and sends its
    # gradient shard back, every micro-batch
    pcie = (2 * weight_bytes(job) + 2 * states.trainable_params) / world * grad_accum
    seconds = pcie / (p.host_to_device_bandwidth_gbps * 1e9)
    seconds += states.trainable_params / p.nodes / CPU_ADAM_PARAMS_PER_S
    if strategy == "zero3-nvme":
        nvme_bw = (p.nvme_bandwidth_gbps or 1.0) * 1e9
        # params read per forward and backward; optimizer states (fp32 master + moments) read and written
        params = 2 * weight_bytes(job) / p.nodes * grad_accum
        optimizer = 2 * (states.trainable + states.optimizer) / p.nodes
        seconds += (params + optimizer) / nvme_bw
    return seconds
