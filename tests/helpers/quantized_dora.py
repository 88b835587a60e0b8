"""A tiny 4-bit Llama under DoRA as a QLoRA run trains it, for the CPU and GPU tests of
finetune/train/quantized_dora.py."""

from __future__ import annotations

from pathlib import Path


def quantized_dora(folder: Path, *, ours: bool, device: str = "cpu"):
    """The model with lora dropout 0.1 and TRL's QLoRA dtypes (trl/trainer/sft_trainer.py: A and B cast to bf16, DoRA's
    magnitude left fp32); `ours`: finetune's LoraConfig (its quantized-DoRA layers), else peft's own layers. The
    random bf16 base is written to `folder`/base once."""
    import torch
    from peft import get_peft_model
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    from finetune.recipe import load_recipe
    from finetune.train.model import lora_config
    from tests.helpers.recipes import tiny_recipe

    base = folder / "base"
    if not base.exists():
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(base)
    quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
    model = LlamaForCausalLM.from_pretrained(
        base, dtype=torch.bfloat16, quantization_config=quantized, device_map=device
    )
    adapter = {"type": "qlora", "dora": True, "dropout": 0.1, "compute_dtype": "float32"}  # a CPU-valid recipe
    config = lora_config(load_recipe(tiny_recipe(adapter=adapter)))
    if not ours:
        config._custom_modules = None
    torch.manual_seed(1)
    peft_model = get_peft_model(model, config)
    for name, param in peft_model.named_parameters():
        if param.requires_grad and "lora_magnitude_vector" not in name:
            param.data = param.data.to(torch.bfloat16)
    return peft_model
