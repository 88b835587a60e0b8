"""Which checkpoints count, which one to resume from, whether resuming is safe, and retention.

The HF Trainer writes RUN_DIR/checkpoints/checkpoint-N; finetune's CommitCallback then marks it
complete (finetune/train/integrity.py) once every rank is done. Only marked checkpoints count:
resume skips the rest, retention (ours; the Trainer's save_total_limit is off) deletes only
complete checkpoints older than the newest `output.keep`, after a newer one is complete.

Pure Python: the API checks a resume before it launches anything.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

from finetune import strategies
from finetune.errors import RecipeError
from finetune.rundir import CHECKPOINTS
from finetune.train.integrity import (
    CONTENT_SUFFIX,
    GROWING_KEYS,
    LAYOUT_KEYS,
    _is_safe,
    read_marker,
    recipe_fields,
    verify,
)

log = logging.getLogger("finetune.train")
# DeepSpeed's checkpoints are partitioned per rank (ZeRO-2's optimizer states, ZeRO-3's everything)


def checkpoint_step(path: Path) -> int:
    match = re.fullmatch(r"checkpoint-(\d+)", Path(path).name)
    return int(match.group(1)) if match else -1


def is_complete(path: Path) -> bool:
    marker, _ = verify(path)
    return marker is not None and (Path(path) / "trainer_state.json").is_file()


def _all(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) >= 0), key=checkpoint_step)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    return [p for p in _all(run_dir) if is_complete(p)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    newest = None
    for path in reversed(_all(run_dir)):
        marker, why = verify(path)
        if marker is not None and (path / "trainer_state.json").is_file():
            newest = path
            break
        log.warning(f"skipping incomplete checkpoint {path}: {why or 'trainer_state.json is missing'}")
    return newest


def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(run_dir)
    path = Path(resume).expanduser().resolve()
    marker, why = verify(path) if path.is_dir() else (None, "not a directory")
    if marker is None or not (path / "trainer_state.json").is_file():
        raise RecipeError(f"--resume {resume}: not a complete checkpoint ({why or 'no trainer_state.json'})",
                          hint=f"use --resume auto, or one of {Path(run_dir) / CHECKPOINTS}/checkpoint-N "
                               f"that has finetune_complete.json")
    return path


def _remove(path: Path, why: str) -> None:
    log.warning(f"removing {path}: {why}")
    shutil.rmtree(path, ignore_errors=True)


def prepare_checkpoints(run_dir: Path, *, start: Path | None) -> None:
    """Before training (main process only): remove incomplete checkpoints, and complete ones from a
    future this run discards (newer than `start`, or all of them when starting over), so the Trainer
    never writes into a directory that still carries an old marker."""
    start_step = checkpoint_step(start) if start is not None else -1
    for path in _all(run_dir):
        if start is not None and path.resolve() == Path(start).resolve():
            continue
        if not is_complete(path):
            _remove(path, "an incomplete checkpoint (no commit marker; the save did not finish)")
        elif checkpoint_step(path) > start_step:
            _remove(path, "starting over (--resume never)" if start is None
                    else f"newer than the checkpoint this run resumes from ({start.name})")


def retain(run_dir: Path, *, keep: int, protect: str | None = None) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep` (called right after one is committed); the
    `protect`ed one (the best so far, for load_best_model_at_end) stays."""
    complete = complete_checkpoints(run_dir)
    old = [p for p in complete[:-max(keep, 1)] if protect is None or p.resolve() != Path(protect).resolve()]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def _fmt(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def compare_fields(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """(notes on safe changes, refused changes) between a saved run's recipe fields and this one's.
    A data content fingerprint counts only where both sides have one (Hub data is fingerprinted in
    the ranks, not before launch; older markers carry none)."""
    notes, refused = [], []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b or (key.endswith(CONTENT_SUFFIX) and (a is None or b is None)):
            continue
        change = f"{key} ({_fmt(a)} -> {_fmt(b)})"
        if key.endswith(CONTENT_SUFFIX):
            refused.append(f"{key.removesuffix(CONTENT_SUFFIX)}.path (same path, new content: "
                           f"{_fmt(a)} -> {_fmt(b)})")
        elif key in GROWING_KEYS:
            if a is not None and b is not None and b > a:
                notes.append(f"{change}: the run continues further; the learning-rate schedule is "
                             f"stretched to the new length")
            else:
                refused.append(change)
        elif _is_safe(key) or key in LAYOUT_KEYS:
            notes.append(change)
        else:
            refused.append(change)
    return notes, refused


def grown(old: dict, new: dict) -> bool:
    """A larger train.max_steps / train.epochs than the saved run's."""
    return any(old.get(k) is not None and new.get(k) is not None and new[k] > old[k] for k in GROWING_KEYS)


def check_resume(ckpt: Path, recipe, *, world_size: int | None = None, fields: dict | None = None) -> list[str]:
    """Refuse (RecipeError) to resume `ckpt` with a recipe whose training changed, or on another
    number of processes where the checkpoint format cannot follow; return notes on what changed
    safely. `fields` defaults to recipe_fields(recipe) (pass it with the data's content fingerprints)."""
    marker = read_marker(ckpt)
    if marker is None:
        raise RecipeError(f"{ckpt} has no commit marker", hint="resume from a complete checkpoint")
    notes, refused = compare_fields(marker.get("recipe_fields", {}),
                                    recipe_fields(recipe) if fields is None else fields)
    strategy = recipe.distributed.strategy
    if marker.get("strategy") not in (None, strategy) and not any(c.startswith("distributed.strategy")
                                                                   for c in refused):
        refused.append(f"distributed.strategy ({marker['strategy']!r} -> {strategy!r})")
    if refused:
        first = refused[0].split(" ")[0]
        raise RecipeError(
            f"cannot resume from {ckpt}: the recipe changed since it was saved: {'; '.join(refused)}",
            key=first, hint="change those keys back to resume, or start over with --resume never (or another "
                            "--output directory); logging, output.*, hub.*, eval/logging steps, timeouts "
                            "and a larger train.max_steps/epochs may change freely")
    saved_ws = marker.get("world_size")
    current_ws = world_size if world_size is not None else getattr(recipe.resolved, "world_size", saved_ws)
    if saved_ws is not None and current_ws is not None and saved_ws != current_ws:
        if strategies.is_deepspeed(strategy):
            raise RecipeError(
                f"cannot resume {ckpt} on {current_ws} processes: it was saved by DeepSpeed {strategy} on "
                f"{saved_ws}, and ZeRO checkpoints are partitioned per rank (zero_pp_rank_* files)",
                key="resolved.world_size",
                hint=f"resume on {saved_ws} processes, or convert it with DeepSpeed's ds_to_universal.py and "
                     f"load the result as a new model")
        how = ("the sharded (torch.distributed.checkpoint) state is resharded on load"
               if strategies.reshardable(strategy) else "a DDP checkpoint holds the full state")
        notes.append(f"world size {saved_ws} -> {current_ws}: {how}; the global batch stays "
                     f"train.global_batch_size, but the data order after the resume point differs from "
                     f"a run on {saved_ws} processes")
    return notes
