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
