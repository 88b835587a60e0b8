"""The attention a packed row's kernels execute (finetune.plan.workload.executed_attention_positions) with
the examples' lengths known (Job.example_tokens) or not."""

from __future__ import annotations

import dataclasses

import pytest

from finetune.plan.timing import step_time
from finetune.plan.workload import Job, causal_positions, executed_attention_positions
from finetune.registry import get_model
from tests.helpers.calibration_rows import preset_for

H100 = preset_for("NVIDIA H100 80GB HBM3", gpus_per_node=1)


def _job(**changes) -> Job:
    base = Job(arch=get_model("llama-3.1-8b"), preset=H100, seq_len=32768, packed=True, attention="varlen")
    return dataclasses.replace(base, **changes)


def test_varlen_rows_compute_the_examples_triangles():
    arch = get_model("llama-3.1-8b")
    assert executed_attention_positions(_job(), micro_batch=1) == pytest.approx(causal_positions(arch, 32768))
    short = executed_attention_positions(_job(example_tokens=7000), micro_batch=1)
    assert short == pytest.approx(32 * 7000 / 2)
    # examples are cut at the row: never more than the row's own triangle
    assert executed_attention_positions(_job(example_tokens=1e6), micro_batch=1) == pytest.approx(32 * 32768 / 2)
    # unpacked rows are single examples: the statistic does not apply
    assert executed_attention_positions(_job(packed=False, example_tokens=7000), micro_batch=1) == pytest.approx(
        32 * 32768 / 2
    )


def test_a_masked_kernel_still_computes_the_whole_row():
    masked = _job(attention="sdpa", example_tokens=7000)
    assert executed_attention_positions(masked, micro_batch=2) == pytest.approx(32 * 2 * 32768)


def test_short_examples_train_faster():
    slow = step_time(_job(), strategy="ddp", micro_batch=1, grad_accum=1, checkpointing=True)
    fast = step_time(_job(example_tokens=7000), strategy="ddp", micro_batch=1, grad_accum=1, checkpointing=True)
    assert fast.compute_s < 0.8 * slow.compute_s


def test_cudnn_padded_lengths_are_a_few_per_octave_and_never_shorter():
    """cuDNN builds a plan per length: an example runs at one of CUDNN_LENGTHS_PER_OCTAVE lengths a power of two, at
    most one step (1/16 of the power of two at or below it) longer than itself."""
    from finetune.kernels import CUDNN_LENGTHS_PER_OCTAVE, cudnn_padded_length

    for tokens in (4096, 4097, 5000, 8191, 8192, 28370, 65535):
        padded = cudnn_padded_length(tokens)
        step = (1 << (tokens.bit_length() - 1)) // CUDNN_LENGTHS_PER_OCTAVE
        assert tokens <= padded < tokens + step and padded % step == 0
    assert len({cudnn_padded_length(n) for n in range(8193, 16385)}) == CUDNN_LENGTHS_PER_OCTAVE


def test_long_examples_on_cudnn_are_planned_at_its_rate_where_the_card_runs_it():
    """model.cudnn_long_examples: on an H100/H200 the plan times examples of CUDNN_MIN_EXAMPLE_TOKENS or more at
    cuDNN's measured rate over their padded triangles; shorter examples, and other cards, stay on the varlen rate."""
    from finetune.kernels import CUDNN_MIN_EXAMPLE_TOKENS, card_runs_cudnn_long_examples
    from finetune.plan.attention_time import packed_attention_rate, varlen_rate

    assert card_runs_cudnn_long_examples("NVIDIA H200", "nvidia")
    assert card_runs_cudnn_long_examples("NVIDIA H100 80GB HBM3", "nvidia")
    assert not card_runs_cudnn_long_examples("NVIDIA GeForce RTX 4090", "nvidia")
    assert not card_runs_cudnn_long_examples("AMD Instinct MI300X", "amd")
    on = _job(cudnn_long_examples=True, example_tokens=28000)
    assert packed_attention_rate(on, 28000) > 1.5 * varlen_rate(128, 28000)
    short = CUDNN_MIN_EXAMPLE_TOKENS - 1
    assert packed_attention_rate(on, short) == varlen_rate(128, short)
    varlen = step_time(_job(example_tokens=28000), strategy="ddp", micro_batch=1, grad_accum=1, checkpointing=False)
    cudnn = step_time(on, strategy="ddp", micro_batch=1, grad_accum=1, checkpointing=False)
    assert cudnn.compute_s < 0.85 * varlen.compute_s


def test_the_plan_turns_it_on_for_the_varlen_kernel_on_hopper_cards_only(tmp_path):
    from finetune.plan import job_from_recipe
    from finetune.recipe import load_recipe
    from finetune.registry import get_preset

    arch = get_model("llama-3.1-8b")
    raw = {"model": {"name": "llama-3.1-8b"}, "data": {"path": "t.jsonl", "max_length": 32768, "packing": True}}
    on_h100 = job_from_recipe(load_recipe(raw), arch=arch, preset=get_preset("server-8xh100"))
    assert on_h100.attention == "varlen" and on_h100.cudnn_long_examples
    off = load_recipe({**raw, "model": {**raw["model"], "cudnn_long_examples": False}})
    assert not job_from_recipe(off, arch=arch, preset=get_preset("server-8xh100")).cudnn_long_examples
    assert not job_from_recipe(load_recipe(raw), arch=arch, preset=get_preset("workstation-1x4090")).cudnn_long_examples
    sdpa = load_recipe({**raw, "model": {**raw["model"], "attn_implementation": "sdpa"}})
    assert not job_from_recipe(sdpa, arch=arch, preset=get_preset("server-8xh100")).cudnn_long_examples


def test_the_switch_moves_the_plan_of_long_examples_in_time_and_memory():
    """model.cudnn_long_examples on a 32k LoRA recipe on one H100: faster and more memory at one pinned setting."""
    from finetune.plan import plan_on
    from finetune.recipe import load_recipe

    raw = {
        "model": {"name": "llama-3.1-8b"},
        "data": {"path": "t.jsonl", "max_length": 32768, "packing": True},
        "train": {"micro_batch_size": 1, "global_batch_size": 1, "activation_checkpointing": "on"},
    }
    plans = {}
    for on in (True, False):
        recipe = load_recipe({**raw, "model": {**raw["model"], "cudnn_long_examples": on}})
        plans[on] = plan_on(recipe, arch=get_model("llama-3.1-8b"), preset=H100, source="test")
    assert plans[True].step_time_s < 0.85 * plans[False].step_time_s
    assert plans[True].per_gpu_memory_gib > plans[False].per_gpu_memory_gib
    assert "on cuDNN's causal attention" in plans[True].kernels and "cuDNN" not in plans[False].kernels
