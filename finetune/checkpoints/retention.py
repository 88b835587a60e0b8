"""Which checkpoints stay on disk: before training, the incomplete ones and those of a discarded future go;
after each commit, the complete ones beyond the newest `output.keep` go. This is the only retention (the
Trainer's save_total_limit is off), so nothing deletes the checkpoint a resume relies on before a newer
one is complete.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from finetune.checkpoints.resume import all_checkpoints, checkpoint_step, complete_checkpoints, is_complete

log = logging.getLogger("finetune.checkpoints")


def _remove(path: Path, why: str) -> None:
    log.warning(f"removing {path}: {why}")
    shutil.rmtree(path, ignore_errors=True)


def prepare_checkpoints(run_dir: Path, *, start: Path | None) -> None:
    """Before training (main process only): remove incomplete checkpoints, and complete ones from a
    future this run discards (newer than `start`, or all of them when starting over), so the Trainer
    never writes into a directory that still carries an old marker."""
    start_step = checkpoint_step(start) if start is not None else -1
    for path in all_checkpoints(run_dir):
        if start is not None and path.resolve() == Path(start).resolve():
            continue
        if not is_complete(path):
            _remove(path, "an incomplete checkpoint (no commit marker; the save did not finish)")
        elif checkpoint_step(path) > start_step:
            _remove(
                path,
                "starting over (--resume never)"
                if start is None
                else f"newer than the checkpoint this run resumes from ({start.name})",
            )


def retain(run_dir: Path, *, keep: int, protect: str | None = None) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep` (called right after one is committed); the
    `protect`ed one (the best so far, for load_best_model_at_end) stays."""
    complete = complete_checkpoints(run_dir)
    old = [p for p in complete[: -max(keep, 1)] if protect is None or p.resolve() != Path(protect).resolve()]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old
