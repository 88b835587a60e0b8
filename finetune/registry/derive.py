"""Derive a ModelArch from a model's config.json with plain json (no transformers, no torch).

Reads the families of finetune/registry/families.py: dense Llama-shaped decoders (llama, mistral, qwen2/3,
gemma 1-3 with Gemma-3's multimodal `text_config` nesting, olmo2/3, cohere, phi3, ...) and mixture-of-experts
in each convention transformers uses (mixtral; qwen2_moe / qwen3_moe; olmoe; deepseek_v2 / deepseek_v3 with
multi-head latent attention; glm4_moe, DeepSeek's experts beside grouped-query attention; gpt_oss; granitemoe /
granitemoeshared), a key config.json leaves out taking its config class's default (Family.defaults). A
model_type outside these, or an MoE key the family's reader does not know, is refused by name: guessing such
a model as dense has planned a 236B model as 18.7B."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import ValidationError

from finetune.errors import RecipeError
from finetune.recipe.paths import anchored
from finetune.registry.families import (
    DEEPSEEK_ROUTED,
    FAMILIES,
    KNOWN_FAMILIES,
    TEXT_OF_MULTIMODAL,
    Family,
    biases,
    refusal_reason,
)
from finetune.registry.schema import ModelArch

DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# transformers 5 stores MoE experts as fused 3D parameters, which LoRA cannot target by module name
MOE_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# The MoE keys each family's reader understands; routing hyper-parameters that change no parameter
# count or memory (aux-loss coefficients, scoring functions, group-limited routing) are listed too.
_ROUTING_ONLY = {
    "router_aux_loss_coef",
    "output_router_logits",
    "norm_topk_prob",
    "router_jitter_noise",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "topk_method",
    "scoring_func",
    "aux_loss_alpha",
    "seq_aux",
    "ep_size",
    "num_experts_per_tok",
    "router_z_loss_coef",
}
_MOE_KEYS = {
    "mixtral": {"num_local_experts"},
    "qwen2_moe": {
        "num_experts",
        "num_local_experts",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "decoder_sparse_step",
        "mlp_only_layers",
    },
    "qwen3_moe": {
        "num_experts",
        "num_local_experts",
        "moe_intermediate_size",
        "decoder_sparse_step",
        "mlp_only_layers",
    },
    "deepseek_v2": {
        "n_routed_experts",
        "n_shared_experts",
        "moe_intermediate_size",
        "first_k_dense_replace",
        "moe_layer_freq",
    },
    "deepseek_v3": {
        "n_routed_experts",
        "n_shared_experts",
        "moe_intermediate_size",
        "first_k_dense_replace",
        "moe_layer_freq",
        "num_nextn_predict_layers",
    },
    "gpt_oss": {"num_local_experts", "experts_per_token"},
    "olmoe": {"num_experts", "num_local_experts"},
    "glm4_moe": {"n_routed_experts", "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace"},
    # num_experts: what finetune/compat/moe_expert_count.py adds to a trained model's saved config
    "granitemoe": {"num_local_experts", "num_experts"},
    "granitemoeshared": {"num_local_experts", "num_experts"},
}
_MOE_WORDS = ("expert", "moe", "dense_replace", "sparse_step", "mlp_only")
MLA_LORA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def text_config(cfg: dict) -> dict:
    """The text decoder's part of config.json: a multimodal wrapper's text_config, else the whole file."""
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def find_config_json(name: str, *, base_dir: Path, revision: str | None = None) -> Path | None:
    """A local directory (relative to base_dir) or a Hugging Face cache snapshot holding config.json."""
    candidate = anchored(name, base_dir)
    if (candidate / "config.json").is_file():
        return candidate / "config.json"
    if candidate.name == "config.json" and candidate.is_file():
        return candidate
    if "/" not in name or name.startswith((".", "/", "~")):
        return None
    for cache in _hf_cache_dirs():
        repo = cache / ("models--" + name.replace("/", "--"))
        if not repo.is_dir():
            continue
        ref = repo / "refs" / (revision or "main")
        snapshots = repo / "snapshots"
        if ref.is_file():
            path = snapshots / ref.read_text().strip() / "config.json"
            if path.is_file():
                return path
        found = sorted(snapshots.glob("*/config.json")) if snapshots.is_dir() else []
        if found:
            return found[-1]
    return None


def _hf_cache_dirs() -> list[Path]:
    dirs = []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return dirs


def arch_from_config(path: Path, *, key: str, hub_id: str | None = None) -> ModelArch:
    """Read config.json at `path` and map it onto ModelArch."""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RecipeError(
            f"cannot read the model's config.json: {exc}",
            file=str(path),
            hint="point model.name at a directory with a valid config.json",
        ) from None
    if not isinstance(cfg, dict):
        raise RecipeError("config.json is not a JSON object", file=str(path))
    text = text_config(cfg)
    inner = text.get("model_type", "")
    family = cfg.get("model_type") or inner
    # a multimodal wrapper is read as its text decoder only where the registry says the towers it adds
    # are left out knowingly (TEXT_OF_MULTIMODAL); another wrapper's towers would go uncounted
    wrapped = text is not cfg and family != inner and family not in TEXT_OF_MULTIMODAL
    if family not in KNOWN_FAMILIES or wrapped:
        reason, stands_in = refusal_reason(cfg, text, model_type=family)
        stand_in = (
            "set model.arch to the closest registry entry (finetune models) to plan that entry as a stand-in "
            "(the plan then describes it, not this model), or "
            if stands_in
            else "no registry entry stands in for such layers; "
        )
        raise RecipeError(
            f"model_type {family or '(none)'!r} is not supported by the planner: "
            f"{reason}; it will not guess its parameters and memory",
            file=str(path),
            key="model.name",
            hint=f"{stand_in}open an issue to have {family or 'it'} modelled; readable model_types: "
            f"{', '.join(sorted(KNOWN_FAMILIES))}",
        )
    quantized = prequantized_method(cfg, text)
    if quantized and quantized not in DEQUANTIZING_CONFIGS:
        raise RecipeError(
            f"config.json says the weights are already quantized (quantization_config, quant_method "
            f"{quantized!r}): the planner models 16/32-bit checkpoints, trained whole or with LoRA, and "
            "bitsandbytes 4-bit quantization applied at load (adapter.type: qlora); training on a pre-quantized "
            "checkpoint is not modelled",
            file=str(path),
            key="model.name",
            hint="point model.name at the unquantized model the checkpoint was made from and set "
            "adapter.type: qlora for 4-bit weights (or lora / full on the 16-bit ones)",
        )
    nested = text is not cfg
    reader, traits = family, FAMILIES[family]
    text = {**traits.defaults, **text}  # what the config class fills in for the keys config.json leaves out
    missing = [
        k
        for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        if text.get(k) is None
    ]
    if missing:
        raise RecipeError(
            f"config.json (model_type {family!r}) lacks {', '.join(missing)}, which size the model; the planner "
            "cannot guess them",
            file=str(path),
            key="model.name",
            hint="add them to config.json as the model's class fills them in, or set model.arch to the closest "
            "registry entry (finetune models)",
        )
    tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", traits.tied))
    qk_norm = traits.qk_norm if not traits.qk_norm_switch or text.get(traits.qk_norm_switch) else ""
    try:
        heads = int(text["num_attention_heads"])
        towers = tower_params(cfg, text, family=family, path=path) if nested and family in TEXT_OF_MULTIMODAL else 0
        moe = moe_fields(text, family=reader, path=path)
        mla = mla_fields(text) if reader in ("deepseek_v2", "deepseek_v3") else {}
        experts = moe.get("num_experts", 1)
        targets = MOE_LORA_TARGETS if experts > 1 else DEFAULT_LORA_TARGETS
        if traits.fused_qkv:
            targets = ["qkv_proj", *[t for t in targets if t not in ("q_proj", "k_proj", "v_proj")]]
        if traits.fused_gate_up and "down_proj" in targets:
            targets = [
                *[t for t in targets if t not in ("gate_proj", "up_proj", "down_proj")],
                "gate_up_proj",
                "down_proj",
            ]
        if mla:
            targets = MLA_LORA_TARGETS if mla["q_lora_rank"] else ["q_proj", *MLA_LORA_TARGETS[2:]]
            mla["head_dim"] = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        elif text.get("head_dim"):
            mla["head_dim"] = int(text["head_dim"])
        return ModelArch(
            key=key,
            hub_ids=[hub_id] if hub_id else [],
            family=family or "unknown",
            hidden_size=int(text["hidden_size"]),
            num_layers=int(text["num_hidden_layers"]),
            num_attention_heads=heads,
            # no num_key_value_heads means multi-head attention (one kv head per query head)
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            intermediate_size=int(text["intermediate_size"]),
            vocab_size=int(text["vocab_size"]),
            tied_embeddings=bool(tied),
            **biases(text, traits),
            fused_qkv=traits.fused_qkv,
            fused_gate_up=traits.fused_gate_up,
            max_position_embeddings=int(text.get("max_position_embeddings") or 8192),
            rope_scaling=configured_rope_scaling(text),
            # a checkpoint loaded dequantized is converted while it loads: a copy, not mapped file pages
            checkpoint_dtype=None if quantized else stored_dtype(cfg, text),
            dequantized_from=quantized or None,
            decoder_layer_class=traits.layer_class,
            lora_targets=targets,
            notes=f"derived from {path}",
            qk_norm=bool(qk_norm),
            qk_norm_per_head=qk_norm != "all",
            norms_per_layer=traits.norms,
            **moe,
            **mla,
            **sliding_fields(text, family=traits),
            attention_dropout=float(text.get("attention_dropout") or 0.0),
            frozen_tower_params=towers,
        )
    except (ValidationError, TypeError, ValueError, KeyError) as exc:
        if isinstance(exc, ValidationError):  # its first complaint, as the field's or the shape check's words
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            said = str(first["msg"]).removeprefix("Value error, ")
            exc = ValueError(f"{field}: {said}" if field else said)
        what = f"lacks {exc}" if isinstance(exc, KeyError) else f"has values the planner cannot use: {exc}"
        raise RecipeError(
            f"config.json (model_type {family!r}) {what}",
            file=str(path),
            key="model.name",
            hint="fix config.json as the model's class writes it, or set model.arch to the closest registry entry "
            "(finetune models)",
        ) from None


# SiglipVisionConfig's defaults, for the keys a saved vision_config leaves out
SIGLIP_DEFAULTS = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_channels=3, image_size=224, patch_size=16
)


def siglip_params(vision: dict) -> int:
    """SigLIP's vision transformer as transformers builds it: patch and position embeddings, pre-norm encoder
    layers (q/k/v/out projections and a two-layer MLP, with biases; two LayerNorms), a final LayerNorm and,
    with vision_use_head, the attention-pooling head."""
    v = {**SIGLIP_DEFAULTS, **{k: val for k, val in vision.items() if val is not None}}
    h, i = int(v["hidden_size"]), int(v["intermediate_size"])
    patch = int(v["patch_size"])
    embeddings = int(v["num_channels"]) * patch * patch * h + h + (int(v["image_size"]) // patch) ** 2 * h
    mlp = h * i + i + i * h + h
    layer = 4 * (h * h + h) + mlp + 2 * 2 * h
    head = (h + 3 * (h * h + h) + (h * h + h) + 2 * h + mlp) if v.get("vision_use_head", True) else 0
    return embeddings + int(v["num_hidden_layers"]) * layer + 2 * h + head


def tower_params(cfg: dict, text: dict, *, family: str, path: Path) -> int:
    """Parameters a multimodal checkpoint in TEXT_OF_MULTIMODAL adds to its text decoder: the vision tower
    and Gemma-3's projector (a vision-width x text-width matrix and an RMSNorm of vision width)."""
    vision = cfg.get("vision_config") or {}
    expected = TEXT_OF_MULTIMODAL[family]
    kind = vision.get("model_type", expected)
    if kind != expected:
        raise RecipeError(
            f"config.json's vision_config is a {kind!r} tower; the planner counts {family}'s {expected} tower only",
            file=str(path),
            key="model.name",
            hint="point model.name at a text-only copy of the model, or open an issue to have this tower counted",
        )
    width = int(vision.get("hidden_size") or SIGLIP_DEFAULTS["hidden_size"])
    return siglip_params(vision) + width * int(text["hidden_size"]) + width


