"""Write a real architecture (e.g. Llama-3.3-70B's shape) with random weights to a local directory.

The GPU machine has no Hub access and no weights; throughput and memory do not depend on the
weight values, so benchmarks and validation runs train these. The tokenizer is the tiny offline
one (its ids are a subset of the model's vocabulary, which keeps the full-size embedding).

The checkpoint is written shard by shard: the model is built on the meta device (shapes only), then
each ~5 GB safetensors shard is drawn, written and dropped, so no process (and no GPU) ever holds the
whole model: a 70B checkpoint needs one shard of memory, not 141 GB. Weights are drawn like
transformers' `_init_weights` for Llama-family models: normal(0, initializer_range) for matrices and
embeddings, ones for norm weights, zeros for biases.

    python scripts/make_random_model.py llama-3.3-70b /tmp/models/llama-3.3-70b [--device cuda]

With --config-only it writes the config and tokenizer and no weights: a directory for `model.init: random`
runs, which build their weights themselves (a 405B's 810 GB checkpoint fits no lent machine's disk).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from finetune.registry.hfconfig import INITIALIZER_RANGE, hf_config  # noqa: E402

SHARD_BYTES = 5 * 10**9


def tensor_shapes(config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor save_pretrained would write, from a meta-device model."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    seen: set[int] = set()
    out = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied weights (lm_head = embed_tokens) are stored once
            continue
        seen.add(id(tensor))
        out.append((name, tuple(tensor.shape)))
    return out


def plan_shards(
    shapes: list[tuple[str, tuple[int, ...]]], *, element_bytes: int, shard_bytes: int = SHARD_BYTES
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive tensors grouped into shards of at most `shard_bytes` (a larger tensor gets its own)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        n = element_bytes
        for d in shape:
            n *= d
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    return shards


def draw(name: str, shape: tuple[int, ...], *, generator, device: str):
    import torch

    if name.endswith("bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if len(shape) == 1:  # RMSNorm / LayerNorm weights
        return torch.ones(shape, dtype=torch.bfloat16)
    t = torch.empty(shape, dtype=torch.bfloat16, device=device)
    t.normal_(0.0, INITIALIZER_RANGE, generator=generator)
    return t.cpu()


def write_random_checkpoint(
    config, out: Path, *, device: str = "cpu", seed: int = 0, shard_bytes: int = SHARD_BYTES, writers: int = 4
) -> tuple[int, int]:
    """Write `config`'s model with random bf16 weights into `out` shard by shard; (params, bytes)."""
    import torch
    from safetensors.torch import save_file

    shapes = tensor_shapes(config)
    shards = plan_shards(shapes, element_bytes=2, shard_bytes=shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0

    def write(i: int) -> int:
        generator = torch.Generator(device=device).manual_seed(seed + i)
        tensors = {name: draw(name, shape, generator=generator, device=device) for name, shape in shards[i]}
        part = out / (names[i] + ".partial")
        save_file(tensors, str(part), metadata={"format": "pt"})
        part.rename(out / names[i])
        return sum(t.numel() for t in tensors.values())

    # a few shards in flight: drawing (GPU or CPU) overlaps with the disk writes of the others
    with ThreadPoolExecutor(max_workers=writers) as pool:
        params = sum(pool.map(write, range(len(shards))))
    for i, shard in enumerate(shards):
        for name, _ in shard:
            weight_map[name] = names[i]
    total = 2 * params
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    config.save_pretrained(out)  # config.json last: its presence marks a finished checkpoint
    return params, total


def write_tokenizer(source: Path, config, out: Path) -> None:
    """The tiny tokenizer of `source`, saved as transformers loads it for `config`'s model type. AutoTokenizer
    picks the tokenizer class by model type, and a class may rebuild tokenizer.json's pipeline its own way
    (transformers 5: qwen2's Qwen2Tokenizer makes 17% fewer tokens of the tiny files), while the planner counts
    with tokenizer.json (finetune/data/lengths.py). Saved as the class built it, the two count alike, as they do
    on a real checkpoint, whose tokenizer.json is its class's own."""
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (source / name).exists():
                shutil.copy(source / name, Path(tmp) / name)
        config.save_pretrained(tmp)  # the model type AutoTokenizer maps to a class
        AutoTokenizer.from_pretrained(tmp).save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "arch",
        help="registry key, e.g. llama-3.1-8b, or a config.json path (any architecture "
        "transformers builds, e.g. a mixture-of-experts config)",
    )
    parser.add_argument("out")
    parser.add_argument("--device", default=None, help="where weights are drawn (default: cuda if available)")
    parser.add_argument("--tokenizer", default=str(ROOT / "data" / "tiny-llama"))
    parser.add_argument("--config-only", action="store_true", help="no weights (for model.init: random runs)")
    args = parser.parse_args()

    import torch
    from transformers import AutoConfig

    from finetune.registry import get_model

    out = Path(args.out)
    if (out / "config.json").exists() and (args.config_only or any(out.glob("*.safetensors"))):
        print(f"{out}: already there")
        return
    out.mkdir(parents=True, exist_ok=True)
    if args.arch.endswith(".json"):
        config = AutoConfig.for_model(**json.loads(Path(args.arch).read_text()))
    else:
        config = AutoConfig.for_model(**hf_config(get_model(args.arch)))
    write_tokenizer(Path(args.tokenizer), config, out)
    if args.config_only:
        config.save_pretrained(out)
        print(f"{args.arch}: config and tokenizer written to {out} (no weights)")
        return
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    params, nbytes = write_random_checkpoint(config, out, device=device)
    seconds = time.perf_counter() - start
    print(
        f"{args.arch}: {params / 1e9:.2f}B parameters ({nbytes / 1e9:.1f} GB) written to {out} "
        f"in {seconds:.0f}s ({nbytes / 1e9 / max(seconds, 1e-9):.2f} GB/s)"
    )


if __name__ == "__main__":
    main()
