"""Atomic file writes for the run directory (temp file in the same dir + os.replace).

A crash or a concurrent reader never sees a half-written config, and files we do not
name (checkpoints, adapters) are never touched.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import yaml


def write_atomic(path: Path, text: str, *, executable: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o755 if executable else 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def yaml_text(data: dict, *, header: str = "") -> str:
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)
    if header:
        comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
        return comment + body
    return body


def json_text(data: dict) -> str:
    return json.dumps(data, indent=2) + "\n"
