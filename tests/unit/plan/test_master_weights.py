"""fp32 master weights of a full fine-tune. DDP steps the weights in the dtype they were loaded in; the sharded
strategies (FSDP2 through accelerate, DeepSpeed) step fp32 masters. On GPUs, full fine-tunes under DDP lost
far less loss in 12 steps than the same recipes under ZeRO-2/3 (docs/validation.md, fourth session: 12.56 ->
9.65 against 12.56 -> 6.04 for 8B). The mechanism is rounding, shown here with torch's own AdamW; the planner
then keeps DDP out of its automatic choice for such a run and warns where it runs anyway."""

from __future__ import annotations

import pytest
import torch

from finetune.plan import job_from_recipe, plan_on
from finetune.plan.memory import steps_16bit_weights
from finetune.recipe import load_recipe
from finetune.registry import get_model
from tests.helpers.calibration_rows import preset_for
from tests.helpers.paths import ROOT

H200 = "NVIDIA H200"
ARCH = get_model("llama-3.1-8b")


def _changed_share(dtype: torch.dtype, lr: float) -> float:
    """The share of weights (std 0.02, as initialized and typical of trained linear layers) one AdamW step
    changes, stepping them in `dtype`."""
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(512, 512, generator=gen) * 0.02).to(dtype).requires_grad_()
    before = w.detach().clone()
    w.grad = torch.randn(512, 512, generator=gen).to(dtype)
    torch.optim.AdamW([w], lr=lr, weight_decay=0.0).step()
    return (w.detach() != before).float().mean().item()


def test_adamw_on_bf16_weights_loses_most_updates_at_a_full_fine_tune_learning_rate():
    # Adam's first step moves every weight by ~lr; a bf16 weight of 0.02 has a step of 2**-13 ~ 1.2e-4, so an
    # update of 1e-5 rounds away unless the weight is small
    assert _changed_share(torch.bfloat16, 1e-5) < 0.25
    assert _changed_share(torch.bfloat16, 1e-4) > 0.75  # larger steps survive more often
    assert _changed_share(torch.float32, 1e-5) > 0.99  # an fp32 master takes every update


def _plan(*sets: str, gpus: int = 2):
    recipe = load_recipe(
        ROOT / "recipes" / "llama8b-full.yaml",
        overrides=["data.max_length=4096", "train.global_batch_size=16", *sets],
    )
    preset = preset_for(H200, gpus_per_node=gpus)
    return plan_on(recipe, arch=ARCH, preset=preset, source="auto"), job_from_recipe(recipe, arch=ARCH, preset=preset)


def test_the_planner_does_not_choose_ddp_for_a_16bit_full_fine_tune_on_several_gpus():
    # full 8B at seq 4096 on 2 x H200: ddp fits (the session's row 73 ran it at 62.9% MFU, and learned least)
    p, job = _plan()
    assert "ddp" not in {c.strategy for c in p.candidates}
    assert "ddp is not considered: it keeps no fp32 master weights" in p.why
    assert p.fits and p.strategy != "ddp" and not steps_16bit_weights(job, p.strategy), p.why
    assert not any("master" in w for w in p.warnings)


def test_a_pinned_ddp_is_planned_and_warned_about():
    p, _ = _plan("distributed.strategy=ddp")
    assert p.fits and p.strategy == "ddp"
    (warning,) = [w for w in p.warnings if "master" in w]
    assert "bfloat16 weights" in warning and "distributed.strategy: zero2" in warning


@pytest.mark.parametrize(
    "sets",
    [
        ["adapter.type=lora"],  # an adapter is fp32 in peft
        ["model.dtype=float32"],  # the optimizer steps fp32 weights; compute is bf16 under autocast
    ],
)
def test_no_warning_where_the_optimizer_steps_fp32(sets):
    p, job = _plan("distributed.strategy=ddp", *sets)
    assert not steps_16bit_weights(job, "ddp")
    assert not any("master" in w for w in p.warnings)


