"""Step time of the offload tiers: host <-> GPU traffic, NVMe swaps and the optimizer step on the CPU.

Traffic, per rank (PCIe at the preset's host_to_device bandwidth, each rank its own shard):

DeepSpeed ZeRO-3 (stage3.py, partition_parameters.py): a parameter partition is fetched with a
blocking `ds_tensor.to(device)` (16-bit) for the forward and again for the backward of every
micro-batch; gradient partitions go down into a pinned buffer in the 16-bit accumulation dtype and
come back to the GPU to be accumulated (micro-batch 1: down and up; each further one: up and down),
then down once more as fp32 for the CPU optimizer at the boundary; with parameters on the GPUs
(optimizer-only offload) the updated fp32 partition is copied once per step into the GPU's 16-bit
partition by one `copy_` across devices and dtypes, which torch runs as a cast on the host into a
pageable temporary and a synchronous pageable copy up (`optimizer_writeback_seconds`). All of it counts
as serial: the fetch blocks the host thread that launches the compute.
FSDP2 with CPUOffloadPolicy (_fsdp_param.py, _fsdp_collectives.py): shards are copied up
non-blocking in the dtype they are stored in (fp32 for trained parameters, which accelerate upcasts;
the model dtype for frozen ones) for forward and backward, prefetched like the all-gathers they feed
(overlapped); the fp32 gradient shards go down once per step, non-blocking (under the Trainer's
no_sync the reduce-scatter runs on the last micro-batch only).

The optimizer step on the host (`cpu_optimizer_seconds`) is bound by host memory traffic. Each rank
steps its own partition on the threads it was launched with (OMP_NUM_THREADS: both DeepSpeed's CPUAdam,
`#pragma omp parallel for` in csrc/adam/cpu_adam_impl.cpp, and torch's CPU kernels use that many), the
ranks of a node in parallel: partition params x bytes moved per param / the rank's bandwidth, which is
its threads x one core's streaming bandwidth, capped by its share of the node's memory bandwidth.
`accelerate launch` gives a GPU rank ONE thread unless told otherwise; finetune's launcher gives the
ranks of an offload tier the node's cores split between them (`host_threads_per_rank`, one home for the
launcher and this model). Runs launched before that (the calibration rows without
`host_threads_per_rank`) had one thread.
"""

from __future__ import annotations

from finetune import strategies
from finetune.plan.memory import state_bytes, state_shard_degree, weight_bytes
from finetune.plan.workload import Job, count_params, lora_params
from finetune.registry.schema import HardwarePreset

# One core's streaming bandwidth (mixed reads and writes) on the Xeon / EPYC hosts of H100/H200
# servers: one thread cannot use the socket's memory channels, ~20 GB/s (single-thread STREAM-like
# figures of Sapphire Rapids / Genoa are 15-25 GB/s)
CPU_CORE_BANDWIDTH = 20e9
# A node's host memory bandwidth that all its ranks' optimizer threads share. Measured per rank with two
# ranks a node: ~80 GB/s on the 2 x H200 host (torch's fused AdamW and the gradient scale at 16 threads,
# docs/results/profiles/full3b-fsdp2-offload-h200x2.txt), ~100 GB/s on the 2 x H100 host (CPUAdam and the
# unscale at 32 threads, full3b-zero3-optim-offload-h100x2.txt): the slower host's 2 x 80. Adam's five fp32
# streams per parameter and NUMA-remote pages reach well under a two-socket server's STREAM figure
NODE_HOST_BANDWIDTH = 160e9
# A host-to-GPU copy from pageable (unpinned) memory: the driver stages it through its own pinned
# buffer, at a fraction of the pinned rate. ~7.5 GB/s measured for ZeRO-3's 16-bit write-back on an
# H100 host (docs/results/profiles/full3b-zero3-optim-offload-h100x2.txt); 5-10 GB/s is the usual range
PAGEABLE_H2D_BANDWIDTH = 7.5e9
# torch's CPU vector norm (linalg.vector_norm, and _foreach_norm, which calls it per tensor on CPU) reduces on
# one thread whatever OMP_NUM_THREADS says (the same rate on 1 and 2 threads, where a dot product doubles), so
# clip_grad_norm_'s norm over host gradient shards runs at one core's reduction rate: 7.6 GB/s on the 2 x H200
# host (0.84 s a step for 1.6e9 fp32 gradients, docs/results/profiles/full3b-fsdp2-offload-h200x2.txt),
# ~10 GB/s on the 2 x H100 host beside other host work (full3b-fsdp2-offload-h100x2.txt)
CPU_NORM_BANDWIDTH = 7.6e9


# a swap disk neither measured (registry/disk.py) nor described by the preset: a SATA SSD's order, so that an
# NVMe plan is never optimistic about a disk nobody looked at
ASSUMED_NVME_GBPS = 1.0


def nvme_read_gbps(job: Job) -> float:
    """GB/s the planner reads the swap files at: measured on this machine, else the preset's, else assumed."""
    return job.nvme_read_gbps or job.preset.nvme_bandwidth_gbps or ASSUMED_NVME_GBPS


def host_threads_per_rank(preset: HardwarePreset, strategy: str) -> int:
    """Threads finetune's launcher gives each rank of `strategy` on a node of `preset`: the node's cores
    split between its ranks where the host steps the optimizer (offload tiers), else accelerate's one."""
    if not strategies.info(strategy).offload_optimizer:
        return 1
    return split_cores(preset.node_cpu_cores, preset.gpus_per_node)


