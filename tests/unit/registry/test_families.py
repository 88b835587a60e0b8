"""The config reader's family table and refusals, on plain config.json dicts (no torch): what each refusal
says, and the class defaults a config.json written by save_pretrained leaves out. The counts themselves
are checked against transformers' models in tests/unit/plan/test_arch_sweep.py."""

from __future__ import annotations

import json

import pytest

from finetune.errors import RecipeError
from finetune.recipe.schema import ModelSection
from finetune.registry import resolve_model

SHAPE = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, intermediate_size=96, vocab_size=512)


def _read(tmp_path, config: dict):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return resolve_model(ModelSection(name=str(folder)), base_dir=tmp_path)


@pytest.mark.parametrize(
    "config,words",
    [
        (
            dict(SHAPE, model_type="jamba", mamba_d_conv=4, layer_types=["mamba", "attention"]),
            "recurrent, state-space or linear-attention layers (mamba)",
        ),
        (dict(SHAPE, model_type="qwen3_next", layer_types=["linear_attention"] * 8), "(linear_attention)"),
        (dict(SHAPE, model_type="bert", type_vocab_size=2), "an encoder or encoder-decoder model"),
        (dict(SHAPE, model_type="jetmoe", num_local_experts=8), "mixture-of-experts layers (num_local_experts)"),
        # Mistral-Small-3.1: a Mistral text decoder under a Pixtral vision tower that would go uncounted
        (
            dict(model_type="mistral3", text_config=dict(SHAPE, model_type="mistral"), vision_config={}),
            "wraps a mistral text decoder with other towers",
        ),
        # Qwen2.5-VL keeps its text keys at the top, beside its vision tower
        (dict(SHAPE, model_type="qwen2_5_vl", vision_config={"depth": 32}), "with other towers (vision_config)"),
        # Llama-3.2-Vision: cross-attention layers into a vision tower
        (
            dict(
                model_type="mllama",
                text_config=dict(SHAPE, model_type="mllama_text_model", cross_attention_layers=[3]),
                vision_config={"hidden_size": 32},
            ),
            "(vision_config) and cross-attention layers",
        ),
        # DBRX keeps its experts one level down, in ffn_config
        (dict(SHAPE, model_type="dbrx", ffn_config={"moe_num_experts": 16}), "(ffn_config.moe_num_experts)"),
        (dict(SHAPE, model_type="gpt2"), "not a shape the planner's memory and time model describes"),
    ],
)
def test_refusals_name_the_type_say_why_and_what_to_do(tmp_path, config, words):
    with pytest.raises(RecipeError) as caught:
        _read(tmp_path, config)
    err = caught.value
    assert f"model_type {config['model_type']!r} is not supported by the planner" in err.message
    assert words in err.message
    assert err.key == "model.name" and "open an issue" in err.hint
    # a registry entry is offered as a stand-in, said to be one, except for layers nothing stands in for
    if "recurrent" in words or "linear_attention" in words or "encoder" in words:
        assert "set model.arch" not in err.hint and "no registry entry stands in" in err.hint
    else:
        assert "set model.arch" in err.hint and "stand-in" in err.hint


def test_a_registry_entry_standing_in_for_another_architecture_is_said(tmp_path):
    from finetune.plan import plan
    from finetune.recipe import load_recipe

    folder = tmp_path / "jamba"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(SHAPE, model_type="jamba", mamba_d_conv=4)))
    raw = {
        "model": {"name": str(folder), "arch": "mixtral-8x7b"},
        "data": {"path": "t.jsonl"},
        "train": {"liger": "off"},
        "hardware": "server-8xh100",
    }
    warnings = plan(load_recipe(raw)).warnings
    assert any("model.arch mixtral-8x7b (mixtral) stands in for" in w and "model_type jamba" in w for w in warnings)
    (folder / "config.json").write_text(json.dumps(dict(SHAPE, model_type="mixtral", num_local_experts=4)))
    raw["model"]["arch"] = "mixtral-8x7b"
    assert not any("stands in" in w for w in plan(load_recipe(raw)).warnings)


def test_gemma3_multimodal_is_read_as_its_text_decoder(tmp_path):
    arch = _read(tmp_path, dict(model_type="gemma3", text_config=dict(SHAPE, model_type="gemma3_text")))
    assert (arch.family, arch.norms_per_layer, arch.qk_norm, arch.tied_embeddings) == ("gemma3", 4, True, True)