ROPE_SCALING_KEYS = ("rope_type", "factor", "original_max_position_embeddings")


def configured_rope_scaling(text: dict) -> dict | None:
    """The RoPE scaling config.json sets (transformers 4's rope_scaling, 5's rope_parameters; the older `type`
    key read as rope_type), or None where it sets none (no factor, or rope_type default)."""
    raw = text.get("rope_scaling") or text.get("rope_parameters")
    if not isinstance(raw, dict) or raw.get("factor") is None:
        return None
    kind = raw.get("rope_type", raw.get("type"))
    if kind in (None, "default"):
        return None
    return {"rope_type": kind, **{k: raw[k] for k in ROPE_SCALING_KEYS[1:] if raw.get(k) is not None}}


# the quant_methods of checkpoints some models are published in only, which finetune loads dequantized itself through
# the transformers config named here with dequantize=True (train/model.py: dequantizing_config): planned, trained and
# saved as the 16-bit model. Both dequantize in plain torch on any device: MXFP4 (gpt-oss) its expert blocks and
# scales, FP8 (DeepSeek-V3/R1, Qwen3's -FP8 releases) each block-scaled e4m3 weight by its weight_scale_inv, before
# transformers fuses the routed experts. Any other quantized checkpoint is refused (load_arch)
DEQUANTIZING_CONFIGS = {"mxfp4": "Mxfp4Config", "fp8": "FineGrainedFP8Config"}


