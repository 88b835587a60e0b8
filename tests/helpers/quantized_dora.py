"""A tiny 4-bit Llama under DoRA as a QLoRA run trains it, for the CPU and GPU tests of
finetune/train/quantized_dora.py."""

from __future__ import annotations

from pathlib import Path


def quantized_dora(folder: Path, *, ours: bool, device: str = "cpu", bits: int = 4):
    """The model (a 4- or 8-bit base) with lora dropout 0.1 and TRL's dtypes for a quantized model
    (trl/trainer/sft_trainer.py: A and B cast to bf16, DoRA's magnitude left fp32); `ours`: finetune's LoraConfig (its
    quantized-DoRA layers), else peft's own layers. The random bf16 base is written to `folder`/base once."""
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
    if bits == 4:
        quantized = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
        adapter = {"type": "qlora", "compute_dtype": "float32"}  # a CPU-valid recipe
    else:
        quantized = BitsAndBytesConfig(load_in_8bit=True)
        adapter = {"type": "lora", "load_in_8bit": True}
    adapter |= {"dora": True, "dropout": 0.1}
    model = LlamaForCausalLM.from_pretrained(
        base, dtype=torch.bfloat16, quantization_config=quantized, device_map=device
    )
    config = lora_config(load_recipe(tiny_recipe(adapter=adapter)))
    if not ours:
        config._custom_modules = None
    torch.manual_seed(1)
    peft_model = get_peft_model(model, config)
    for name, param in peft_model.named_parameters():
        if param.requires_grad and "lora_magnitude_vector" not in name:
            param.data = param.data.to(torch.bfloat16)
    return peft_model
