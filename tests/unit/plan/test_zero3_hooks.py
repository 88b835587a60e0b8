"""ZeRO-3's module hooks on the host (plan/host_time.py): which module uses they count, and what they add."""

from __future__ import annotations

import dataclasses

import pytest

from finetune import strategies
from finetune.plan.host_time import ZERO3_HOOK_S_PER_MODULE_USE, host_seconds, zero3_module_uses
from tests.helpers.recipes import shape_job


def test_a_full_fine_tune_uses_each_linear_and_the_embeddings_in_the_forward_and_the_backward():
    job = shape_job("llama-3.1-8b", "full")
    # 32 layers x 7 linears, the embedding and the untied LM head, twice; norms stay whole (persistent)
    assert zero3_module_uses(job, checkpointed_layers=0) == 2 * (32 * 7 + 2)
    # a checkpointed layer runs its forward again: its 7 linears once more
    assert zero3_module_uses(job, checkpointed_layers=10) == 2 * (32 * 7 + 2) + 10 * 7


def test_lora_counts_only_the_adapter_matrices_zero3_partitions():
    job = shape_job("llama-3.1-8b", "lora")
    threshold = strategies.zero3_persistence_threshold(4096)
    r = job.lora_r
    assert r * 1024 < threshold < r * 4096  # k/v's B (1024 x r) stays whole; every A (r x 4096+) is partitioned
    adapters = 7 + 5  # every A; B of q, o, gate, up and down
    assert zero3_module_uses(job, checkpointed_layers=0) == 2 * (32 * (7 + adapters) + 2)
    # a DPO reference forward runs the base's modules once more, adapters off
    dpo = dataclasses.replace(job, method="dpo", reference="implicit")
    assert zero3_module_uses(dpo, checkpointed_layers=0) == 2 * (32 * (7 + adapters) + 2) + 32 * 7 + 2


def test_only_zero3_tiers_pay_the_hooks():
    job = shape_job("llama-3.1-8b", "full")
    uses = zero3_module_uses(job, checkpointed_layers=0)
    zero2 = host_seconds(job, strategy="zero2", grad_accum=2, checkpointed_layers=0)
    for tier in ("zero3", "zero3-offload", "zero3-optim-offload"):
        assert host_seconds(job, strategy=tier, grad_accum=2, checkpointed_layers=0) == pytest.approx(
            zero2 + 2 * ZERO3_HOOK_S_PER_MODULE_USE * uses
        )
    assert host_seconds(job, strategy="fsdp2", grad_accum=2, checkpointed_layers=0) < zero2


def test_a_host_bound_zero3_plan_says_what_its_host_does():
    from finetune.plan import plan
    from tests.helpers.recipes import shape_recipe

    pinned = shape_recipe(
        "llama-3.1-8b", "lora", "server-8xh100", model__arch="llama-3.1-8b", distributed__strategy="zero3"
    )
    p = plan(pinned, hardware="server-8xh100")
    chosen = next(c for c in p.candidates if c.strategy == "zero3" and c.micro_batch_size == p.micro_batch_size)
    assert chosen.bottleneck == "host" and chosen.step_time_s > chosen.compute_time_s
    uses = zero3_module_uses(shape_job("llama-3.1-8b", "lora"), checkpointed_layers=p.checkpoint_layers)
    assert f"runs ZeRO-3's hooks ({uses:,} gathers and releases of a module's parameters)" in p.why, p.why


def test_a_probed_hosts_figure_scales_the_hooks_python_not_their_wait():
    """A hook's share of the host's Python scales with a probed host's figure as the launches do; the rest, a wait on
    the gather, stays in seconds."""
    from finetune.plan.host_time import HOST_S_PER_KERNEL, ZERO3_HOOK_HOST_SHARE

    job = shape_job("llama-3.1-8b", "lora")
    uses = zero3_module_uses(job, checkpointed_layers=0)

    def beyond_zero2(s_per_kernel):  # ZeRO-3's gathers' launches (proportional to the figure) and its hooks
        timed = dict(grad_accum=1, checkpointed_layers=0, s_per_kernel=s_per_kernel)
        return host_seconds(job, strategy="zero3", **timed) - host_seconds(job, strategy="zero2", **timed)

    assert 0 < ZERO3_HOOK_HOST_SHARE < 1
    # all of it scaling would make the step beyond ZeRO-2's exactly twice as long at twice the figure
    unscaled = beyond_zero2(HOST_S_PER_KERNEL) - 2 * beyond_zero2(HOST_S_PER_KERNEL / 2)
    assert unscaled == pytest.approx(-(1 - ZERO3_HOOK_HOST_SHARE) * ZERO3_HOOK_S_PER_MODULE_USE * uses)
