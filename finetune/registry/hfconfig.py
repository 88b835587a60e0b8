"""A transformers config.json for a registry architecture: what scripts/make_random_model.py writes for the GPU
machines' random-weight models, and what finetune/hostprobe.py builds its probe layer from where a run's model has
no config.json on this machine (a `model.arch` registry key). Pure: no torch or transformers import."""

from __future__ import annotations

from finetune.registry.schema import ModelArch

INITIALIZER_RANGE = 0.02  # transformers' default initializer_range: the random weights' standard deviation


def hf_config(arch: ModelArch) -> dict:
    """A transformers config.json for a registry architecture (Llama-family fields; the family's own
    config class fills the rest with its defaults). What changes memory and speed is written out even
    where it is none, because the config classes' defaults are not the published models' (MistralConfig
    defaults sliding_window to 4096, Mistral-7B-v0.3 has none; Gemma3TextConfig defaults 4096, Gemma-3
    has 1024): the sliding window (null when the registry has none), which layers slide (layer_types),
    and the attention logit soft-capping."""
    cfg = {
        "architectures": ["LlamaForCausalLM"] if arch.family == "llama" else None,
        # Gemma-3's top-level model_type is the multimodal wrapper; the language model alone is gemma3_text
        "model_type": "gemma3_text" if arch.family == "gemma3" else arch.family,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "vocab_size": arch.vocab_size,
        "tie_word_embeddings": arch.tied_embeddings,
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "initializer_range": INITIALIZER_RANGE,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if arch.head_dim:
        cfg["head_dim"] = arch.head_dim
    if arch.num_experts > 1:  # Mixtral's names for the expert counts
        cfg["num_local_experts"] = arch.num_experts
        cfg["num_experts_per_tok"] = arch.experts_per_token
    if arch.family == "llama":
        cfg["rope_theta"] = 500000.0
    cfg = {k: v for k, v in cfg.items() if v is not None}
    if arch.family != "llama":  # LlamaConfig has neither key
        cfg.update(attention_window_fields(arch))
    return cfg


def attention_window_fields(arch: ModelArch) -> dict:
    """sliding_window (None when the registry has none), use_sliding_window (Qwen's switch), layer_types
    with the registry's count of sliding layers, the global ones evenly spaced as the families place them
    (Gemma-2 every 2nd, Gemma-3 every 6th), and attn_logit_softcapping (None when the registry has none)."""
    out: dict[str, object] = {
        "sliding_window": arch.sliding_window if arch.sliding_layers else None,
        "attn_logit_softcapping": arch.attn_logit_softcap,
    }
    if arch.family.startswith("qwen"):
        out["use_sliding_window"] = bool(out["sliding_window"])
    if out["sliding_window"] and arch.family != "mistral":  # MistralConfig slides every layer, no layer_types
        layers, sliding = arch.num_layers, min(arch.sliding_layers, arch.num_layers)
        period = layers // (layers - sliding) if sliding < layers else layers + 1
        types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]
        if types.count("sliding_attention") != sliding:
            raise ValueError(f"{arch.key}: {sliding} sliding layers of {layers} are not an evenly spaced pattern")
        out["layer_types"] = types
    return out
