"""The CPU preset is the host's: its peak follows the cores this process may use, and a step on the CPU
pays the Trainer's host work after the compute (on a GPU that work runs while queued kernels do)."""

from __future__ import annotations

import dataclasses

import pytest

from finetune.plan.host_time import host_seconds
from finetune.plan.timing import CPU_HOST_S_PER_MICRO_BATCH, HOST_GPU_OVERLAP_P, soft_max, step_time
from finetune.registry import get_preset
from finetune.registry.detect import CPU_FLOPS_PER_CORE, on_cores, synthesize_preset, usable_cores
from tests.helpers.recipes import shape_job


def test_the_cpu_preset_has_this_hosts_cores():
    cpu = get_preset("cpu")
    assert cpu.host_cpu_cores == usable_cores()
    assert cpu.peak_bf16_tflops == pytest.approx(usable_cores() * CPU_FLOPS_PER_CORE / 1e12)
    two = on_cores(cpu, 2)
    assert (two.host_cpu_cores, two.peak_bf16_tflops) == (2, pytest.approx(0.192))
    # `--hardware auto` without GPUs makes the same preset for the cores it found
    detected = synthesize_preset([], ram_gib=24, cpu_cores=2)
    assert (detected.host_cpu_cores, detected.peak_bf16_tflops) == (2, pytest.approx(0.192))


@pytest.mark.parametrize("accumulation", [1, 4])
def test_a_cpu_step_adds_the_host_work_per_micro_batch_and_a_gpu_step_overlaps_it(accumulation):
    cpu = on_cores(get_preset("cpu"), 2)
    job = shape_job("llama-3.2-1b", "lora", cpu)
    timed = step_time(job, strategy="ddp", micro_batch=1, grad_accum=accumulation, checkpointing=False)
    assert timed.step_s == pytest.approx(timed.compute_s + accumulation * CPU_HOST_S_PER_MICRO_BATCH)
    assert timed.bottleneck == ("host" if accumulation * CPU_HOST_S_PER_MICRO_BATCH > timed.compute_s else "compute")
    gpu = shape_job("llama-3.2-1b", "lora", "server-8xh100")
    single = dataclasses.replace(gpu, preset=gpu.preset.model_copy(update={"gpus_per_node": 1}))
    on_gpu = step_time(single, strategy="ddp", micro_batch=1, grad_accum=accumulation, checkpointing=False)
    # on a GPU the host launches kernels while earlier ones run: the step is the soft maximum of the two
    # (timing.soft_max), here the host's (a 1B model's micro-batch of one row is short GPU work)
    host = host_seconds(single, strategy="ddp", grad_accum=accumulation, checkpointed_layers=0)
    assert on_gpu.step_s == pytest.approx(soft_max(on_gpu.compute_s, host, p=HOST_GPU_OVERLAP_P))
    assert max(on_gpu.compute_s, host) <= on_gpu.step_s < on_gpu.compute_s + host
    assert host > on_gpu.compute_s and on_gpu.bottleneck == "host"
    # a long micro-batch keeps the GPU busy much longer than the host takes to launch it: the step is about
    # the GPU's (2% more at this micro-batch, whose host time is ~0.4 of its compute)
    long = step_time(single, strategy="ddp", micro_batch=32, grad_accum=accumulation, checkpointing=False)
    assert long.step_s == pytest.approx(long.compute_s, rel=0.02) and long.bottleneck == "compute"
