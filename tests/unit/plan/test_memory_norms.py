"""Per-head q/k RMSNorms (Qwen3, Gemma-3) and Gemma's four norms per layer in the activation model.

The q/k norm term is checked against real transformers decoder layers on CPU (tests/helpers/saved_tensors.py):
a Qwen3 and a Llama LoRA layer of the same shape differ only by q_norm and k_norm, so the difference of
what autograd keeps per token is the planner's term."""

from __future__ import annotations

import json

import pytest

from finetune.plan.memory import activation_bytes_per_token_layer
from finetune.plan.workload import ALL_LINEAR, Job
from finetune.registry import get_model
from finetune.registry.derive import arch_from_config
from finetune.registry.schema import HardwarePreset, ModelArch
from tests.helpers.saved_tensors import per_token_bytes

H, INTER, HEADS, KV, HEAD_DIM = 256, 640, 4, 2, 64
PRESET = HardwarePreset(
    name="t", gpu_model="cpu", vendor="cpu", gpu_memory_gib=8, gpus_per_node=1, intra_node_bandwidth_gbps=1,
    host_ram_gib=8, peak_bf16_tflops=1,
)  # fmt: skip


def _arch(**extra) -> ModelArch:
    return ModelArch(
        key="t",
        family="qwen3",
        hidden_size=H,
        num_layers=1,
        num_attention_heads=HEADS,
        num_kv_heads=KV,
        head_dim=HEAD_DIM,
        intermediate_size=INTER,
        vocab_size=1000,
        decoder_layer_class="Qwen3DecoderLayer",
        **extra,
    )


def _per_token(arch: ModelArch, *, liger: bool = False, adapter: str = "lora") -> float:
    job = Job(arch=arch, preset=PRESET, adapter=adapter, attention="sdpa", liger=liger)
    return activation_bytes_per_token_layer(job)


def _model(*, qwen3: bool):
    torch = pytest.importorskip("torch")
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    shape = dict(
        vocab_size=1000,
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HEAD_DIM,
        attn_implementation="sdpa",
    )
    model_cls, cfg = (Qwen3ForCausalLM, Qwen3Config(**shape)) if qwen3 else (LlamaForCausalLM, LlamaConfig(**shape))
    return get_peft_model(
        model_cls(cfg).to(torch.bfloat16), LoraConfig(r=16, lora_alpha=32, target_modules=list(ALL_LINEAR))
    )


def test_qk_norm_keeps_the_fp32_input_of_each_query_and_key_head():
    measured = {qwen3: per_token_bytes(lambda qwen3=qwen3: _model(qwen3=qwen3)) for qwen3 in (False, True)}
    # torch's RMSNorm upcasts its input to fp32 and keeps it: 4 B x (4 x 64 + 2 x 64) = 1,536 B per token
    # (+ one fp32 rsqrt per head, 24 B, which the planner leaves out as it does for the other norms)
    planned = _per_token(_arch(qk_norm=True)) - _per_token(_arch())
    assert planned == 4 * (HEADS + KV) * HEAD_DIM
    assert measured[True] - measured[False] == pytest.approx(planned, rel=0.03)


def test_liger_qk_norm_keeps_the_16_bit_input_and_one_rstd_per_head():
    planned = _per_token(_arch(qk_norm=True), liger=True) - _per_token(_arch(), liger=True)
    assert planned == 2 * (HEADS + KV) * HEAD_DIM + 4 * (HEADS + KV)


def test_gemma_post_norms_keep_their_inputs_but_feed_no_linear():
    two, four = _per_token(_arch()), _per_token(_arch(norms_per_layer=4))
    assert four - two == 2 * 4 * H  # two more fp32 inputs kept, no further outputs kept by a linear
    full_two, full_four = _per_token(_arch(), adapter="full"), _per_token(_arch(norms_per_layer=4), adapter="full")
    assert full_four - full_two == 2 * (4 * H + 2 * H)  # a full fine-tune also keeps each norm's weight input


@pytest.mark.parametrize(
    ("model_type", "qk_norm", "norms"),
    [("qwen3", True, 2), ("gemma3_text", True, 4), ("gemma2", False, 4), ("llama", False, 2), ("qwen2", False, 2)],
)
def test_config_reader_knows_which_families_have_these_norms(tmp_path, model_type, qk_norm, norms):
    cfg = {
        "model_type": model_type,
        "hidden_size": H,
        "num_hidden_layers": 2,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "intermediate_size": INTER,
        "vocab_size": 1000,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    arch = arch_from_config(path, key="t")
    assert (arch.qk_norm, arch.norms_per_layer) == (qk_norm, norms)


def test_registry_entries_carry_their_families_norms():
    assert get_model("qwen3-8b").qk_norm and get_model("qwen3-8b").norms_per_layer == 2
    assert get_model("gemma-3-12b").qk_norm and get_model("gemma-3-12b").norms_per_layer == 4
    assert not get_model("gemma-2-9b").qk_norm and get_model("gemma-2-9b").norms_per_layer == 4
    assert not get_model("llama-3.1-8b").qk_norm and get_model("llama-3.1-8b").norms_per_layer == 2
