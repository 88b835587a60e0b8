"""The final save's host RAM (plan/memory.py final_save_host_bytes): under FSDP2 rank 0 gathers a full fine-tune's
fp32 masters and casts them to model.dtype beside them, or an adapter's whole base where peft writes frozen weights;
the planner counts it in the node's host peak and refuses a strategy whose save the host cannot hold. The measured
side is test_calibration.py's final-save rows."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune.plan import plan_on
from finetune.plan.choose import evaluate
from finetune.plan.memory import final_save_host_bytes
from finetune.plan.types import GIB
from finetune.plan.workload import count_params
from finetune.recipe import load_recipe
from finetune.registry import get_model, get_preset
from tests.helpers.paths import ROOT
from tests.helpers.recipes import shape_job

SERVER = get_preset("server-8xh100")


def _job(adapter: str = "full", preset=SERVER, **sections):
    return shape_job("llama-3.1-8b", adapter, preset, global_batch=16, **sections)


def test_a_full_fine_tune_s_save_under_fsdp2_holds_its_fp32_masters_and_their_cast():
    job = _job()
    params = count_params(job.arch).text_model
    assert final_save_host_bytes(job, strategy="fsdp2") == pytest.approx(params * (4 + 2))
    # a model trained in fp32 is saved as its masters are: nothing to cast
    fp32 = replace(job, weight_bytes=4)
    assert final_save_host_bytes(fp32, strategy="fsdp2") == pytest.approx(params * 4)
    # a run that saved the masters uncast (before train/saved_dtype.py) held them alone
    assert final_save_host_bytes(replace(job, final_save_casts=False), strategy="fsdp2") == pytest.approx(params * 4)


def test_only_fsdp_gathers_and_only_a_run_that_saves():
    job = _job()
    assert final_save_host_bytes(job, strategy="ddp") == 0.0
    assert final_save_host_bytes(job, strategy="zero3") == 0.0
    assert final_save_host_bytes(replace(job, final_save=False), strategy="fsdp2") == 0.0  # plan --measure


def test_an_adapter_gathers_the_whole_base_only_where_peft_writes_frozen_weights():
    lora = _job("lora")
    assert not lora.save_gathers_model
    assert final_save_host_bytes(lora, strategy="fsdp2") == 0.0
    on_embeddings = _job("lora", adapter__target_modules=["q_proj", "v_proj", "embed_tokens"])
    assert on_embeddings.save_gathers_model
    params = count_params(on_embeddings.arch).text_model
    assert final_save_host_bytes(on_embeddings, strategy="fsdp2") == pytest.approx(params * 2)


def test_a_host_that_cannot_hold_the_save_refuses_fsdp2_and_says_why():
    roomy = _job()
    small = replace(roomy, preset=SERVER.model_copy(update={"host_ram_gib": 80}))
    fits = evaluate(roomy, strategy="fsdp2", micro_batch=1, checkpointing=True)
    refused = evaluate(small, strategy="fsdp2", micro_batch=1, checkpointing=True)
    assert fits.fits
    # 8 ranks' processes (40 GiB) and 8B's masters with their bf16 cast (45 GiB) against 90% of 80 GiB
    assert fits.host_ram_bytes == pytest.approx(8 * 5 * GIB + count_params(roomy.arch).text_model * 6, rel=0.02)
    assert not refused.fits
    assert "host RAM per node at the final save, where rank 0 gathers the whole model" in refused.reason
    # the same host trains it under ZeRO-3, whose save gathers no more than its load
    assert evaluate(small, strategy="zero3", micro_batch=1, checkpointing=True).fits


def test_the_plan_says_when_the_final_save_sets_the_host_peak():
    recipe = load_recipe(ROOT / "recipes" / "llama8b-full.yaml")
    plan = plan_on(recipe, arch=get_model("llama-3.1-8b"), preset=SERVER, source="test")
    assert plan.strategy == "fsdp2"
    assert "GiB host RAM per node at the final save, where rank 0 gathers the whole model" in plan.why
    lora = load_recipe(ROOT / "recipes" / "llama8b-lora.yaml")
    assert "at the final save" not in plan_on(lora, arch=get_model("llama-3.1-8b"), preset=SERVER, source="test").why
