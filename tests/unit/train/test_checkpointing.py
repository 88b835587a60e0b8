"""Per-layer activation checkpointing (k of L layers): the planner chooses 0 < k < L for a tight fit,
the compiler records k, and on a rank transformers' Trainer recomputes exactly the first k layers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune.plan import job_from_recipe, plan_job
from finetune.plan.memory import activation_bytes, activation_bytes_per_token_layer
from finetune.recipe import load_recipe
from finetune.registry import get_model, get_preset


def _job(**train):
    raw = {
        "model": {"name": "llama-3.1-8b", "arch": "llama-3.1-8b"},
        "adapter": {"type": "lora"},
        "data": {"path": "t.jsonl", "max_length": 2048},
        "train": {"global_batch_size": 8, "liger": "off", **train},
        "hardware": "workstation-1x4090",
    }
    recipe = load_recipe(raw)
    return job_from_recipe(recipe, arch=get_model("llama-3.1-8b"), preset=get_preset("workstation-1x4090"))


def test_activation_bytes_for_k_of_l_layers():
    job = _job()
    tokens, h, a = 2048, 4096, 2  # 32 layers
    per_layer = activation_bytes_per_token_layer(job, micro_batch=1) * tokens  # sdpa, one row: no mask
    edges = 4 * a * h * tokens
    # k = 10: 22 layers keep everything, 10 keep only their bf16 input: 22 x layer + 10 x 2 x 4096 x 2048
    assert activation_bytes(job, micro_batch=1, checkpointing=10) == pytest.approx(
        22 * per_layer + 10 * a * h * tokens + edges
    )
    # every layer: 32 inputs plus one layer recomputed at a time; k = 31 keeps one layer whole and no
    # recompute overlaps it, so it needs one input less than k = 32
    all_layers = activation_bytes(job, micro_batch=1, checkpointing=True)
    assert all_layers == pytest.approx(32 * a * h * tokens + per_layer + edges)
    assert all_layers - activation_bytes(job, micro_batch=1, checkpointing=31) == pytest.approx(a * h * tokens)


def test_a_tight_fit_checkpoints_some_layers_and_spends_the_memory():
    job = _job(micro_batch_size=1)
    plan = plan_job(job)
    assert plan.fits and 0 < plan.checkpoint_layers < 32, plan.why
    # one layer fewer would not fit: the planner took the least checkpointing that fits
    tighter = plan_job(replace(job, checkpointing="auto"))
    assert tighter.checkpoint_layers == plan.checkpoint_layers
    from finetune.plan.choose import evaluate

    fewer = evaluate(job, strategy=plan.strategy, micro_batch=1, checkpointing=plan.checkpoint_layers - 1)
    assert not fewer.fits
    assert f"on {plan.checkpoint_layers} of 32 layers" in plan.why


def test_compile_records_k_and_hands_checkpointing_to_the_trainer(tmp_path):
    from finetune.compile import compile_run

    raw = {
        "model": {"name": "meta-llama/Llama-3.1-8B", "arch": "llama-3.1-8b"},
        "adapter": {"type": "lora"},
        "data": {"path": "t.jsonl", "max_length": 2048},
        "train": {"global_batch_size": 8, "micro_batch_size": 1, "liger": "off"},
        "hardware": "workstation-1x4090",
    }
    recipe = load_recipe(raw)
    plan = plan_job(job_from_recipe(recipe, arch=get_model("llama-3.1-8b"), preset=get_preset("workstation-1x4090")))
    compile_run(
        recipe, plan, run_dir=tmp_path / "run", arch=get_model("llama-3.1-8b"), preset=get_preset("workstation-1x4090")
    )
    import yaml

    resolved = yaml.safe_load((tmp_path / "run" / "recipe.resolved.yaml").read_text())
    assert resolved["train"]["activation_checkpointing"] == "on"
    assert resolved["resolved"]["checkpoint_layers"] == plan.checkpoint_layers
    assert resolved["resolved"]["activation_checkpointing_by"] == "trainer"


@pytest.mark.slow
def test_trainer_recomputes_exactly_the_first_k_layers(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from finetune.train.checkpointing import PartialCheckpointing, decoder_layers
    from finetune.train.trainers import _checkpointing_args

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    calls = [0] * 4
    # transformers checkpoints the layer's forward, not its __call__ (module hooks stay outside the
    # recompute), and torch stops a recompute once the saved tensors are back; so count the start of the
    # attention inside each layer: it runs again when its layer is recomputed
    for i, layer in enumerate(decoder_layers(model)):
        layer.self_attn.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    ids = torch.randint(0, 64, (8,)).tolist()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=1,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        **_checkpointing_args(True),
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=[{"input_ids": ids, "labels": ids}], callbacks=[PartialCheckpointing(2)]
    )
    trainer.train()
    # one forward each; the first two run again when the backward recomputes them
    assert calls == [2, 2, 1, 1]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dpo", "kto", "dpo-lora"])
def test_the_first_k_layers_stay_checkpointed_through_the_reference_passes(method, tmp_path):
    """TRL's DPO and KTO reference passes turn checkpointing off and on again around themselves, which sets it on
    every layer: the policy's later forwards still checkpoint only the first k (a full fine-tune, whose reference is
    a copy, and a LoRA one, whose reference is the policy with its adapter off)."""
    torch = pytest.importorskip("torch")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

    from finetune.train.checkpointing import PartialCheckpointing, decoder_layers
    from finetune.train.trainers import _checkpointing_args
    from tests.helpers.paths import TINY_MODEL

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, dtype=torch.float32)
    decoder = model.model
    if method == "dpo-lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    layers = decoder_layers(model)
    assert len(layers) == 2
    flags: list[list[bool]] = []  # each policy forward that records gradients: the layers' flags as the decoder starts
    decoder.register_forward_pre_hook(
        lambda module, args: (
            flags.append([layer.gradient_checkpointing for layer in layers]) if torch.is_grad_enabled() else None
        )
    )
    config_class, trainer_class = (KTOConfig, KTOTrainer) if method == "kto" else (DPOConfig, DPOTrainer)
    args = config_class(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        **_checkpointing_args(True),
    )
    if method != "kto":
        rows = [{"prompt": "abc", "chosen": "ABC", "rejected": "cba"}] * 8
    else:
        rows = [
            {"prompt": "abc", "completion": "ABC", "label": True},
            {"prompt": "abc", "completion": "cba", "label": False},
        ] * 4
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(TINY_MODEL),
        callbacks=[PartialCheckpointing(1)],
    )
    trainer.train()
    assert (trainer.ref_model is None) == (method == "dpo-lora")
    assert len(flags) >= 3 and all(f == [True, False] for f in flags), flags
    assert not trainer.model._forward_pre_hooks or all(  # the callback's hook is gone once training ends
        getattr(h, "__name__", "") != "before" for h in trainer.model._forward_pre_hooks.values()
    )
