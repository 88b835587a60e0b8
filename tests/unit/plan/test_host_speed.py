"""A host-bound plan says what the host's speed does to it: the floor takes the slowest host measured, and the
plan states the share of its step time the fastest measured host would take (plan/host_time.py)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from finetune.plan import plan
from finetune.plan.host_time import FASTEST_HOST_S_PER_KERNEL, HOST_S_PER_KERNEL, host_seconds
from finetune.plan.timing import HOST_GPU_OVERLAP_P, soft_max
from tests.helpers.recipes import shape_job, shape_recipe


def test_a_host_bound_plan_names_both_host_speeds_and_the_share_the_faster_would_take():
    # LoRA 8B at micro-batch 1 of 512 tokens: ~5,000 kernels a micro-batch, ~40 ms of GPU work each
    recipe = shape_recipe(
        "llama-3.1-8b", "lora", "server-8xh100", model__arch="llama-3.1-8b", data__max_length=512,
        train__micro_batch_size=1, train__global_batch_size=64,
    )  # fmt: skip
    p = plan(recipe, hardware="server-8xh100")
    chosen = p.chosen
    assert chosen.bottleneck == "host", p.why
    assert f"takes {HOST_S_PER_KERNEL * 1e6:.0f} us a kernel, the slowest host measured" in p.why, p.why
    assert "--hardware auto, times its host" in p.why
    share = float(re.search(r"the fastest, the step would take (\d+)% of its time", p.why).group(1)) / 100
    # the host floor at the faster rate against the same GPU work, as the step's soft maximum of the two
    job = shape_job("llama-3.1-8b", "lora")
    fastest = host_seconds(
        job, strategy=chosen.strategy, grad_accum=chosen.gradient_accumulation_steps,
        checkpointed_layers=chosen.checkpoint_layers, s_per_kernel=FASTEST_HOST_S_PER_KERNEL,
    )  # fmt: skip
    expected = soft_max(chosen.compute_time_s, fastest, p=HOST_GPU_OVERLAP_P) / chosen.step_time_s
    assert share == round(expected, 2)
    assert 0.4 < share < 0.9  # the kernels are most of this host floor


def test_a_compute_bound_plan_says_nothing_of_the_host():
    recipe = shape_recipe("llama-3.1-8b", "lora", "server-8xh100", model__arch="llama-3.1-8b")
    p = plan(recipe, hardware="server-8xh100")
    assert p.chosen.bottleneck != "host"
    assert "slowest host measured" not in p.why


def test_a_measured_host_replaces_the_floor_in_the_step_time_and_the_why():
    """A preset that carries this machine's host time a kernel (finetune.hostprobe, as `--hardware auto` measures it
    for a host-bound plan) plans the host's launches at that figure, and the why names it."""
    from finetune.plan import plan_job, with_measured_host
    from finetune.registry import get_preset

    job = shape_job(
        "llama-3.1-8b", "lora", data__max_length=512, train__micro_batch_size=1, train__global_batch_size=64
    )
    floor = plan_job(job)
    assert floor.chosen.bottleneck == "host"
    measured = 30e-6
    fast = dataclasses.replace(job, preset=job.preset.model_copy(update={"host_s_per_kernel": measured}))
    faster = plan_job(fast)
    step = host_seconds(
        fast, strategy=faster.strategy, grad_accum=faster.gradient_accumulation_steps,
        checkpointed_layers=faster.checkpoint_layers,
    )  # fmt: skip
    assert step == pytest.approx(
        host_seconds(
            job,
            strategy=faster.strategy,
            grad_accum=faster.gradient_accumulation_steps,
            checkpointed_layers=faster.checkpoint_layers,
            s_per_kernel=measured,
        )  # fmt: skip
    )
    assert faster.step_time_s < floor.step_time_s
    assert "This machine's host took 30 us a kernel, measured on its GPU" in faster.why
    # only a GPU preset without a figure is probed: the cpu preset and an already measured one are left as they are
    assert with_measured_host(fast) is fast
    cpu = dataclasses.replace(job, preset=get_preset("cpu"))
    assert with_measured_host(cpu) is cpu
