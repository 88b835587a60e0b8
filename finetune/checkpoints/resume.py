"""Which checkpoints count, which one a run resumes from, and whether resuming it is safe.

The HF Trainer writes RUN_DIR/checkpoints/checkpoint-N; the ranks' commit callback then marks it
complete (finetune/checkpoints/marker.py) once every rank is done. Only marked checkpoints count:
resume skips the rest.

No torch import: the launching process checks a resume before it launches anything.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from finetune import strategies
from finetune.checkpoints.fields import compare_fields, recipe_fields
from finetune.checkpoints.marker import MARKER, read_marker, verify
from finetune.errors import RecipeError
from finetune.rundir import CHECKPOINTS

log = logging.getLogger("finetune.checkpoints")
TRAINER_STATE = "trainer_state.json"  # the Trainer's own record, in every checkpoint it saves


def checkpoint_step(path: Path) -> int:
    match = re.fullmatch(r"checkpoint-(\d+)", Path(path).name)
    return int(match.group(1)) if match else -1


def why_incomplete(path: Path) -> str | None:
    """None for a complete checkpoint (its commit marker verifies and the Trainer's state is in it),
    else why it does not count."""
    marker, why = verify(path)
    if marker is None:
        return why
    if not (Path(path) / TRAINER_STATE).is_file():
        return f"{TRAINER_STATE} is missing"
    return None


def is_complete(path: Path) -> bool:
    return why_incomplete(path) is None


def all_checkpoints(run_dir: Path) -> list[Path]:
    """Every checkpoint-N directory, complete or not, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) >= 0), key=checkpoint_step)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    return [p for p in all_checkpoints(run_dir) if is_complete(p)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    for path in reversed(all_checkpoints(run_dir)):
        why = why_incomplete(path)
        if why is None:
            return path
        log.warning(f"skipping incomplete checkpoint {path}: {why}")
    return None


def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume).expanduser().resolve()
    why = why_incomplete(path) if path.is_dir() else "not a directory"
    if why is not None:
        raise RecipeError(
            f"--resume {resume}: not a complete checkpoint ({why})",
            hint=f"use --resume auto, or one of {Path(run_dir) / CHECKPOINTS}/checkpoint-N that has {MARKER}",
        )
    return path


def check_resume(ckpt: Path, recipe, *, world_size: int | None = None, fields: dict | None = None) -> list[str]:
    """Refuse (RecipeError) to resume `ckpt` with a recipe whose training changed, or on another
    number of processes where the checkpoint format cannot follow; return notes on what changed
    safely. `fields` defaults to recipe_fields(recipe) (pass it with the data's content fingerprints)."""
    marker = read_marker(ckpt)
    if marker is None:
        raise RecipeError(f"{ckpt} has no commit marker", hint="resume from a complete checkpoint")
    notes, refused = compare_fields(
        marker.get("recipe_fields", {}), recipe_fields(recipe) if fields is None else fields
    )
    strategy = recipe.distributed.strategy
    if marker.get("strategy") not in (None, strategy) and not any(
        c.startswith("distributed.strategy") for c in refused
    ):
        refused.append(f"distributed.strategy ({marker['strategy']!r} -> {strategy!r})")
    if refused:
        first = refused[0].split(" ")[0]
        raise RecipeError(
            f"cannot resume from {ckpt}: the recipe changed since it was saved: {'; '.join(refused)}",
            key=first,
            hint="change those keys back to resume, or start over with --resume never (or another "
            "--output directory); logging, output.*, hub.*, eval/logging steps, timeouts "
            "and a larger train.max_steps/epochs may change freely",
        )
    saved_ws = marker.get("world_size")
    current_ws = world_size if world_size is not None else getattr(recipe.resolved, "world_size", saved_ws)
    if saved_ws is not None and current_ws is not None and saved_ws != current_ws:
        if strategies.is_deepspeed(strategy):
            raise RecipeError(
                f"cannot resume {ckpt} on {current_ws} processes: it was saved by DeepSpeed {strategy} on "
                f"{saved_ws}, and ZeRO checkpoints are partitioned per rank (zero_pp_rank_* files)",
                key="resolved.world_size",
                hint=f"resume on {saved_ws} processes, or convert it with DeepSpeed's ds_to_universal.py and "
                f"load the result as a new model",
            )
        how = (
            "the sharded (torch.distributed.checkpoint) state is resharded on load"
            if strategies.reshardable(strategy)
            else "a DDP checkpoint holds the full state"
        )
        notes.append(
            f"world size {saved_ws} -> {current_ws}: {how}; the global batch stays "
            f"train.global_batch_size, but the data order after the resume point differs from "
            f"a run on {saved_ws} processes"
        )
    return notes


def resume_advice(run_dir: Path) -> str:
    """What to tell a user whose run stopped: which checkpoint running again resumes from."""
    done = complete_checkpoints(run_dir)
    if done:
        return f"run the same command again to resume from {done[-1].name}"
    return "run the same command again (no checkpoint was saved, so it starts from step 0)"
