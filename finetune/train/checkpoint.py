"""Which checkpoint to resume from: --resume auto | never | PATH."""

from __future__ import annotations

import re
from pathlib import Path

from finetune.errors import RecipeError

CHECKPOINTS = "checkpoints"  # Trainer's checkpoint-N dirs live in RUN_DIR/checkpoints/


def is_complete(path: Path) -> bool:
    # the Trainer writes trainer_state.json last, so its presence means the save finished
    return (path / "trainer_state.json").is_file()


def checkpoint_step(path: Path) -> int:
    match = re.fullmatch(r"checkpoint-(\d+)", path.name)
    return int(match.group(1)) if match else -1


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return None
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) >= 0 and is_complete(p)]
    return max(found, key=checkpoint_step) if found else None


def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume).expanduser().resolve()
    if not path.is_dir() or not is_complete(path):
        raise RecipeError(f"--resume {resume}: not a complete checkpoint (a checkpoint-N directory with "
                          f"trainer_state.json)",
                          hint=f"use --resume auto, or one of {Path(run_dir) / CHECKPOINTS}/checkpoint-N")
    return path
