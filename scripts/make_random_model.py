"""Write a real architecture (e.g. Llama-3.1-8B's shape) with random weights to a local directory.

The GPU machine has no Hub access and no weights; throughput and memory do not depend on the
weight values, so benchmarks and validation runs train these. The tokenizer is the tiny offline
one (its ids are a subset of the model's vocabulary, which keeps the full-size embedding).

    python scripts/make_random_model.py llama-3.1-8b /tmp/models/llama-3.1-8b [--device cuda]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def hf_config(arch) -> dict:
    """A transformers config.json for a registry architecture (Llama-family fields)."""
    cfg = {
        "architectures": ["LlamaForCausalLM"] if arch.family == "llama" else None,
        "model_type": arch.family,
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
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if arch.head_dim:
        cfg["head_dim"] = arch.head_dim
    if arch.family == "llama":
        cfg["rope_theta"] = 500000.0
    return {k: v for k, v in cfg.items() if v is not None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("arch", help="registry key, e.g. llama-3.1-8b")
    parser.add_argument("out")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokenizer", default=str(ROOT / "data" / "tiny-llama"))
    args = parser.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.registry import get_model

    out = Path(args.out)
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        print(f"{out}: already there")
        return
    out.mkdir(parents=True, exist_ok=True)
    arch = get_model(args.arch)
    config = AutoConfig.for_model(**hf_config(arch))
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="5GB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        src = Path(args.tokenizer) / name
        if src.exists():
            shutil.copy(src, out / name)
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.arch}: {n / 1e9:.2f}B parameters written to {out} in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
