"""Host traffic and the CPU optimizer step of the offload tiers (plan/offload_time.py), hand-computed
from what DeepSpeed's ZeRO-3 and torch's FSDP2 CPUOffloadPolicy move per micro-batch and per step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune.plan.host_time import host_seconds
from finetune.plan.memory import weight_bytes
from finetune.plan.offload_time import (
    CPU_CORE_BANDWIDTH,
    CPU_NORM_BANDWIDTH,
    NODE_HOST_BANDWIDTH,
    PAGEABLE_H2D_BANDWIDTH,
    cpu_optimizer_seconds,
    host_norm_seconds,
    host_optimizer_bytes_per_param,
    optimizer_writeback_seconds,
)
from finetune.plan.offload_time import offload_seconds as _offload_time
from finetune.plan.timing import HOST_GPU_OVERLAP_P, soft_max, step_time
from finetune.plan.workload import count_params, lora_params
from tests.helpers.recipes import shape_job

PRESET = "server-8xh100"


def _job(adapter: str, *, threads: int | None = 1):
    """One host thread per rank unless said: the byte counts below are then one core's."""
    return replace(shape_job("llama-3.1-8b", adapter, PRESET), host_threads_per_rank=threads)


def test_deepspeed_param_offload_fetches_twice_per_micro_batch_and_moves_gradients_four_ways():
    job = _job("full")
    p, n = job.preset, count_params(job.arch).total
    bw, world = p.host_to_device_bandwidth_gbps * 1e9, p.world_size
    for accum in (1, 4):
        overlapped, serial = _offload_time(job, strategy="zero3-offload", grad_accum=accum)
        # fetch: 16-bit partition for forward and backward of every micro-batch
        fetch = 2 * 2 * n / world * accum
        # gradients: down and up (bf16) on micro-batch 1, up and down on each further one, fp32 down once
        grads = (2 * 2 + 2 * 2 * (accum - 1) + 4) * n / world
        assert overlapped == 0.0  # the fetch is a blocking copy on the thread that launches the compute
        # CPUAdam on one thread per rank over its partition: unscale (8) + Adam (28) + 16-bit copy (6)
        assert serial == pytest.approx((fetch + grads) / bw + n / world * 42 / CPU_CORE_BANDWIDTH)


def test_optimizer_only_offload_casts_the_updated_partition_on_the_host_and_copies_it_up_pageable():
    job = _job("full")
    p, n = job.preset, count_params(job.arch).total
    _, serial = _offload_time(job, strategy="zero3-optim-offload", grad_accum=2)
    part = n / p.world_size
    pcie = (2 * 2 + 2 * 2 + 4) * part  # the gradients' traffic, pinned
    # the 16-bit partition lives on the GPU: no host-side copy after the step (8 + 28 bytes)
    cpu = part * 36 / CPU_CORE_BANDWIDTH
    # one copy_ across devices and dtypes: a cast on the host (read fp32, write bf16), a pageable copy up
    writeback = part * (4 + 2) / CPU_CORE_BANDWIDTH + part * 2 / PAGEABLE_H2D_BANDWIDTH
    assert optimizer_writeback_seconds(job, strategy="zero3-optim-offload") == pytest.approx(writeback)
    assert serial == pytest.approx(pcie / (p.host_to_device_bandwidth_gbps * 1e9) + cpu + writeback)
    # the other tiers write back elsewhere: on the host (parameters offloaded too) or not at all
    for strategy in ("zero3-offload", "fsdp2-offload", "zero3"):
        assert optimizer_writeback_seconds(job, strategy=strategy) == 0.0


def test_fsdp2_offload_prefetches_its_shards_in_their_stored_dtype():
    full, lora = _job("full"), _job("lora")
    p = full.preset
    bw, world, n = p.host_to_device_bandwidth_gbps * 1e9, p.world_size, count_params(full.arch).total
    overlapped, serial = _offload_time(full, strategy="fsdp2-offload", grad_accum=1)
    # accelerate upcasts trained parameters to fp32: the shards go up in fp32 (forward and backward) and
    # their fp32 gradients come down, non-blocking
    assert overlapped == pytest.approx((2 * 4 * n + 4 * n) / world / bw)
    assert serial == pytest.approx(cpu_optimizer_seconds(full, strategy="fsdp2-offload"))
    # a frozen base goes up in its 16-bit dtype
    lora_fetch, _ = _offload_time(lora, strategy="fsdp2-offload", grad_accum=1)
    adapters = lora_params(lora)
    assert lora_fetch == pytest.approx((2 * (weight_bytes(lora) + 4 * adapters) + 4 * adapters) / world / bw)
    # accumulating: shards go up for every micro-batch, gradients come down once (no_sync)
    overlapped4, serial4 = _offload_time(full, strategy="fsdp2-offload", grad_accum=4)
    assert overlapped4 == pytest.approx((4 * 2 * 4 * n + 4 * n) / world / bw) and serial4 == serial