def prequantized_method(cfg: dict, text: dict) -> str:
    """The quant_method of a checkpoint saved quantized (GPTQ, AWQ, FP8, bitsandbytes, compressed-tensors,
    ...: config.json's quantization_config), '' for a plain 16/32-bit one."""
    quant = cfg.get("quantization_config") or text.get("quantization_config")
    if not isinstance(quant, dict) or not quant:
        return ""
    if quant.get("quant_method"):
        method = quant["quant_method"]
        return str(getattr(method, "value", method))  # transformers' QuantizationMethod (a str enum) or its value
    return "bitsandbytes" if quant.get("load_in_4bit") or quant.get("load_in_8bit") else "unknown"


def stored_dtype(cfg: dict, text: dict) -> str | None:
    """The dtype config.json says the weights were saved in (transformers 5 writes `dtype`, earlier
    versions `torch_dtype`), when it is one a model loads in; None otherwise (FP8 checkpoints, no key)."""
    for d in (text, cfg):
        value = d.get("dtype") or d.get("torch_dtype")
        if value in ("bfloat16", "float16", "float32"):
            return value
    return None


def moe_fields(text: dict, *, family: str, path: Path) -> dict:
    """ModelArch's MoE fields from one family's config keys; unknown MoE keys are refused by name."""
    known = _MOE_KEYS.get(family, set())
    unknown = sorted(
        k
        for k, v in text.items()
        if any(w in k for w in _MOE_WORDS)
        and k not in known
        and k not in _ROUTING_ONLY
        and v not in (None, 0, [], False)
    )
    if unknown:
        raise RecipeError(
            f"config.json of model_type {family!r} has mixture-of-experts keys the planner cannot read: "
            f"{', '.join(unknown)}",
            file=str(path),
            key="model.name",
            hint="set model.arch to a registry entry with the same shape (finetune models)",
        )
    layers = int(text["num_hidden_layers"])
    if family in ("mixtral", "granitemoe", "granitemoeshared", "gpt_oss"):  # experts as wide as the dense MLP
        experts, width = int(text.get("num_local_experts") or 0), None
    elif family in ("qwen2_moe", "qwen3_moe", "olmoe"):  # OLMoE's experts: intermediate_size wide (no moe key)
        # the Hub's configs say num_experts; transformers 5 saves it as num_local_experts (the class default's name
        # in Family.defaults, so a config that names neither gets the default)
        experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
        width = text.get("moe_intermediate_size")
    elif family in DEEPSEEK_ROUTED:
        experts, width = int(text.get("n_routed_experts") or 0), text.get("moe_intermediate_size")
        groups = int(text.get("n_group") or 1)
        if experts > 1 and (experts % groups or int(text.get("topk_group") or 1) > groups):
            # the router views the experts as n_group equal groups and keeps topk_group of them
            raise RecipeError(
                f"config.json routes {experts} experts in n_group {groups} groups keeping topk_group "
                f"{text.get('topk_group')}: the groups must divide the experts and number at least topk_group "
                f"(transformers' router fails at the first step otherwise)",
                file=str(path),
                key="model.name",
                hint="fix n_group / topk_group in config.json (n_group: 1 and topk_group: 1 route over all experts)",
            )
        if int(text.get("moe_layer_freq") or 1) != 1:
            raise RecipeError(
                "config.json sets moe_layer_freq != 1, which transformers' DeepSeek models do not implement",
                file=str(path),
                key="model.name",
                hint="set model.arch to a registry entry with the same shape",
            )
    else:
        return {}
    if experts <= 1:
        return {}
    per_token = int(text.get("num_experts_per_tok") or text.get("experts_per_token") or 2)
    out = {
        "num_experts": experts,
        "experts_per_token": min(per_token, experts),
        "moe_intermediate_size": int(width) if width else None,
    }
    if family in ("qwen2_moe", "qwen3_moe"):
        step = int(text.get("decoder_sparse_step") or 1)
        dense = set(text.get("mlp_only_layers") or [])
        out["moe_layers"] = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
        if family == "qwen2_moe":  # transformers always builds the shared expert and its gate
            out["shared_expert_intermediate_size"] = int(text.get("shared_expert_intermediate_size") or 0)
            out["shared_expert_gate"] = True
    elif family in DEEPSEEK_ROUTED:
        out["moe_layers"] = max(0, layers - int(text.get("first_k_dense_replace") or 0))
        out["shared_expert_intermediate_size"] = int(width or 0) * int(text.get("n_shared_experts") or 0)
    elif family == "gpt_oss":
        out.update(router_bias=True, expert_bias=True, attention_sinks=True)
    elif family == "granitemoeshared":  # a dense MLP beside the experts, no gate on it
        out["shared_expert_intermediate_size"] = int(text.get("shared_intermediate_size") or 0)
    return out