@pytest.mark.parametrize(
    "config,expected",
    [
        # class defaults left out of config.json: Seed-OSS's q/k/v biases, SmolLM3's tying
        (dict(model_type="seed_oss"), dict(attention_bias=True, o_proj_bias=False, tied_embeddings=False)),
        (dict(model_type="smollm3"), dict(attention_bias=False, tied_embeddings=True)),
        # Llama's attention_bias reaches o_proj; Qwen2's fixed q/k/v biases never do
        (dict(model_type="llama", attention_bias=True), dict(attention_bias=True, o_proj_bias=True)),
        (dict(model_type="qwen2", attention_bias=False), dict(attention_bias=True, o_proj_bias=False)),
        # Mistral's attention has no biases whatever the config says; ERNIE-4.5's use_bias covers all
        (dict(model_type="mistral", attention_bias=True), dict(attention_bias=False, o_proj_bias=False)),
        (dict(model_type="ernie4_5", use_bias=True), dict(attention_bias=True, o_proj_bias=True, mlp_bias=True)),
        # OLMo-2's q/k norms span all heads; Cohere's only with use_qk_norm, one norm per layer
        (dict(model_type="olmo2"), dict(qk_norm=True, qk_norm_per_head=False, norms_per_layer=2)),
        (dict(model_type="cohere", use_qk_norm=True), dict(qk_norm=True, qk_norm_per_head=False, norms_per_layer=1)),
        (dict(model_type="glm4"), dict(fused_gate_up=True, fused_qkv=False, norms_per_layer=4)),
        # GLM-4.5's q/k norms are one head wide, built only with use_qk_norm; its experts are the class's when
        # config.json names none (128 of width 1408, the first layer dense)
        (dict(model_type="glm4_moe"), dict(qk_norm=False, num_experts=128, moe_intermediate_size=1408, moe_layers=7)),
        (dict(model_type="glm4_moe", use_qk_norm=True), dict(qk_norm=True, qk_norm_per_head=True)),
        # a config attention dropout: finetune's varlen kernel runs none, so the planner must know it
        (dict(model_type="granitemoe", attention_dropout=0.1), dict(attention_dropout=0.1, num_experts=8)),
        # EXAONE-4's pattern in letters: three local layers, then a global one
        (
            dict(model_type="exaone4", sliding_window=64, sliding_window_pattern="LLLG"),
            dict(sliding_window=64, sliding_layers=6),
        ),
        # a family whose attention ignores sliding_window is not planned as sliding
        (dict(model_type="granite", sliding_window=64), dict(sliding_window=None, sliding_layers=0)),
    ],
)
def test_family_traits_and_class_defaults(tmp_path, config, expected):
    arch = _read(tmp_path, dict(SHAPE, **config))
    assert {k: getattr(arch, k) for k in expected} == expected


def test_expert_groups_that_do_not_divide_the_experts_are_refused(tmp_path):
    """DeepSeek-V3's router views the experts as n_group equal groups (class default 8, keeping 4): a config
    with 4 experts and the default groups fails at transformers' first step, so it is refused before."""
    mla = dict(q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    with pytest.raises(RecipeError) as caught:
        _read(tmp_path, dict(SHAPE, model_type="deepseek_v3", n_routed_experts=4, **mla))
    text = caught.value.render()
    assert "n_group 8" in text and "4 experts" in text and caught.value.key == "model.name", text


def test_phi3_lora_targets_are_its_fused_modules(tmp_path):
    arch = _read(tmp_path, dict(SHAPE, model_type="phi3"))
    assert arch.lora_targets == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def test_the_liger_model_types_are_the_ones_an_installed_liger_kernel_patches():
    """LIGER_MODEL_TYPES agrees with liger-kernel's own dispatch table on every family the planner reads
    (runs where liger-kernel is installed, e.g. the GPU environment of scripts/gpu_env.sh)."""
    pytest.importorskip("liger_kernel")
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    from finetune.registry.families import FAMILIES, LIGER_MODEL_TYPES

    for family in FAMILIES:
        assert (family in LIGER_MODEL_TYPES) == (family in MODEL_TYPE_TO_APPLY_LIGER_FN), family


@pytest.mark.parametrize(
    "quantization,method",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq"),
        ({"quant_method": "awq", "bits": 4}, "awq"),
        # FP8 as llm-compressor writes it (RedHatAI's -FP8-dynamic uploads); DeepSeek's own FP8 loads dequantized
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "compressed-tensors"),
        ({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "bitsandbytes"),  # older bnb checkpoints
    ],
)
def test_a_pre_quantized_checkpoint_is_refused_by_name_with_the_way_to_train_it(tmp_path, quantization, method):
    # e.g. LLaMA-Factory's GPTQ/AWQ examples, unsloth's *-bnb-4bit uploads: weights and memory would be
    # planned as 16-bit ones, and the run would fail (or quietly train something else) only after loading
    with pytest.raises(RecipeError) as caught:
        _read(tmp_path, dict(SHAPE, model_type="llama", quantization_config=quantization))
    err = caught.value
    assert f"quant_method {method!r}" in err.message and err.key == "model.name"
    assert "unquantized model" in err.hint and "adapter.type: qlora" in err.hint


def test_the_fused_expert_model_types_are_those_whose_liger_swiglu_swaps_the_experts():
    """LIGER_FUSED_EXPERTS (Liger's SwiGLU left off: registry.families.liger_swiglu) is every Liger-patched family
    whose apply function swaps in LigerExperts (runs where liger-kernel is installed: scripts/gpu_env.sh)."""
    pytest.importorskip("liger_kernel")
    import inspect

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    from finetune.registry.families import LIGER_FUSED_EXPERTS, LIGER_MODEL_TYPES

    for family in LIGER_MODEL_TYPES:
        swaps = "LigerExperts" in inspect.getsource(MODEL_TYPE_TO_APPLY_LIGER_FN[family])
        assert swaps == (family in LIGER_FUSED_EXPERTS), family


def test_liger_is_asked_for_its_swiglu_except_where_it_would_swap_the_experts():
    from finetune.train.trainers import LIGER_LAYERS, liger_kernel_config

    assert liger_kernel_config("llama") == LIGER_LAYERS
    for family in ("mixtral", "qwen3_moe", "deepseek_v3"):
        config = liger_kernel_config(family)
        assert config["swiglu"] is False and config["rms_norm"] and config["rope"], family
