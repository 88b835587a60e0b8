"""adapter.fused_lora in the plan (plan/lora_time.py): the elementwise bytes peft's layer moves and the fused
layer does not, and what grouping the linears of one input saves beyond it (adapter.fused_lora_groups),
hand-counted for Llama-3.1-8B, where the fused layer runs, and its kernels on the host."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune.plan.bandwidth import memory_seconds
from finetune.plan.host_time import KERNELS_PER_ADAPTED_LINEAR, kernels_per_micro_batch
from finetune.plan.lora_time import (
    KERNELS_SAVED_PER_FUSED_LINEAR,
    fused_lora_runs,
    fused_lora_saved_seconds,
    fused_lora_share,
    shared_input_groups,
)
from finetune.plan.timing import (
    attention_efficiency,
    attention_flops_per_token,
    efficiency,
    linear_flops_per_token,
    linear_traffic_seconds,
    step_time,
)
from tests.helpers.recipes import shape_job

# Llama-3.1-8B: hidden 4096, MLP 14336, 8 KV heads of 128; q, k, v, o, gate, up, down in 32 layers
OUT = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)
IN = 32 * (6 * 4096 + 14336)


def _job(**kw):
    # with Liger, as on an NVIDIA GPU with liger-kernel installed: the step is bound by its compute, not by
    # the host's launches (plan/host_time.py)
    return replace(shape_job("llama-3.1-8b", "lora", "server-8xh100"), **{"liger": True, **kw})


def test_the_default_recipe_plans_the_fused_layer():
    job = _job()
    assert job.fused_lora and fused_lora_runs(job, "ddp")


def test_saved_bytes_are_the_scale_and_add_passes_of_each_targeted_module():
    job = _job(lora_dropout=0.0, fused_lora_groups=False)
    tokens = 4 * job.seq_len
    a = 2  # bf16
    # forward: peft's 6a (write, scale, add) against the in-place addmm's 2a per output feature; backward: the
    # scale of the output gradient (2a) and the input gradient's write-and-add (4a) against addmm_'s 2a
    per_token = 4 * a * OUT + 2 * a * OUT + 2 * a * IN
    saved = fused_lora_saved_seconds(job, strategy="ddp", micro_batch=4, checkpointed_share=0.0)
    assert saved == pytest.approx(memory_seconds(job.preset, tokens * per_token))
    # checkpointing re-runs the forward of the checkpointed layers
    half = fused_lora_saved_seconds(job, strategy="ddp", micro_batch=4, checkpointed_share=0.5)
    assert half == pytest.approx(memory_seconds(job.preset, tokens * (per_token + 0.5 * 4 * a * OUT)))
    # with dropout the adapter's input is another tensor: autograd adds its gradient, nothing saved there
    dropped = fused_lora_saved_seconds(_job(lora_dropout=0.05), strategy="ddp", micro_batch=4, checkpointed_share=0.0)
    assert dropped == pytest.approx(memory_seconds(job.preset, tokens * (6 * a * OUT)))


def test_groups_save_the_further_members_reads_and_adds():
    job = _job(lora_dropout=0.0)
    assert job.fused_lora_groups  # on by default
    assert shared_input_groups(job) == [(32, 4096, 3), (32, 4096, 2)]  # q/k/v and gate/up read the hidden state
    tokens, a = 4 * job.seq_len, 2
    # per further member: one read of the input in the forward; in the backward autograd's add (3a) against the
    # GEMM's accumulating read (a), the adapter GEMM's read and write of the input gradient (2a), the read of
    # the input for the A gradient (a)
    further = 32 * 4096 * (2 + 1)
    alone = 4 * a * OUT + 2 * a * OUT + 2 * a * IN
    saved = fused_lora_saved_seconds(job, strategy="ddp", micro_batch=4, checkpointed_share=0.0)
    assert saved == pytest.approx(memory_seconds(job.preset, tokens * (alone + 6 * a * further)))
    ungrouped = _job(lora_dropout=0.0, fused_lora_groups=False)
    kernels = {
        g: kernels_per_micro_batch(j, strategy="ddp", checkpointed_layers=0) for g, j in ((1, job), (0, ungrouped))
    }
    assert kernels[0] - kernels[1] == pytest.approx(32 * (10 + 4))
    # with dropout each adapter reads its own input: no group runs
    assert shared_input_groups(_job(lora_dropout=0.05)) == []


@pytest.mark.parametrize(
    ("kw", "strategy"),
    [
        ({"fused_lora": False}, "ddp"),  # adapter.fused_lora: false
        ({}, "zero3"),  # ZeRO-3's partitions are gathered by each submodule's own forward: peft's path
        ({"cast_adapter_inputs": True}, "ddp"),  # peft casts the input to the fp32 adapter: its path
    ],
)
def test_where_peft_forward_runs_nothing_is_saved(kw, strategy):
    job = _job(**kw)
    assert not fused_lora_runs(job, strategy)
    assert fused_lora_saved_seconds(job, strategy=strategy, micro_batch=4, checkpointed_share=0.0) == 0.0


def test_the_step_is_shorter_by_the_saving_and_the_host_launches_fewer_kernels():
    fused, plain = _job(fused_lora_groups=False), _job(fused_lora=False)
    kw = {"strategy": "ddp", "micro_batch": 4, "grad_accum": 2, "checkpointing": False}
    saved = 2 * fused_lora_saved_seconds(fused, strategy="ddp", micro_batch=4, checkpointed_share=0.0)
    # the FLOPs' calibrated time with the streaming passes around the linears (peft's layer: its passes are inside
    # it), then the saved passes' share of it: nearly all of `saved` at 8B, where they are a tenth of the compute
    tokens = 2 * 4 * plain.seq_len
    peak = plain.preset.peak_bf16_tflops * 1e12
    attention = attention_flops_per_token(plain, checkpointing=False, micro_batch=4)
    linear = linear_flops_per_token(plain, checkpointing=False)
    calibrated = tokens * (
        linear / (peak * efficiency(plain, micro_batch=4))
        + attention / (peak * attention_efficiency(plain, micro_batch=4))
    ) + 2 * linear_traffic_seconds(plain, micro_batch=4)
    share = calibrated * saved / (calibrated + saved)
    assert step_time(fused, **kw).bottleneck == step_time(plain, **kw).bottleneck == "compute"
    assert step_time(plain, **kw).compute_s - step_time(fused, **kw).compute_s == pytest.approx(share)
    assert 0.85 * saved < share < saved
    per_layer = 7 * KERNELS_SAVED_PER_FUSED_LINEAR
    plain_k = kernels_per_micro_batch(plain, strategy="ddp", checkpointed_layers=0)
    fused_k = kernels_per_micro_batch(fused, strategy="ddp", checkpointed_layers=0)
    assert plain_k - fused_k == pytest.approx(32 * per_layer)
    assert KERNELS_SAVED_PER_FUSED_LINEAR < KERNELS_PER_ADAPTED_LINEAR


def test_the_plan_says_which_lora_layer_runs():
    from finetune.plan import plan
    from finetune.recipe import load_recipe

    raw = {"model": {"name": "x", "arch": "llama-3.1-8b"}, "data": {"path": "t.jsonl"}, "hardware": "server-8xh100"}
    assert (
        "fused LoRA layers (adapter.fused_lora) with the linears of one input as one" in plan(load_recipe(raw)).kernels
    )
    raw["adapter"] = {"type": "lora", "fused_lora": False}
    assert "peft's LoRA layers" in plan(load_recipe(raw)).kernels
    raw["distributed"] = {"strategy": "zero3"}  # ZeRO-3 gathers each submodule in its own forward: peft's path
    raw["adapter"] = {"type": "lora"}
    assert "peft's LoRA layers" in plan(load_recipe(raw)).kernels


def test_a_model_whose_passes_outweigh_its_flops_still_has_compute_time():
    # the tiny test model (hidden 64) on an H100 preset: S/C >> 1, and the fused layer keeps C^2 / (C + S) of it
    assert fused_lora_share(1.0, 0.1) == pytest.approx(1.0 * 0.1 / 1.1)
    assert 0 < 1.0 - fused_lora_share(1.0, 50.0) < 0.02
    assert fused_lora_share(1.0, 0.0) == 0.0
