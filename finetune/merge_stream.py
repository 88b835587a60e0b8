"""Fold a LoRA/DoRA adapter into a base checkpoint one tensor at a time (`finetune merge`'s path).

Host RAM stays at about one output shard (`max_shard_size`) plus one weight matrix and its delta, not
the model: a 70B merge needs a few GB instead of 140 GB. The base's safetensors shards are read
tensor by tensor; each weight that the adapter targets is wrapped, alone, in a one-module skeleton on
which peft itself injects the adapter (`inject_adapter_in_model`: its target matching, rank/alpha
patterns, rsLoRA scaling, DoRA), loads the adapter's tensors for that module
(`set_peft_model_state_dict`) and merges (`merge(safe_merge=True)`), so the arithmetic is peft's, not a
copy of it. Adapters this path does not cover (modules_to_save, trainable tokens, LoRA biases, non-
Linear/Embedding targets, target_parameters) go through peft's whole-model merge instead (`streamable` says why).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

SAFE_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
ADAPTER_PREFIX = "base_model.model."
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: str | int) -> int:
    """'5GB' / '200KB' / 1000 -> bytes (the units transformers' max_shard_size accepts)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B)\s*", size.upper())
    if not match:
        raise ValueError(f"cannot read shard size {size!r}; write it like 5GB or 500MB")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def streamable(adapter_config: dict) -> str:
    """ "" when the streaming merge covers this adapter, else why not."""
    if adapter_config.get("peft_type", "LORA") != "LORA":
        return f"peft_type {adapter_config.get('peft_type')}"
    for key in ("modules_to_save", "trainable_token_indices"):
        if adapter_config.get(key):
            return key
    if adapter_config.get("lora_bias"):
        return "lora_bias"
    if adapter_config.get("target_parameters"):  # adapter.target_experts: parameters, not modules, are adapted
        return "target_parameters"
    return ""


def base_shards(base_dir: Path) -> list[Path]:
    index = base_dir / SAFE_INDEX
    if index.is_file():
        names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [base_dir / n for n in names]
    if (base_dir / SINGLE_FILE).is_file():
        return [base_dir / SINGLE_FILE]
    return []


def adapter_tensors(run_dir: Path) -> dict[str, dict[str, object]]:
    """The adapter's tensors grouped by the base module they belong to ('model.layers.0.mlp.up_proj')."""
    from safetensors.torch import load_file

    grouped: dict[str, dict[str, object]] = {}
    for key, value in load_file(str(run_dir / "adapter_model.safetensors")).items():
        key = key.removeprefix(ADAPTER_PREFIX)
        match = re.match(r"(.+?)\.(lora_\w+?)(\.|$)", key)
        if not match:
            raise ValueError(f"unexpected adapter tensor {key!r}")
        grouped.setdefault(match.group(1), {})[key] = value
    return grouped


class ShardWriter:
    """Accumulates tensors and writes safetensors shards of at most `max_bytes` (and the index)."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, object] = {}
        self.pending_bytes = 0
        self.files: list[list[str]] = []
        self.total = 0

    def add(self, name: str, tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        save_file(self.pending, str(self.out / f"part-{len(self.files)}.safetensors"), metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Rename the parts to transformers' shard names and write the index."""
        self.flush()
        n = len(self.files)
        weight_map = {}
        for i, names in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else SINGLE_FILE
            (self.out / f"part-{i}.safetensors").rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        if n > 1:
            (self.out / SAFE_INDEX).write_text(
                json.dumps({"metadata": {"total_size": self.total}, "weight_map": weight_map}, indent=2) + "\n"
            )


def _skeleton(module_name: str, weight, *, embedding: bool):
    """A module tree with one leaf at `module_name` (Linear or Embedding) holding `weight`."""
    import torch

    root = torch.nn.Module()
    parent = root
    *path, leaf = module_name.split(".")
    for part in path:
        child = torch.nn.Module()
        parent.add_module(part, child)
        parent = child
    if embedding:
        layer = torch.nn.Embedding(weight.shape[0], weight.shape[1], device="meta")
    else:
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    parent.add_module(leaf, layer)
    return root, layer


def merge_module(module_name: str, weight, tensors: dict, config) -> object:
    """`weight` with the adapter's update for `module_name` folded in by peft's own layer merge."""
    from peft import inject_adapter_in_model, set_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    embedding = any(".lora_embedding_" in k for k in tensors)
    root, _ = _skeleton(module_name, weight, embedding=embedding)
    with warnings.catch_warnings():
        # a one-module skeleton matches none of the rank/alpha patterns meant for the other modules
        warnings.filterwarnings("ignore", message=".*pattern keys did not match any targeted module")
        inject_adapter_in_model(config, root, adapter_name="default")
    layers = [m for m in root.modules() if isinstance(m, LoraLayer)]
    if len(layers) != 1:
        raise ValueError(f"the adapter has weights for {module_name} but its target_modules do not match it")
    result = set_peft_model_state_dict(root, tensors, adapter_name="default")
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"adapter tensors not used for {module_name}: {result.unexpected_keys}")
    layer = layers[0]
    layer.to(weight.dtype)
    layer.merge(safe_merge=True)
    return layer.get_base_layer().weight.data


def merge_checkpoint(*, base_dir: Path, run_dir: Path, out: Path, dtype: str, max_shard_size: str | int) -> int:
    """Write base + adapter into `out` as safetensors shards; returns the number of merged modules."""
    import torch
    from peft import LoraConfig
    from safetensors import safe_open

    config = LoraConfig.from_pretrained(str(run_dir))
    config.inference_mode = True
    by_module = adapter_tensors(run_dir)
    target_dtype = getattr(torch, dtype)
    writer = ShardWriter(out, parse_size(max_shard_size))
    merged = set()
    for shard in base_shards(base_dir):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.is_floating_point():
                    tensor = tensor.to(target_dtype)
                module = name.removesuffix(".weight")
                if name.endswith(".weight") and module in by_module:
                    tensor = merge_module(module, tensor, by_module[module], config)
                    merged.add(module)
                writer.add(name, tensor)
    missing = sorted(set(by_module) - merged)
    if missing:
        raise ValueError(f"the base checkpoint has no weight for adapter module(s) {', '.join(missing[:3])}")
    writer.finish()
    return len(merged)
