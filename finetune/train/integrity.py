"""The commit marker that makes a checkpoint count, and what it records.

A checkpoint-N directory counts only when `finetune_complete.json` is in it and every file it
lists is still there with the same size. The marker is written last (temp file, fsync, rename,
fsync of the directory) after every rank has finished writing its part, so a crash at any moment
leaves either a complete checkpoint or one without a marker, which resume skips.

Pure Python (no torch import): the API reads markers before anything is launched.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

MARKER = "finetune_complete.json"
MARKER_VERSION = 1
PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "bitsandbytes")

# Recipe keys that may change between a checkpoint and its resume without changing the training
# it continues: where and how often things are logged/saved/evaluated, publishing, and timeouts.
SAFE_KEYS = (
    "logging.", "hub.", "output.", "train.eval_steps", "train.logging_steps", "train.on_nonfinite",
    "train.max_bad_steps", "distributed.timeout_minutes", "distributed.nvme_path", "data.task_eval",
    "data.cache_dir", "data.allow_paths", "data.allow_outside", "hardware", "resolved.predicted_peak_gib",
    "resolved.hardware", "train.activation_checkpointing", "resolved.activation_checkpointing_by",
    # kernels that compute the same function (compile resolves them per machine: a resume on another
    # machine may get another attention kernel or no Liger)
    "model.attn_implementation", "train.liger", "adapter.cast_adapter_inputs",
    # what to do after an out-of-memory failure, and the measurement mode (which saves nothing)
    "train.oom_retries", "resolved.measure",
)
# Safe only when they grow: the run continues further with the same schedule of the steps it did.
GROWING_KEYS = ("train.max_steps", "train.epochs")
# How the global batch is laid out over processes; checked by the world-size rule instead.
LAYOUT_KEYS = ("resolved.world_size", "resolved.num_nodes", "resolved.gpus_per_node",
               "resolved.gradient_accumulation_steps", "train.micro_batch_size")


def package_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out: dict = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {}
        for i, item in enumerate(value):
            out.update(_flatten(item, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: value}


def recipe_fields(recipe) -> dict:
    """Every leaf of the resolved recipe as {"train.lr": 0.0002, ...} (JSON values)."""
    raw = recipe.model_dump(mode="json")
    # lists of sections (data.sources) are keyed by position, so a change names data.sources.0.path
    return _flatten(raw)


CONTENT_SUFFIX = ".content"  # data.sources.N.content: the fingerprint of the file's bytes (or Hub revision)


def data_fields(*, train: list[str], eval: list[str] = ()) -> dict:
    """The data's content fingerprints as recipe fields, so resume and rerun checks see a file replaced
    at the same path."""
    out = {f"data.sources.{i}{CONTENT_SUFFIX}": fp for i, fp in enumerate(train)}
    out.update({f"data.eval_sources.{i}{CONTENT_SUFFIX}": fp for i, fp in enumerate(eval)})
    return out


def _is_safe(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) or key.startswith(k + ".")
               for k in SAFE_KEYS)


def training_fields(fields: dict) -> dict:
    """The fields whose change makes a resumed run a different run (hashed into the marker)."""
    return {k: v for k, v in fields.items()
            if not _is_safe(k) and k not in GROWING_KEYS and k not in LAYOUT_KEYS}


def recipe_hash(fields: dict) -> str:
    text = json.dumps(training_fields(fields), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes renames/creations in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the data fsyncs still hold
        pass
    finally:
        os.close(fd)


def list_files(ckpt: Path) -> dict[str, int]:
    return {str(p.relative_to(ckpt)): p.stat().st_size for p in sorted(ckpt.rglob("*"))
            if p.is_file() and p.name != MARKER}


def write_marker(ckpt: Path, *, step: int, world_size: int, strategy: str, fields: dict) -> dict:
    """fsync every file of the checkpoint, then commit it by writing the marker atomically."""
    files = list_files(ckpt)
    for rel in files:
        fsync_path(ckpt / rel)
    for sub in sorted({p for p in ckpt.rglob("*") if p.is_dir()}, reverse=True):
        fsync_path(sub)
    marker = {"marker_version": MARKER_VERSION, "step": step, "world_size": world_size,
              "strategy": strategy, "versions": package_versions(), "recipe_hash": recipe_hash(fields),
              "recipe_fields": fields, "files": files, "written_at": time.time()}
    tmp = ckpt / f".{MARKER}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(marker, fh, indent=1, default=str)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, ckpt / MARKER)
    fsync_path(ckpt)
    fsync_path(ckpt.parent)
    return marker


def read_marker(ckpt: Path) -> dict | None:
    try:
        marker = json.loads((Path(ckpt) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and "step" in marker else None


def verify(ckpt: Path) -> tuple[dict | None, str | None]:
    """(marker, None) for a complete checkpoint; (None, why) otherwise."""
    ckpt = Path(ckpt)
    marker = read_marker(ckpt)
    if marker is None:
        return None, f"no readable {MARKER} (the save did not finish)"
    for rel, size in marker.get("files", {}).items():
        path = ckpt / rel
        if not path.is_file():
            return None, f"{rel} is missing"
        if path.stat().st_size != size:
            return None, f"{rel} has {path.stat().st_size} bytes, the marker recorded {size}"
    return marker, None
