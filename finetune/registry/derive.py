"""Derive a ModelArch from a model's config.json with plain json (no transformers, no torch).

Handles the key spellings of the families we support (llama, mistral, qwen2, qwen3, gemma2, gemma3,
mixtral) and the multimodal nesting (`text_config`) of Gemma 3; other decoder-only models work when
they use the same standard keys.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import ValidationError

from finetune.errors import RecipeError
from finetune.recipe.paths import anchored
from finetune.registry.schema import ModelArch

DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# transformers 5 stores MoE experts as fused 3D parameters, which LoRA cannot target by module name
MOE_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
_LAYER_CLASS = {
    "llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "qwen2": "Qwen2DecoderLayer",
    "qwen3": "Qwen3DecoderLayer", "gemma": "GemmaDecoderLayer", "gemma2": "Gemma2DecoderLayer",
    "gemma3": "Gemma3DecoderLayer", "gemma3_text": "Gemma3DecoderLayer",
    "mixtral": "MixtralDecoderLayer", "qwen3_moe": "Qwen3MoeDecoderLayer", "phi3": "Phi3DecoderLayer",
}
_BIAS_FAMILIES = {"qwen2"}  # q/k/v biases are implicit in these families


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
        raise RecipeError(f"cannot read the model's config.json: {exc}", file=str(path),
                          hint="point model.name at a directory with a valid config.json") from None
    if not isinstance(cfg, dict):
        raise RecipeError("config.json is not a JSON object", file=str(path))
    top_family = cfg.get("model_type", "")
    text: dict = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    family = top_family or text.get("model_type", "")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size", "vocab_size") if k not in text]
    if missing:
        raise RecipeError(f"config.json lacks {', '.join(missing)}; not a decoder-only LM the planner "
                          f"knows", file=str(path),
                          hint="set model.arch to the closest registry entry (finetune models)")
    heads = int(text["num_attention_heads"])
    experts = int(text.get("num_local_experts") or text.get("num_experts") or 1)
    per_token = int(text.get("num_experts_per_tok") or (2 if experts > 1 else 1))
    tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings",
                                                   family.startswith("gemma")))
    architectures = cfg.get("architectures") or []
    layer_class = _LAYER_CLASS.get(family) or _LAYER_CLASS.get(text.get("model_type", ""))
    if layer_class is None and architectures:
        layer_class = architectures[0].replace("ForCausalLM", "DecoderLayer")
    try:
        return ModelArch(
            key=key, hub_ids=[hub_id] if hub_id else [], family=family or "unknown",
            hidden_size=int(text["hidden_size"]), num_layers=int(text["num_hidden_layers"]),
            num_attention_heads=heads,
            # no num_key_value_heads means multi-head attention (one kv head per query head)
            num_kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text["head_dim"]) if text.get("head_dim") else None,
            intermediate_size=int(text["intermediate_size"]), vocab_size=int(text["vocab_size"]),
            tied_embeddings=bool(tied),
            attention_bias=bool(text.get("attention_bias", family in _BIAS_FAMILIES)),
            max_position_embeddings=int(text.get("max_position_embeddings") or 8192),
            num_experts=experts, experts_per_token=min(per_token, experts),
            decoder_layer_class=layer_class or "DecoderLayer",
            lora_targets=MOE_LORA_TARGETS if experts > 1 else DEFAULT_LORA_TARGETS,
            notes=f"derived from {path}",
        )
    except (ValidationError, TypeError, ValueError) as exc:
        raise RecipeError(f"config.json has values the planner cannot use: {exc}", file=str(path),
                          hint="set model.arch to the closest registry entry (finetune models)") from None
