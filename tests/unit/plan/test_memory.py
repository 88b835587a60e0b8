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


def test_a_cross_entropy_over_the_chosen_logits_is_planned():
    """ORPO's SFT term and SimPO's cpo_alpha > 0: TRL copies the chosen half's logits (shifted, contiguous) and
    keeps the loss's log-softmax, on top of the full logits every non-fused preference trainer holds."""
    from finetune.plan import job_from_recipe
    from finetune.plan.memory import LOGITS_BYTES_PER_ELEMENT, NLL_BYTES_PER_ELEMENT, logits_bytes
    from finetune.recipe import load_recipe
    from finetune.registry import get_model, get_preset

    def job(method: dict):
        raw = {"model": {"name": "llama-3.1-8b", "arch": "llama-3.1-8b"}, "method": method}
        raw["data"] = {"path": "t.jsonl", "format": "preference"}
        recipe = load_recipe(raw)
        return job_from_recipe(recipe, arch=get_model("llama-3.1-8b"), preset=get_preset("server-8xh100"))

    plain = logits_bytes(job({"type": "simpo", "cpo_alpha": 0.0}), micro_batch=2)
    for method in ({"type": "simpo", "cpo_alpha": 1.0}, {"type": "orpo"}):
        with_nll = logits_bytes(job(method), micro_batch=2)
        assert with_nll / plain == pytest.approx(1 + NLL_BYTES_PER_ELEMENT / 2 / LOGITS_BYTES_PER_ELEMENT)
