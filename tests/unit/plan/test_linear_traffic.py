"""A step's linears run at the GEMMs' rate, with the streaming passes around them timed apart on the card's bandwidth
(plan/timing.py, linear_traffic_seconds): a narrow model moves more bytes per FLOP than a wide one, so its effective
rate is lower; a full fine-tune's weight gradients are GEMMs with no pass of their own; a CPU keeps its blended rate."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune.plan.bandwidth import memory_seconds
from finetune.plan.timing import (
    LINEAR_TRAFFIC_PASSES,
    efficiency,
    linear_flops_per_token,
    linear_traffic_seconds,
)
from finetune.plan.workload import computed_tokens_per_micro_batch, expert_size, linear_features_per_token
from finetune.registry import get_model, get_preset
from finetune.registry.derive import arch_from_config
from tests.helpers.paths import ROOT
from tests.helpers.recipes import shape_job

H100 = get_preset("server-8xh100").model_copy(update={"gpus_per_node": 1})


def _job(model: str = "llama-3.1-8b", adapter: str = "lora", *, preset=H100, **sections):
    return shape_job(model, adapter, preset, global_batch=8, train__micro_batch_size=2, **sections)


def test_the_features_are_every_linear_s_inputs_and_outputs():
    arch = get_model("llama-3.1-8b")
    h, i, kv = arch.hidden_size, arch.intermediate_size, arch.num_kv_heads * 128
    layer = (h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h)  # q, k, v, o, gate, up, down
    assert linear_features_per_token(arch) == arch.num_layers * layer + h + arch.vocab_size


def test_routed_experts_count_as_a_dense_mlp_of_their_active_width():
    arch = arch_from_config(ROOT / "tests/data/hub_configs/olmoe-1b-7b/config.json", key="olmoe")
    dense = arch.model_copy(update={"num_experts": 0, "experts_per_token": 0, "moe_layers": 0})
    h, width = arch.hidden_size, arch.experts_per_token * expert_size(arch)
    attention = linear_features_per_token(dense) - arch.num_layers * (3 * (h + arch.intermediate_size))
    routed = arch.num_layers * ((h + 2 * width) + (width + h))
    assert linear_features_per_token(arch) == pytest.approx(attention + routed)


def test_the_passes_are_the_forwards_and_the_input_gradient():
    job = _job()
    tokens = computed_tokens_per_micro_batch(job, 2)
    one_pass = memory_seconds(job.preset, LINEAR_TRAFFIC_PASSES * linear_features_per_token(job.arch) * tokens * 2)
    assert linear_traffic_seconds(job, micro_batch=2) == pytest.approx(2 * one_pass)
    assert linear_traffic_seconds(job, micro_batch=2, checkpointed_share=0.5) == pytest.approx(2.5 * one_pass)
    # a full fine-tune's weight gradients add GEMM FLOPs, not passes
    assert linear_traffic_seconds(_job(adapter="full"), micro_batch=2) == pytest.approx(2 * one_pass)
    # DPO's reference forward is one more forward
    dpo = _job(method__type="dpo", data__format="preference")
    assert dpo.forward_only_passes == 1
    dpo_tokens = computed_tokens_per_micro_batch(dpo, 2)
    assert linear_traffic_seconds(dpo, micro_batch=2) == pytest.approx(3 * one_pass * dpo_tokens / tokens)
    assert linear_traffic_seconds(_job(preset=get_preset("cpu")), micro_batch=2) == 0.0


def _linear_rate(model: str) -> float:
    """The share of the peak a model's linears reach in a LoRA micro-batch, their streaming passes included."""
    job = _job(model)
    tokens = computed_tokens_per_micro_batch(job, 2)
    linear = linear_flops_per_token(job, checkpointing=False)
    seconds = linear * tokens / (job.peak_tflops * 1e12 * efficiency(job, micro_batch=2))
    seconds += linear_traffic_seconds(job, micro_batch=2)
    return linear * tokens / seconds / (job.peak_tflops * 1e12)


def test_a_narrow_model_runs_its_linears_at_a_lower_rate_than_a_wide_one():
    small, mid, large = _linear_rate("llama-3.2-1b"), _linear_rate("llama-3.1-8b"), _linear_rate("llama-3.1-70b")
    assert small < mid < large < efficiency(_job("llama-3.1-70b"), micro_batch=2)
    # the 8B LoRA step's blended rate of the earlier single-constant model (0.45 of the peak), within a tenth
    assert mid == pytest.approx(0.45, rel=0.1)


def test_a_card_with_less_bandwidth_per_flop_spends_more_of_the_step_streaming():
    job = _job()
    slower = replace(job, preset=H100.model_copy(update={"gpu_memory_bandwidth_gbps": 2000}))
    assert linear_traffic_seconds(slower, micro_batch=2) > linear_traffic_seconds(job, micro_batch=2)
