"""A full fine-tune's weight gradients are planned at the GEMM rate (plan/timing.py, WEIGHT_GRADIENT_GEMM_EFFICIENCY),
not at the step's blended rate: they are bare GEMMs, with none of the norms, adds and activation passes that the
forward and input-gradient FLOPs carry. LoRA's frozen base has none, a CPU and float32 compute keep their own rates,
and a mixture of experts' routed weight gradients stay with the grouped-GEMM rate of plan/moe_time.py."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from finetune.plan.moe_time import routed_active_params
from finetune.plan.timing import (
    GPU_EFFICIENCY,
    MICRO_BATCH_HALF_TOKENS,
    WEIGHT_GRADIENT_GEMM_EFFICIENCY,
    step_time,
    weight_gradient_flops_per_token,
    weight_gradient_seconds_saved,
)
from finetune.plan.workload import computed_tokens_per_micro_batch, count_params
from finetune.registry import get_preset
from finetune.registry.derive import arch_from_config
from tests.helpers.paths import ROOT
from tests.helpers.recipes import shape_job

H100 = get_preset("server-8xh100").model_copy(update={"gpus_per_node": 1})


def _job(adapter: str, *, preset=H100, **sections):
    return shape_job("llama-3.1-8b", adapter, preset, global_batch=8, train__micro_batch_size=2, **sections)


def test_only_a_full_fine_tune_has_weight_gradients_at_the_gemm_rate():
    full, lora = _job("full"), _job("lora")
    assert weight_gradient_flops_per_token(full) == 2 * count_params(full.arch).matmul_active
    assert weight_gradient_flops_per_token(lora) == 0.0
    assert weight_gradient_seconds_saved(lora, micro_batch=2, flop_seconds=1e-15) == 0.0
    cpu = _job("full", preset=get_preset("cpu"))
    assert weight_gradient_seconds_saved(cpu, micro_batch=2, flop_seconds=1e-12) == 0.0
    fp32 = _job("full", model__dtype="float32", train__precision="fp32")
    assert fp32.computes_fp32 and weight_gradient_seconds_saved(fp32, micro_batch=2, flop_seconds=1e-12) == 0.0


def test_the_saving_is_the_weight_gradients_time_at_the_two_rates(monkeypatch):
    job = _job("full")
    tokens = computed_tokens_per_micro_batch(job, 2)
    scale = tokens / (tokens + MICRO_BATCH_HALF_TOKENS)
    step_rate = 1 / (job.peak_tflops * 1e12 * GPU_EFFICIENCY * scale)
    gemm_rate = 1 / (job.peak_tflops * 1e12 * WEIGHT_GRADIENT_GEMM_EFFICIENCY * scale)
    flops = weight_gradient_flops_per_token(job) * tokens
    saved = weight_gradient_seconds_saved(job, micro_batch=2, flop_seconds=step_rate)
    assert saved == pytest.approx(flops * (step_rate - gemm_rate))
    # the step's compute falls by exactly that, a micro-batch at a time
    timed = step_time(job, strategy="ddp", micro_batch=2, grad_accum=4, checkpointing=False)
    monkeypatch.setattr(sys.modules[step_time.__module__], "WEIGHT_GRADIENT_GEMM_EFFICIENCY", GPU_EFFICIENCY)
    blended = step_time(job, strategy="ddp", micro_batch=2, grad_accum=4, checkpointing=False)
    assert blended.compute_s - timed.compute_s == pytest.approx(4 * saved)
    # 6N at 0.45 against 4N at 0.45 + 2N at 0.75: a full 8B step's dense FLOPs take about 13% less time
    n_time_before = 6 / GPU_EFFICIENCY
    n_time_after = 4 / GPU_EFFICIENCY + 2 / WEIGHT_GRADIENT_GEMM_EFFICIENCY
    assert 0.85 < n_time_after / n_time_before < 0.9


def test_routed_experts_keep_the_grouped_gemm_rate():
    arch = arch_from_config(ROOT / "tests/data/hub_configs/olmoe-1b-7b/config.json", key="olmoe")
    job = replace(_job("full"), arch=arch)
    dense = count_params(arch).matmul_active - routed_active_params(arch)
    assert routed_active_params(arch) > 0
    assert weight_gradient_flops_per_token(job) == 2 * dense
