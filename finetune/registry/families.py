"""The model_types the planner's config reader knows, and why it refuses the others.

A family is readable when its decoder layers are what the memory and time model describes: q/k/v/o
attention projections (or DeepSeek's latent attention), a gated MLP (gate, up, down) or fused routed
experts, and weighted norms. What differs between such families and is not in config.json (the class
defaults a config.json written by save_pretrained leaves out, the norms a layer has) is one row here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Family:
    layer_class: str  # the decoder layer's class (FSDP's wrap unit)
    # the config key that switches q/k/v biases on (the family's attention reads it), or a fixed answer
    qkv_bias: str | bool = "attention_bias"
    o_bias: str | bool = "attention_bias"  # the same for the attention output projection
    mlp_bias: str | bool = False  # the same for gate/up/down
    bias_default: bool = False  # the class default of the qkv_bias key (a config.json may leave it out)
    qk_norm: str = ""  # "head": a norm one head wide on q and k (Qwen3); "all": over all heads (OLMo-2)
    qk_norm_switch: str = ""  # the config key that builds those norms (use_qk_norm); "": always built
    norms: int = 2  # weighted norms per decoder layer
    tied: bool = False  # tie_word_embeddings' class default
    fused_qkv: bool = False  # q, k and v are one qkv_proj module
    fused_gate_up: bool = False  # gate and up are one gate_up_proj module
    # sliding-window attention as the config class resolves it (registry/derive.py sliding_fields):
    window: int | None = None  # the class default of sliding_window (a config.json may leave it out)
    window_switch: bool = False  # the window applies only with use_sliding_window: true
    softcap: float | None = None  # the class default of attn_logit_softcapping
    # which layers slide when config.json has no layer_types: "" none, "every" all, "odd" every other
    # (i + 1) % 2, "pattern" all but every sliding_window_pattern-th (default `pattern`), "every4" all but
    # every 4th, "cwm" all but every 4th from the first, "qwen" from max_window_layers on, "qwen_moe" every
    # other below max_window_layers, "nope" the NoPE layers (SmolLM3's no_rope_layers)
    slides: str = ""
    pattern: int = 6
    # the attention module applies its window only through the mask transformers builds, passing no sliding_window to
    # the attention function (Qwen2-MoE): ModelArch.window_in_mask_only
    window_in_mask_only: bool = False
    # the class defaults of the shape keys (hidden_size, vocab_size, the experts' count and width, ...) a
    # config.json may leave out: save_pretrained writes only the values that differ from the class's defaults
    defaults: dict[str, int] = field(default_factory=dict)


_FIXED: dict[str, Any] = dict(
    qkv_bias=False, o_bias=False
)  # families whose attention has no biases whatever config.json says
_LLAMA: dict[str, Any] = dict(mlp_bias="mlp_bias")  # Llama's attention_bias covers q/k/v and o; mlp_bias the MLP
# Gemma3TextConfig's defaults: google/gemma-3-4b-it's text_config, for one, names neither its heads nor its vocab
_GEMMA3: dict[str, Any] = dict(
    qk_norm="head",
    norms=4,
    tied=True,
    window=4096,
    slides="pattern",
    defaults=dict(
        vocab_size=262208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=131072,
    ),
)
FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaDecoderLayer", **_LLAMA),
    "mistral": Family("MistralDecoderLayer", **_FIXED, window=4096, slides="every"),
    "ministral": Family("MinistralDecoderLayer", **_FIXED, window=4096, slides="every"),
    "ministral3": Family("Ministral3DecoderLayer", **_FIXED),
    "helium": Family("HeliumDecoderLayer", o_bias=False, mlp_bias="mlp_bias"),
    "granite": Family("GraniteDecoderLayer", **_LLAMA),  # its multipliers scale activations, not shapes
    "internlm3": Family("LlamaDecoderLayer", **_LLAMA),  # transformers builds these three as Llama
    "exaone": Family("LlamaDecoderLayer", **_LLAMA),
    "iquestcoder": Family("LlamaDecoderLayer", **_LLAMA),
    "cwm": Family("CwmDecoderLayer", **_FIXED, mlp_bias="mlp_bias", window=8192, slides="cwm"),
    "smollm3": Family("SmolLM3DecoderLayer", **_LLAMA, tied=True, window_switch=True, slides="nope"),
    "seed_oss": Family("SeedOssDecoderLayer", o_bias="attention_out_bias", mlp_bias="mlp_bias", bias_default=True),
    "qwen2": Family("Qwen2DecoderLayer", qkv_bias=True, o_bias=False, window=4096, window_switch=True, slides="qwen"),
    "qwen3": Family("Qwen3DecoderLayer", qk_norm="head", window=4096, window_switch=True, slides="qwen"),
    "gemma": Family("GemmaDecoderLayer", tied=True),
    "vaultgemma": Family("VaultGemmaDecoderLayer", tied=True, window=4096, softcap=50.0, slides="odd"),
    "gemma2": Family("Gemma2DecoderLayer", norms=4, tied=True, window=4096, softcap=50.0, slides="odd"),
    "gemma3": Family("Gemma3DecoderLayer", **_GEMMA3),
    "gemma3_text": Family("Gemma3DecoderLayer", **_GEMMA3),
    # post-norms only (after attention and after the MLP), q/k norms over all heads
    "olmo2": Family("Olmo2DecoderLayer", qk_norm="all"),
    "olmo3": Family("Olmo3DecoderLayer", qk_norm="all", window=4096, slides="every4"),
    "exaone4": Family("Exaone4DecoderLayer", **_FIXED, qk_norm="head", window=4096, slides="pattern", pattern=4),
    # attention and MLP in parallel from one norm; Cohere's optional q/k norms (use_qk_norm) span all heads
    "cohere": Family("CohereDecoderLayer", norms=1, tied=True, qk_norm="all", qk_norm_switch="use_qk_norm"),
    "cohere2": Family("Cohere2DecoderLayer", norms=1, tied=True, window=4096, slides="pattern", pattern=4),
    "ernie4_5": Family("Ernie4_5DecoderLayer", qkv_bias="use_bias", o_bias="use_bias", mlp_bias="use_bias", tied=True),
    "hunyuan_v1_dense": Family("HunYuanDenseV1DecoderLayer", qk_norm="head"),
    # GLM and GLM-4: q/k/v biases by default, gate and up fused; GLM-4 adds post-norms on both branches
    "glm": Family("GlmDecoderLayer", o_bias=False, bias_default=True, fused_gate_up=True),
    "glm4": Family("Glm4DecoderLayer", o_bias=False, bias_default=True, fused_gate_up=True, norms=4),
    "phi3": Family("Phi3DecoderLayer", **_FIXED, fused_qkv=True, fused_gate_up=True, slides="every"),
    "mixtral": Family(
        "MixtralDecoderLayer", **_FIXED, slides="every", defaults=dict(num_local_experts=8, num_experts_per_tok=2)
    ),
    "qwen2_moe": Family(
        "Qwen2MoeDecoderLayer",
        qkv_bias="qkv_bias",
        o_bias=False,
        bias_default=True,
        window=4096,
        window_switch=True,
        slides="qwen_moe",
        window_in_mask_only=True,
        defaults=dict(
            num_local_experts=60,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            num_experts_per_tok=4,
        ),
    ),
    "qwen3_moe": Family(
        "Qwen3MoeDecoderLayer",
        qk_norm="head",
        window=4096,
        window_switch=True,
        slides="every",
        defaults=dict(num_local_experts=128, moe_intermediate_size=768, num_experts_per_tok=8),
    ),
    # DeepSeek's attention_bias covers q_a, kv_a and o (workload.count_params)
    "deepseek_v2": Family(
        "DeepseekV2DecoderLayer",
        o_bias=False,
        mlp_bias="mlp_bias",
        defaults=dict(n_routed_experts=64, n_shared_experts=2, moe_intermediate_size=1407, first_k_dense_replace=0),
    ),
    "deepseek_v3": Family(
        "DeepseekV3DecoderLayer",
        o_bias=False,
        defaults=dict(
            n_routed_experts=256,
            n_shared_experts=1,
            moe_intermediate_size=2048,
            first_k_dense_replace=3,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
        ),
    ),
    "gpt_oss": Family(
        "GptOssDecoderLayer",
        bias_default=True,
        window=128,
        slides="odd",
        defaults=dict(num_local_experts=128, num_experts_per_tok=4),
    ),
    "olmoe": Family("OlmoeDecoderLayer", qk_norm="all", defaults=dict(num_local_experts=64, num_experts_per_tok=8)),
    # GLM-4.5's routed experts follow DeepSeek-V3's (n_routed_experts, shared experts, first dense layers) beside
    # grouped-query attention
    "glm4_moe": Family(
        "Glm4MoeDecoderLayer",
        o_bias=False,
        qk_norm="head",
        qk_norm_switch="use_qk_norm",
        defaults=dict(
            n_routed_experts=128,
            n_shared_experts=1,
            moe_intermediate_size=1408,
            first_k_dense_replace=1,
            num_experts_per_tok=8,
        ),
    ),
    # Granite's multipliers (embedding, residual, attention, logits) scale activations, not shapes
    "granitemoe": Family("GraniteMoeDecoderLayer", defaults=dict(num_local_experts=8, num_experts_per_tok=2)),
    "granitemoeshared": Family(
        "GraniteMoeSharedDecoderLayer", defaults=dict(num_local_experts=8, num_experts_per_tok=2)
    ),
}
KNOWN_FAMILIES = frozenset(FAMILIES)
# families whose routed experts follow DeepSeek's convention: n_routed_experts of moe_intermediate_size, shared
# experts, the first layers dense, and a group-limited sigmoid router (GLM-4.5 runs the same code)
DEEPSEEK_ROUTED = frozenset({"deepseek_v2", "deepseek_v3", "glm4_moe"})

# the model types Liger patches (liger-kernel 0.8.5's MODEL_TYPE_TO_APPLY_LIGER_FN, for the families above);
# for any other the Trainer's use_liger_kernel changes nothing, so the planner must not count Liger's
# smaller activations. tests/unit/registry/test_families.py checks this against an installed liger-kernel.
LIGER_MODEL_TYPES = frozenset(
    {
        "deepseek_v2",
        "deepseek_v3",
        "exaone4",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "glm4",
        "gpt_oss",
        "granite",
        "hunyuan_v1_dense",
        "llama",
        "ministral",
        "mistral",
        "mixtral",
        "olmo2",
        "olmo3",
        "phi3",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "smollm3",
    }
)

# the model types whose Liger SwiGLU patch replaces the routed experts module itself with Liger's Triton fused MoE
# (liger_kernel.transformers.swiglu.LigerExperts) instead of transformers' grouped_mm experts. On one Mixtral-8x7B
# layer (16,384 tokens, one H200: scripts/moe_experts_rates.py, docs/results/moe-experts-rates-2026-11-28-h200.json)
# it took 101 ms forward + backward with frozen experts (LoRA) and 98 ms with trained ones, against 42 and 61 ms for
# grouped_mm, after 53 s of autotuning on its first call; a whole Mixtral LoRA run with it did not reach its first
# step in 6 minutes. On Qwen3-30B-A3B's and DeepSeek-V2-Lite's frozen experts it took 13.0 and 16.7 ms against 9.7 and
# 10.4, after 212-219 s of autotuning (docs/results/moe-experts-rates-2026-11-28-h200-qwen3-deepseek.json). So
# finetune runs Liger's norms and RoPE on these and leaves the MLPs to transformers.
LIGER_FUSED_EXPERTS = frozenset({"deepseek_v2", "deepseek_v3", "mixtral", "qwen3_moe"})


# the model types with q/k norms (Family.qk_norm) whose Liger patch replaces those norms too (liger-kernel 0.8.5's
# apply functions patch each decoder layer's self_attn.q_norm and k_norm for these; OLMo-2's and OLMo-3's leaves
# them to transformers' eager RMSNorm, whose ops the host launches one by one: plan/host_time.py)
LIGER_QK_NORM_MODEL_TYPES = frozenset({"exaone4", "gemma3", "gemma3_text", "qwen3", "qwen3_moe"})


def liger_installed() -> bool:
    """liger-kernel is installed here; find_spec does not import it (planning stays torch-free)."""
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def liger_swiglu(model_type: str) -> bool:
    """Liger's SwiGLU kernel is asked for: everywhere Liger patches but where it would swap the routed experts
    (LIGER_FUSED_EXPERTS). The run's Liger config (train/trainers.py) and the planner's Job read this."""
    return model_type not in LIGER_FUSED_EXPERTS


def biases(text: dict, family: Family) -> dict:
    """ModelArch's attention_bias, o_proj_bias and mlp_bias as the family's modules read config.json."""

    def read(rule: str | bool, default: bool) -> bool:
        return rule if isinstance(rule, bool) else bool(text.get(rule, default))

    qkv = read(family.qkv_bias, family.bias_default)
    same = family.o_bias == family.qkv_bias
    return dict(
        attention_bias=qkv,
        o_proj_bias=qkv if same else read(family.o_bias, False),
        mlp_bias=read(family.mlp_bias, False),
    )


# the multimodal checkpoints the planner reads as their text decoder, by model_type, with the model_type of the
# vision tower they add: loaded with the model, its weights (and the projector's) are counted as frozen
# (finetune.registry.derive.tower_params); training freezes them and keeps adapters off them
TEXT_OF_MULTIMODAL = {"gemma3": "siglip_vision_model"}

# config.json keys and layer kinds of layers that are not attention: their state, memory and time
# (recurrences, convolutions, linear attention) are nothing the planner models
_RECURRENT_WORDS = ("mamba", "ssm", "conv", "linear_attn", "linear_attention", "recurrent", "rwkv", "lstm", "lru")
_ENCODER_KEYS = ("type_vocab_size", "encoder_layers", "encoder_layerdrop")


# config.json keys of towers a multimodal checkpoint adds to its text decoder
_TOWER_KEYS = ("vision_config", "audio_config", "speech_config", "vision_tower", "image_encoder")


def refusal_reason(cfg: dict, text: dict, *, model_type: str) -> tuple[str, bool]:
    """Why `model_type` is not read, as specifically as its config.json shows, and whether a registry entry
    could stand in for it (model.arch) at all: nothing stands in for recurrent or linear-attention layers."""
    kinds = {str(k) for k in text.get("layer_types") or [] if isinstance(k, str)}
    odd = sorted(k for k in kinds if any(w in k for w in _RECURRENT_WORDS))
    keys = sorted(k for k in text if any(w in k.lower() for w in _RECURRENT_WORDS) and text[k] not in (None, [], {}))
    if odd or keys:
        what = ", ".join(odd) if odd else ", ".join(keys[:3])
        return (
            f"it has recurrent, state-space or linear-attention layers ({what}) whose memory and time "
            f"the planner does not model",
            False,
        )
    # expert keys at the top or one level down (DBRX keeps them in ffn_config)
    nested = [(f"{k}.{n}", v) for k, d in text.items() if isinstance(d, dict) for n, v in d.items()]
    experts = sorted(  # counts and switches, not coefficients (DBRX's moe_loss_weight)
        k
        for k, v in [*text.items(), *nested]
        if any(w in k for w in ("expert", "moe")) and v not in (None, 0, [], False) and not isinstance(v, float)
    )
    if experts:
        return (
            f"its mixture-of-experts layers ({', '.join(experts[:3])}) follow a convention whose parameters "
            f"and routed-expert memory the planner has not been checked against",
            True,
        )
    if cfg.get("is_encoder_decoder") or any(k in cfg for k in _ENCODER_KEYS):
        return "it is an encoder or encoder-decoder model, not a decoder-only LM the planner models", False
    towers = [k for k in _TOWER_KEYS if cfg.get(k)]
    if towers or (cfg is not text and text.get("model_type") in KNOWN_FAMILIES):
        decoder = text.get("model_type") if cfg is not text else None
        cross = " and cross-attention layers" if text.get("cross_attention_layers") else ""
        return (
            f"it wraps {f'a {decoder} text decoder' if decoder else 'its text decoder'} with other towers "
            f"({', '.join(towers) or 'vision, audio'}){cross} whose weights and activations the planner does not "
            "count",
            True,
        )
    return "its decoder layers are not a shape the planner's memory and time model describes", True
