"""DoRA's extra saved activations, measured on a real peft model on CPU against the planner's term.

Saved-tensor hooks record every tensor autograd keeps during one decoder layer's forward; those still
alive after the forward (weak references, parameters left out) are what the backward holds. The
difference between two token counts, per token, is compared between LoRA and DoRA."""

from __future__ import annotations

import pytest

from finetune.plan.memory import dora_bytes_per_token_layer
from finetune.plan.workload import ALL_LINEAR, Job
from finetune.registry.schema import HardwarePreset, ModelArch
from tests.helpers.saved_tensors import per_token_bytes

torch = pytest.importorskip("torch")
H, INTER = 256, 640


def _model(*, dora: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    return get_peft_model(
        LlamaForCausalLM(cfg).to(torch.bfloat16),
        LoraConfig(r=16, lora_alpha=32, target_modules=list(ALL_LINEAR), use_dora=dora),
    )


def test_dora_keeps_two_compute_dtype_outputs_per_targeted_module():
    per_token = {}
    for dora in (False, True):
        per_token[dora] = per_token_bytes(lambda dora=dora: _model(dora=dora))
    measured = per_token[True] - per_token[False]
    # out_features of q, k, v, o, gate, up, down: 256 + 128 + 128 + 256 + 640 + 640 + 256 = 2304;
    # base_result and lora_result in bf16 for each: 2 x 2 B x 2304 = 9216 B per token per layer
    arch = ModelArch(
        key="t",
        family="llama",
        hidden_size=H,
        num_layers=1,
        num_attention_heads=4,
        num_kv_heads=2,
        intermediate_size=INTER,
        vocab_size=1000,
        decoder_layer_class="LlamaDecoderLayer",
    )
    preset = HardwarePreset(
        name="t",
        gpu_model="cpu",
        vendor="cpu",
        gpu_memory_gib=8,
        gpus_per_node=1,
        intra_node_bandwidth_gbps=1,
        host_ram_gib=8,
        peak_bf16_tflops=1,
    )
    planned = dora_bytes_per_token_layer(Job(arch=arch, preset=preset, dora=True))
    assert planned == 2 * 2 * 2304 == 9216
    assert measured == pytest.approx(planned, rel=0.02)
