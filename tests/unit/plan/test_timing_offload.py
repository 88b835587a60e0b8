"""Host traffic and the CPU optimizer step of the offload tiers (plan/timing._offload_time), hand-computed
from what DeepSpeed's ZeRO-3 and torch's FSDP2 CPUOffloadPolicy move per micro-batch."""

from __future__ import annotations

import pytest

from finetune.plan import job_from_recipe
from finetune.plan.memory import weight_bytes
from finetune.plan.timing import (
    CPU_ADAM_PARAMS_PER_S,
    _offload_time,
    cpu_optimizer_params_per_s,
    step_time,
)
from finetune.plan.workload import count_params, lora_params
from finetune.recipe import load_recipe
from finetune.registry import get_model, get_preset

PRESET = "server-8xh100"


def _job(adapter: str):
    raw = {
        "model": {"name": "x", "arch": "llama-3.1-8b"},
        "adapter": adapter,
        "data": {"path": "t.jsonl"},
        "train": {"global_batch_size": 64},
        "hardware": PRESET,
    }
    return job_from_recipe(load_recipe(raw), arch=get_model("llama-3.1-8b"), preset=get_preset(PRESET))


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
        assert serial == pytest.approx((fetch + grads) / bw + n / p.nodes / CPU_ADAM_PARAMS_PER_S)


def test_optimizer_only_offload_sends_the_updated_partition_back_once_per_step():
    job = _job("full")
    p, n = job.preset, count_params(job.arch).total
    _, serial = _offload_time(job, strategy="zero3-optim-offload", grad_accum=2)
    pcie = ((2 * 2 + 2 * 2 + 4) + 2) * n / p.world_size
    assert serial == pytest.approx(pcie / (p.host_to_device_bandwidth_gbps * 1e9) + n / p.nodes / CPU_ADAM_PARAMS_PER_S)


def test_fsdp2_offload_prefetches_its_shards_in_their_stored_dtype():
    full, lora = _job("full"), _job("lora")
    p = full.preset
    bw, world, n = p.host_to_device_bandwidth_gbps * 1e9, p.world_size, count_params(full.arch).total
    overlapped, serial = _offload_time(full, strategy="fsdp2-offload", grad_accum=1)
    # accelerate upcasts trained parameters to fp32: the shards go up in fp32 (forward and backward) and
    # their fp32 gradients come down, non-blocking
    assert overlapped == pytest.approx((2 * 4 * n + 4 * n) / world / bw)
    assert serial == pytest.approx(n / p.nodes / cpu_optimizer_params_per_s("fsdp2-offload"))
    # a frozen base goes up in its 16-bit dtype
    lora_fetch, _ = _offload_time(lora, strategy="fsdp2-offload", grad_accum=1)
    adapters = lora_params(lora)
    assert lora_fetch == pytest.approx((2 * (weight_bytes(lora) + 4 * adapters) + 4 * adapters) / world / bw)
    # accumulating: shards go up for every micro-batch, gradients come down once (no_sync)
    overlapped4, serial4 = _offload_time(full, strategy="fsdp2-offload", grad_accum=4)
    assert overlapped4 == pytest.approx((4 * 2 * 4 * n + 4 * n) / world / bw) and serial4 == serial


def test_torch_fused_cpu_adamw_moves_fewer_bytes_than_deepspeed_cpuadam():
    assert cpu_optimizer_params_per_s("fsdp2-offload") == pytest.approx(CPU_ADAM_PARAMS_PER_S * 34 / 28)
    assert cpu_optimizer_params_per_s("zero3-offload") == CPU_ADAM_PARAMS_PER_S


def test_fsdp2_offload_fetch_overlaps_the_compute():
    job = _job("lora")
    t = step_time(job, strategy="fsdp2-offload", micro_batch=4, grad_accum=2, checkpointing=False)
    fetch, serial = _offload_time(job, strategy="fsdp2-offload", grad_accum=2)
    comm = t.intra_s + t.inter_s + fetch
    assert t.offload_s == pytest.approx(fetch + serial)
    assert t.step_s == pytest.approx(max(t.compute_s, comm) + 0.1 * min(t.compute_s, comm) + serial)
