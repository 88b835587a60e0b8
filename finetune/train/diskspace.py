"""Disk space inside the ranks: checked before every checkpoint, and a final save that never leaves the
run with neither the old nor the new weights.

- Before each save the ranks agree (one all-reduce) whether RUN_DIR's filesystem has room for a
  checkpoint (the size of the newest complete one, else the planner's estimate); if not, the run stops
  with a clear error before writing, and the newest complete checkpoint stays usable.
- The final model is written into RUN_DIR/.final-save and then moved into place file by file, so a
  failed write never replaces the previous weights with a truncated file. When RUN_DIR's disk has no
  room (or the write fails with ENOSPC), the weights go to the rescue directory instead
  ($FINETUNE_RESCUE_DIR, else the temp dir) and the error names it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

from transformers import TrainerCallback

from finetune import rundir, strategies
from finetune.errors import TrainingFailed, is_disk_full
from finetune.prelaunch import free_bytes, rescue_dir
from finetune.prelaunch import output_bytes as planned_bytes
from finetune.train.callbacks import reduce_flags
from finetune.train.saved_dtype import final_save_dtype

log = logging.getLogger("finetune.train")
FINAL_STAGING = ".final-save"
SAVE_SLACK_BYTES = 4 * 1024 * 1024  # trainer_state.json, rng files, the marker, a metrics row


def output_bytes(recipe, run_dir: Path) -> tuple[int, int]:
    """(final save, checkpoint) estimated from RUN_DIR/plan.json's parameter counts."""
    try:
        plan = json.loads((Path(run_dir) / rundir.PLAN_JSON).read_text())
    except (OSError, ValueError):
        plan = {}
    counts = {k: plan.get(k, 0) for k in ("total_params", "trainable_params")}
    return planned_bytes(SimpleNamespace(**counts, strategy=plan.get("strategy")), recipe)


def _newest_size(run_dir: Path) -> int | None:
    from finetune.checkpoints.marker import read_marker
    from finetune.checkpoints.resume import complete_checkpoints

    done = complete_checkpoints(run_dir)
    marker = read_marker(done[-1]) if done else None
    return sum(marker.get("files", {}).values()) if marker else None


def disk_full_error(run_dir: Path, *, free: int, need: int, what: str) -> TrainingFailed:
    from finetune.checkpoints.resume import complete_checkpoints

    done = complete_checkpoints(run_dir)
    kept = f"{done[-1].name} is complete and stays usable" if done else "no complete checkpoint exists yet"
    return TrainingFailed(
        f"disk full: {free / 2**20:.1f} MiB free in {run_dir}, {what} needs about "
        f"{need / 2**20:.1f} MiB; stopped before writing it ({kept})",
        key="output.dir",
        hint="free disk space there (or lower output.keep), then run the same command "
        "again" + (" to resume" if done else ""),
    )


class DiskSpaceCallback(TrainerCallback):
    """Stops the run with a clear error before a checkpoint that cannot fit is written."""

    def __init__(self, run_dir: Path, *, estimate: int):
        self.run_dir, self.estimate = Path(run_dir), estimate

    def on_step_end(self, args, state, control, **kwargs):
        if not control.should_save:
            return control
        need = (_newest_size(self.run_dir) or self.estimate) + SAVE_SLACK_BYTES
        free = free_bytes(self.run_dir)
        if reduce_flags([1.0 if free < need else 0.0])[0]:
            raise disk_full_error(self.run_dir, free=free, need=need, what=f"checkpoint-{state.global_step}")
        return control


def _save_into(trainer, tokenizer, target: Path, *, state, dtype=None) -> None:
    trainer.final_dtype = dtype  # a full fine-tune's weights in model.dtype, not FSDP's fp32 masters
    try:
        trainer.save_model(str(target))  # every rank: FSDP/ZeRO-3 gather the weights collectively
    finally:
        trainer.final_dtype = None
    if state.is_main_process:
        tokenizer.save_pretrained(target)


def save_final(trainer, tokenizer, *, recipe, run_dir: Path, state) -> None:
    """Save the trained model or adapter into RUN_DIR, or into the rescue directory when RUN_DIR's disk
    is full (then raise TrainingFailed naming it)."""
    staging = run_dir / FINAL_STAGING
    need = output_bytes(recipe, run_dir)[0] + SAVE_SLACK_BYTES
    short = reduce_flags([1.0 if free_bytes(run_dir) < need else 0.0])[0]
    target = rescue_dir(run_dir) if short else staging
    dtype = final_save_dtype(recipe)  # a full fine-tune's weights in model.dtype (train/saved_dtype.py)
    if state.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)  # a save cut short by a kill
    state.wait_for_everyone()
    try:
        _save_into(trainer, tokenizer, target, state=state, dtype=dtype)
    except OSError as exc:
        sharded = state.num_processes > 1 and strategies.info(recipe.distributed.strategy).backend != "ddp"
        if not is_disk_full(exc) or target != staging or sharded:
            raise
        shutil.rmtree(staging, ignore_errors=True)  # give the space back before trying elsewhere
        target = rescue_dir(run_dir)
        if state.is_main_process:  # DDP: the main process alone holds and writes the full weights
            _save_into(trainer, tokenizer, target, state=state, dtype=dtype)
    state.wait_for_everyone()
    if target != staging:
        raise TrainingFailed(
            f"disk full: the trained {'model' if recipe.adapter.type == 'full' else 'adapter'} "
            f"did not fit in {run_dir} ({free_bytes(run_dir) / 2**20:.1f} MiB free, about "
            f"{need / 2**20:.1f} MiB needed), so it was saved to {target}",
            key="output.dir",
            hint=f"free disk space, then move the files of {target} into {run_dir} (training "
            f"is done: nothing needs to run again)",
        )
    if state.is_main_process:
        for item in sorted(staging.iterdir()):
            if item.is_dir() and (run_dir / item.name).is_dir():
                shutil.rmtree(run_dir / item.name)
            os.replace(item, run_dir / item.name)
        staging.rmdir()
    state.wait_for_everyone()
