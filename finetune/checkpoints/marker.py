"""The commit marker that makes a checkpoint count, and what it records.

A checkpoint-N directory counts only when `finetune_complete.json` is in it and every file it
lists is still there with the same size. The marker is written last (temp file, fsync, rename,
fsync of the directory) after every rank has finished writing its part, so a crash at any moment
leaves either a complete checkpoint or one without a marker, which resume skips.

No torch import: the launching process reads markers before anything is launched.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from finetune.checkpoints.fields import recipe_hash

MARKER = "finetune_complete.json"
MARKER_VERSION = 1
PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "bitsandbytes")


def package_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


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
    return {
        str(p.relative_to(ckpt)): p.stat().st_size for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name != MARKER
    }


def write_marker(ckpt: Path, *, step: int, world_size: int, strategy: str, fields: dict) -> dict:
    """fsync every file of the checkpoint, then commit it by writing the marker atomically."""
    files = list_files(ckpt)
    for rel in files:
        fsync_path(ckpt / rel)
    for sub in sorted({p for p in ckpt.rglob("*") if p.is_dir()}, reverse=True):
        fsync_path(sub)
    marker = {
        "marker_version": MARKER_VERSION,
        "step": step,
        "world_size": world_size,
        "strategy": strategy,
        "versions": package_versions(),
        "recipe_hash": recipe_hash(fields),
        "recipe_fields": fields,
        "files": files,
        "written_at": time.time(),
    }
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