def mla_fields(text: dict) -> dict:
    """DeepSeek's multi-head latent attention dimensions."""
    return {
        "q_lora_rank": int(text["q_lora_rank"]) if text.get("q_lora_rank") else None,
        "kv_lora_rank": int(text["kv_lora_rank"]),
        "qk_rope_head_dim": int(text["qk_rope_head_dim"]),
        "qk_nope_head_dim": int(text["qk_nope_head_dim"]),
        "v_head_dim": int(text["v_head_dim"]),
    }


# config.json keys a family's config class fills with its own defaults when they are absent
def sliding_fields(text: dict, *, family: Family) -> dict:
    """sliding_window, sliding_layers and attn_logit_softcap as transformers' config class of the family
    resolves them: an absent key takes the class default (Family.window, Family.softcap), an explicit null
    is none, and a family with Family.window_switch applies the window only under use_sliding_window.
    Which layers slide: the config's layer_types when present, else the class's rule (Family.slides)."""
    layers = int(text["num_hidden_layers"])
    softcap = text.get("attn_logit_softcapping", family.softcap)
    out = {"attn_logit_softcap": float(softcap)} if softcap else {}
    window = text.get("sliding_window", family.window)
    if family.window_switch and not text.get("use_sliding_window"):
        window = None
    if not window:
        return out
    if text.get("layer_types"):
        kinds = list(text["layer_types"])
    else:
        kinds = ["sliding_attention" if _slides(text, family, i, layers) else "full_attention" for i in range(layers)]
    sliding = sum(1 for t in kinds if t == "sliding_attention")
    if sliding:
        out.update(sliding_window=int(window), sliding_layers=sliding)
        if family.window_in_mask_only:
            out["window_in_mask_only"] = True
    return out


def _slides(text: dict, family: Family, i: int, layers: int) -> bool:
    """Whether layer i applies the window, by the family's rule (Family.slides) and config.json's keys."""
    rule = family.slides
    if rule == "pattern":
        pattern = text.get("sliding_window_pattern") or text.get("_sliding_window_pattern")
        # EXAONE-4 may spell its pattern as letters ("LLLG": three local layers, then a global one)
        pattern = len(pattern) if isinstance(pattern, str) else int(pattern or family.pattern)
        return bool((i + 1) % pattern)
    if rule in ("qwen", "qwen_moe"):
        top = int(text.get("max_window_layers") or 28)
        return i >= top if rule == "qwen" else bool((i + 1) % 2) and i < top
    if rule == "nope":  # SmolLM3 slides on its NoPE layers: no_rope_layers[i] == 0, by default every 4th
        every = int(text.get("no_rope_layer_interval") or 4)
        rope = text.get("no_rope_layers") or [int((k + 1) % every != 0) for k in range(layers)]
        return not rope[i]
    fixed = {"every": True, "odd": bool((i + 1) % 2), "every4": bool((i + 1) % 4), "cwm": bool(i % 4)}
    return fixed.get(rule, False)