def test_one_gpu_chooses_zero2_for_fp32_masters_and_a_pinned_ddp_names_both_ways():
    # a 1B full fine-tune on one card. On one H200 (docs/validation.md, fifth session) full 3B trained 12 steps
    # to loss 9.5 under ddp on bf16 weights, 6.2 under zero2 and 6.1 with fp32 weights: zero2 is chosen
    base = ["model.name=meta-llama/Llama-3.2-1B", "train.global_batch_size=16"]
    arch, one = get_model("llama-3.2-1b"), preset_for(H200, gpus_per_node=1)
    recipe = load_recipe(ROOT / "recipes" / "llama8b-full.yaml", overrides=base)
    p = plan_on(recipe, arch=arch, preset=one, source="auto")
    assert p.fits and p.strategy == "zero2", p.why
    assert "ddp" not in {c.strategy for c in p.candidates}
    assert "ddp is not considered: it keeps no fp32 master weights" in p.why
    assert "pin distributed.strategy: ddp" in p.why
    assert not any("master" in w for w in p.warnings)
    # other sharding tiers still have nothing to shard on one GPU
    assert not {"zero3", "fsdp2"} & {c.strategy for c in p.candidates}
    # fp32 weights need no masters: ddp is considered again
    fp32 = load_recipe(ROOT / "recipes" / "llama8b-full.yaml", overrides=[*base, "model.dtype=float32"])
    assert plan_on(fp32, arch=arch, preset=one, source="auto").strategy == "ddp"
    pinned = load_recipe(ROOT / "recipes" / "llama8b-full.yaml", overrides=[*base, "distributed.strategy=ddp"])
    p = plan_on(pinned, arch=arch, preset=one, source="auto")
    assert p.fits and p.strategy == "ddp"
    (warning,) = [w for w in p.warnings if "master" in w]
    assert "model.dtype: float32" in warning and "distributed.strategy: zero2" in warning


def test_fp32_weights_under_bf16_autocast_are_planned_with_autocast_s_weight_copies():
    # the one-GPU way to masters: each matmul's bf16 copy of its fp32 weight is kept for the backward
    from finetune.plan.memory import autocast_weight_copies
    from finetune.plan.workload import count_params

    arch = get_model("llama-3.2-1b")
    one = preset_for(H200, gpus_per_node=1)
    base = ["model.name=meta-llama/Llama-3.2-1B", "train.global_batch_size=16", "train.micro_batch_size=4"]
    plans = {}
    for dtype in ("bfloat16", "float32"):
        recipe = load_recipe(ROOT / "recipes" / "llama8b-full.yaml", overrides=[*base, f"model.dtype={dtype}"])
        plans[dtype] = (
            plan_on(recipe, arch=arch, preset=one, source="auto"),
            job_from_recipe(recipe, arch=arch, preset=one),
        )
    (bf16, _), (fp32, job) = plans["bfloat16"], plans["float32"]
    n = count_params(arch)
    copies = 2 * (n.layers_linear + arch.vocab_size * arch.hidden_size)  # no layer checkpointed at this setting
    assert fp32.checkpoint_layers == 0
    assert autocast_weight_copies(job, strategy="ddp", checkpointing=0) == copies
    # the weights column: fp32 weights (4 bytes a parameter instead of 2) plus the copies
    assert fp32.memory.weights - bf16.memory.weights == pytest.approx(2 * n.total + copies)
    # checkpointing every layer but one leaves that layer's copies and the lm_head's
    assert (
        autocast_weight_copies(job, strategy="ddp", checkpointing=arch.num_layers)
        == 2 * arch.vocab_size * arch.hidden_size
    )
    assert autocast_weight_copies(job, strategy="zero2", checkpointing=0) == 0.0


def test_ddp_warns_that_it_trains_peft_s_modules_to_save_copies_in_bf16():
    # peft copies modules_to_save in the model's dtype (only the LoRA weights are upcast to fp32)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ROOT / "data" / "tiny-llama", dtype=torch.bfloat16)
    config = LoraConfig(r=4, target_modules="all-linear", modules_to_save=["lm_head"], task_type="CAUSAL_LM")
    trained = {n: p.dtype for n, p in get_peft_model(model, config).named_parameters() if p.requires_grad}
    assert {d for n, d in trained.items() if "modules_to_save" in n} == {torch.bfloat16}
    assert {d for n, d in trained.items() if "lora_" in n} == {torch.float32}

    lora = ["adapter.type=lora", "adapter.modules_to_save=[lm_head]"]
    p, _ = _plan("distributed.strategy=ddp", *lora)
    (warning,) = [w for w in p.warnings if "master" in w]
    assert "modules_to_save copies (lm_head) in bfloat16" in warning
    fsdp, _ = _plan("distributed.strategy=fsdp2", *lora)
    assert fsdp.fits and not any("master" in w for w in fsdp.warnings)