def split_cores(cores: int, ranks: int) -> int:
    """A node's cores split between its ranks (accelerate's rule for CPU launches)."""
    return max(1, cores // max(1, ranks))


def host_optimizer_bytes_per_param(strategy: str, *, clips: bool = True) -> int:
    """Host memory bytes one optimizer step moves per trained parameter on the rank's threads (fp32
    everywhere on the host).

    DeepSpeed ZeRO-3 with offload_optimizer (stage3.py `step`): `unscale_and_clip_grads` multiplies the
    fp32 gradient partition in place every step (read + write, 8); CPUAdam reads param, gradient and
    both moments and writes param and moments (28); with the parameters offloaded too, the updated fp32
    partition is copied into the 16-bit partition on the host (read 4 + write 2). (The gradient norm is
    taken on the GPU before the partitions go down.)
    torch (FSDP2 CPUOffloadPolicy, the Trainer's adamw_torch_fused on CPU shards): finetune's non-finite
    check reads the gradients once (4; finetune.train.callbacks.sums_not_finite, which sees no gradients under
    DeepSpeed: it keeps them in its own partitions), clip_grad_norm_ (`clips`: train.max_grad_norm > 0)
    scales them in place (8), then fused AdamW (28); clip_grad_norm_'s norm runs on one thread
    (`host_norm_seconds`)."""
    if strategies.is_deepspeed(strategy):
        return 8 + 28 + (6 if strategies.info(strategy).offload_params else 0)
    return 4 + (8 if clips else 0) + 28


def host_partition(job: Job, strategy: str) -> float:
    """Trained parameters whose gradients and optimizer state one rank holds on the host: the trained
    parameters over the state shard degree."""
    return state_bytes(job, strategy).trainable_params / state_shard_degree(job, strategy)


def host_norm_seconds(job: Job, *, strategy: str) -> float:
    """Seconds per step of clip_grad_norm_'s norm over a rank's host gradient shards (torch tiers with the
    optimizer on the host and clipping on): 4 bytes a parameter at one thread's rate (CPU_NORM_BANDWIDTH)."""
    if strategies.is_deepspeed(strategy) or not job.clips_gradients:
        return 0.0
    return host_partition(job, strategy) * 4 / CPU_NORM_BANDWIDTH


def cpu_optimizer_seconds(job: Job, *, strategy: str) -> float:
    """Seconds of one optimizer step on the host: each rank steps the partition it owns (the trained
    parameters over the state shard degree) at its threads' bandwidth, the ranks in parallel, after the
    gradient norm that torch takes on one thread."""
    partition = host_partition(job, strategy)
    threads = job.host_threads_per_rank or host_threads_per_rank(job.preset, strategy)
    bandwidth = min(threads * CPU_CORE_BANDWIDTH, NODE_HOST_BANDWIDTH / job.preset.gpus_per_node)
    moved = partition * host_optimizer_bytes_per_param(strategy, clips=job.clips_gradients)
    return moved / bandwidth + host_norm_seconds(job, strategy=strategy)


def optimizer_writeback_seconds(job: Job, *, strategy: str) -> float:
    """Seconds per step that DeepSpeed's optimizer-only offload spends putting each rank's updated fp32
    partition into its 16-bit partition on the GPU (stage3.py: `fp16_partitioned_groups_flat[i].data.copy_(
    fp32_partitioned_groups_flat[i].data)`): torch casts on the host (read 4 + write 2 bytes a parameter,
    measured at about one core's bandwidth: 0.40 s for 1.6e9 parameters with 32 threads a rank), then copies
    the pageable temporary up. Zero for the other tiers: with the parameters offloaded too, the 16-bit copy
    stays on the host (host_optimizer_bytes_per_param)."""
    tier = strategies.info(strategy)
    if not (strategies.is_deepspeed(strategy) and tier.offload_optimizer and not tier.offload_params):
        return 0.0
    partition = host_partition(job, strategy)
    return (
        partition * (4 + job.weight_bytes) / CPU_CORE_BANDWIDTH + partition * job.weight_bytes / PAGEABLE_H2D_BANDWIDTH
    )


def offload_seconds(job: Job, *, strategy: str, grad_accum: int) -> tuple[float, float]:
    """(seconds that overlap the compute like a collective, seconds added after it) of one optimizer
    step's host traffic and host work, per rank (see the module docstring)."""
    p = job.preset
    tier = strategies.info(strategy)
    n = state_bytes(job, strategy).trainable_params
    world = p.world_size
    bw = p.host_to_device_bandwidth_gbps * 1e9
    overlapped = serial = 0.0
    if tier.backend == "fsdp":
        trained16 = count_params(job.arch).text_model * job.weight_bytes if job.adapter == "full" else 0.0
        fetched = weight_bytes(job) - trained16 + 4 * (n if job.adapter == "full" else lora_params(job))
        # gradients: reduced once per step (the Trainer's no_sync holds them unsharded on the GPU until
        # the last micro-batch), then the fp32 shard goes down non-blocking
        overlapped = (2 * fetched * grad_accum + 4 * n) / world / bw
    else:
        grads = 2 * (2 + 2 * (grad_accum - 1)) + 4  # bytes per trained parameter per step (see above)
        pcie = grads * n / world
        if tier.offload_params:
            pcie += 2 * weight_bytes(job) / world * grad_accum
        serial = pcie / bw
    serial += cpu_optimizer_seconds(job, strategy=strategy) + optimizer_writeback_seconds(job, strategy=strategy)
    if tier.offload == "nvme":
        states = state_bytes(job, strategy)
        nvme_bw = nvme_read_gbps(job) * 1e9
        # params read per forward and backward; optimizer states (fp32 master + moments) read and written
        params = 2 * weight_bytes(job) / p.nodes * grad_accum
        optimizer = 2 * (states.trainable + states.optimizer) / p.nodes
        serial += (params + optimizer) / nvme_bw
    return overlapped, serial
