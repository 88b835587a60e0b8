"""A host-bound plan says what the host's speed does to it: the floor takes the slowest host measured, and the
plan states the share of its step time the fastest measured host would take (plan/host_time.py)."""

from __future__ import annotations

import re

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