def test_host_optimizer_bytes_follow_what_each_library_does_per_step():
    # torch: finetune's non-finite check reads the gradients (4), clip_grad_norm_ scales them (8), fused
    # AdamW 28 on the rank's threads; without clipping no scale
    assert host_optimizer_bytes_per_param("fsdp2-offload") == 40
    assert host_optimizer_bytes_per_param("fsdp2-offload", clips=False) == 32
    # DeepSpeed: unscale_and_clip_grads (8), CPUAdam (28), + the 16-bit partition copy when params are on the host
    assert host_optimizer_bytes_per_param("zero3-offload") == 42
    assert host_optimizer_bytes_per_param("zero3-nvme") == 42
    assert host_optimizer_bytes_per_param("zero3-optim-offload") == 36


def test_cpu_optimizer_step_runs_on_the_ranks_threads_over_its_partition():
    """A rank's step takes its partition x bytes / its bandwidth: its threads x one core's, capped by its
    share of the node's memory bandwidth; the ranks of a node step in parallel."""
    job = _job("full")
    n = count_params(job.arch).total
    one = cpu_optimizer_seconds(job, strategy="zero3-offload")
    assert one == pytest.approx(n / job.preset.world_size * 42 / CPU_CORE_BANDWIDTH)
    two = cpu_optimizer_seconds(replace(job, host_threads_per_rank=2), strategy="zero3-offload")
    assert two == pytest.approx(n / job.preset.world_size * 42 / min(2 * CPU_CORE_BANDWIDTH, NODE_HOST_BANDWIDTH / 8))
    # as launched by finetune: the node's cores split between its ranks, the node's bandwidth shared
    launched = _job("full", threads=None)
    per_rank = min(job.preset.host_cpu_cores // 8 * CPU_CORE_BANDWIDTH, NODE_HOST_BANDWIDTH / 8)
    assert cpu_optimizer_seconds(launched, strategy="zero3-offload") == pytest.approx(
        n / job.preset.world_size * 42 / per_rank
    )
    half = replace(job, preset=job.preset.model_copy(update={"gpus_per_node": job.preset.gpus_per_node // 2}))
    assert cpu_optimizer_seconds(half, strategy="zero3-offload") == pytest.approx(2 * one)
    # LoRA: only the adapters are stepped on the host
    lora = _job("lora")
    assert cpu_optimizer_seconds(lora, strategy="zero3-offload") < one / 100


def test_fsdp2_offload_fetch_overlaps_the_compute():
    job = _job("lora")
    t = step_time(job, strategy="fsdp2-offload", micro_batch=4, grad_accum=2, checkpointing=False)
    fetch, serial = _offload_time(job, strategy="fsdp2-offload", grad_accum=2)
    comm = t.intra_s + t.inter_s + fetch
    assert t.offload_s == pytest.approx(fetch + serial)
    # the GPU's busy time is the soft maximum of its compute and the host's launching (timing.soft_max)
    host = host_seconds(job, strategy="fsdp2-offload", grad_accum=2, checkpointed_layers=0)
    busy = soft_max(t.compute_s, host, p=HOST_GPU_OVERLAP_P)
    assert t.step_s == pytest.approx(max(busy, comm) + 0.1 * min(busy, comm) + serial)


def test_torch_takes_the_host_gradient_norm_on_one_thread():
    """clip_grad_norm_'s norm over FSDP2's host shards reads 4 bytes a parameter at one thread's rate,
    whatever the rank's threads; DeepSpeed takes its norm on the GPU; no clipping, no norm."""
    many = _job("full", threads=32)
    part = count_params(many.arch).total / many.preset.world_size
    norm = part * 4 / CPU_NORM_BANDWIDTH
    assert host_norm_seconds(many, strategy="fsdp2-offload") == pytest.approx(norm)
    assert host_norm_seconds(_job("full"), strategy="fsdp2-offload") == pytest.approx(norm)
    bandwidth = min(32 * CPU_CORE_BANDWIDTH, NODE_HOST_BANDWIDTH / many.preset.gpus_per_node)
    assert cpu_optimizer_seconds(many, strategy="fsdp2-offload") == pytest.approx(part * 40 / bandwidth + norm)
    assert host_norm_seconds(many, strategy="zero3-offload") == 0.0
    unclipped = replace(many, clips_gradients=False)
    assert host_norm_seconds(unclipped, strategy="fsdp2-offload") == 0.0
    assert cpu_optimizer_seconds(unclipped, strategy="fsdp2-offload") == pytest.approx(part * 32 / bandwidth)


def test_max_grad_norm_zero_plans_no_clipping():
    from finetune.plan import job_from_recipe, lookup
    from finetune.recipe import load_recipe
    from tests.helpers.recipes import tiny_recipe

    def job(**train):
        recipe = load_recipe(tiny_recipe(train=train))
        arch, preset, _ = lookup(recipe, hardware=PRESET)
        return job_from_recipe(recipe, arch=arch, preset=preset)

    assert job().clips_gradients and not job(max_grad_norm=0.0).clips_gradients
