"""A run that computes in float32 on a GPU (train.precision: fp32 with float32 weights): its matmuls run at the
card's FP32 rate (PyTorch leaves TF32 off), not the bf16 tensor-core peak, and finetune's varlen attention,
a 16-bit kernel, is not planned for it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune.errors import RecipeError
from finetune.plan import job_from_recipe
from finetune.plan.timing import step_time
from finetune.recipe import load_recipe
from finetune.recipe.schema import compute_dtype
from finetune.registry import get_model, get_preset
from finetune.registry.schema import FP32_SHARE_ASSUMED

H100 = get_preset("server-8xh100").model_copy(update={"gpus_per_node": 1})


def _recipe(*, dtype: str, precision: str, attn: str = "auto", adapter: str = "lora"):
    return load_recipe(
        {
            "model": {"name": "llama-3.1-8b", "arch": "llama-3.1-8b", "dtype": dtype, "attn_implementation": attn},
            "adapter": {"type": adapter},
            "data": {"path": "t.jsonl", "packing": True},
            "train": {"precision": precision, "global_batch_size": 8, "micro_batch_size": 2, "max_steps": 10},
            "hardware": "auto",
        }
    )


def test_the_compute_dtype_is_autocasts_else_the_weights():
    assert compute_dtype(_recipe(dtype="float32", precision="bf16")) == "bfloat16"  # fp32 masters, bf16 matmuls
    assert compute_dtype(_recipe(dtype="bfloat16", precision="fp32")) == "bfloat16"  # no autocast, bf16 weights
    assert compute_dtype(_recipe(dtype="float32", precision="fp32")) == "float32"


def test_fp32_matmuls_run_at_the_cards_fp32_rate():
    arch = get_model("llama-3.1-8b")
    fp32 = job_from_recipe(_recipe(dtype="float32", precision="fp32"), arch=arch, preset=H100)
    mixed = job_from_recipe(_recipe(dtype="float32", precision="bf16"), arch=arch, preset=H100)
    assert (fp32.act_bytes, mixed.act_bytes) == (4, 2)
    assert fp32.peak_tflops == H100.peak_fp32_tflops == 67 and mixed.peak_tflops == H100.peak_bf16_tflops
    # the same attention for both, so only the rate (and the activations' size) differs
    same = replace(fp32, attention=mixed.attention, varlen_layers=mixed.varlen_layers)
    slow = step_time(same, strategy="ddp", micro_batch=2, grad_accum=4, checkpointing=False)
    fast = step_time(mixed, strategy="ddp", micro_batch=2, grad_accum=4, checkpointing=False)
    # 989 x 0.45 against 67 x FP32_GPU_EFFICIENCY (0.80): 8.3x, a little less with fp32's larger passes' share
    assert slow.compute_s > 7 * fast.compute_s
    # a preset that does not say: the bf16 peak over FP32_SHARE_ASSUMED, never the bf16 peak itself
    bare = H100.model_copy(update={"peak_fp32_tflops": None})
    assert bare.compute_peak_tflops(fp32=True) == pytest.approx(H100.peak_bf16_tflops / FP32_SHARE_ASSUMED)
    cpu = get_preset("cpu")  # a CPU's peak is its fp32 vector rate already
    assert cpu.compute_peak_tflops(fp32=True) == cpu.peak_bf16_tflops


def test_fp32_compute_plans_sdpa_and_refuses_varlen():
    arch = get_model("llama-3.1-8b")
    assert job_from_recipe(_recipe(dtype="float32", precision="fp32"), arch=arch, preset=H100).attention == "sdpa"
    assert job_from_recipe(_recipe(dtype="bfloat16", precision="fp32"), arch=arch, preset=H100).attention == "varlen"
    with pytest.raises(RecipeError) as refused:
        job_from_recipe(_recipe(dtype="float32", precision="fp32", attn="varlen"), arch=arch, preset=H100)
    assert refused.value.key == "model.attn_implementation" and "float32" in str(refused.value)


def test_a_detected_card_borrows_its_presets_fp32_rate():
    from finetune.registry.detect import parse_nvidia_smi, synthesize_preset

    detected = synthesize_preset(parse_nvidia_smi("NVIDIA H100 80GB HBM3, 81559 MiB"), ram_gib=1024)
    assert detected.peak_fp32_tflops == H100.peak_fp32_tflops
    unknown = synthesize_preset(parse_nvidia_smi("Some Future GPU, 81559 MiB"), ram_gib=1024)
    assert unknown.peak_fp32_tflops is None  # the bf16 peak over FP32_SHARE_ASSUMED: slow, never optimistic


def test_the_plan_warns_that_fp32_compute_runs_at_the_fp32_rate():
    from finetune.plan import plan_on

    arch = get_model("llama-3.1-8b")
    fp32 = plan_on(_recipe(dtype="float32", precision="fp32"), arch=arch, preset=H100, source="test")
    (warning,) = [w for w in fp32.warnings if "float32" in w]
    assert "67 TFLOP/s" in warning and "train.precision: bf16" in warning
    mixed = plan_on(_recipe(dtype="float32", precision="bf16"), arch=arch, preset=H100, source="test")
    assert not [w for w in mixed.warnings if "computes in float32" in w]


def test_peft_s_input_casts_follow_autocast_not_the_compute_width():
    """fp32 precision with bfloat16 weights computes in 16 bits but runs no autocast: peft's cast of each input
    to its fp32 adapters is then what makes the adapter's matmul run, so finetune keeps it (train/model.py asks
    the same rule with the same input)."""
    from finetune.plan.memory import peft_casts_adapter_inputs

    arch = get_model("llama-3.1-8b")
    plain = job_from_recipe(_recipe(dtype="bfloat16", precision="fp32"), arch=arch, preset=H100)
    mixed = job_from_recipe(_recipe(dtype="bfloat16", precision="bf16"), arch=arch, preset=H100)
    assert (plain.act_bytes, plain.autocast, mixed.autocast) == (2, False, True)
    assert not peft_casts_adapter_inputs(adapter="lora", strategy="ddp", autocast=plain.autocast)
    assert peft_casts_adapter_inputs(adapter="lora", strategy="ddp", autocast=mixed.autocast)
