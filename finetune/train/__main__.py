"""Per-rank entrypoint.

    python -m finetune.train RUN_DIR/recipe.resolved.yaml [--resume auto|never|PATH]
    accelerate launch --config_file RUN_DIR/accelerate.yaml ... -m finetune.train RUN_DIR/recipe.resolved.yaml

--resume auto (default) continues from the newest complete checkpoint in RUN_DIR/checkpoints,
if any; never starts over; PATH names a checkpoint-N directory. A FinetuneError is printed
without a traceback and exits with its code (2 bad recipe/data, 4 training failed).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from pathlib import Path

# the launcher that started this rank, read before anything slow (only the package __init__ ran): if it is
# killed before main() asks for its death signal, the pid no longer matches and the rank stops (see main)
_LAUNCHER = os.getppid()

from finetune.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED  # noqa: E402
from finetune.train import collector  # noqa: E402


class StoppedBeforeTraining(BaseException):
    """A stop signal before training started (a BaseException, like KeyboardInterrupt, so no library's
    `except Exception` swallows it)."""


class _EarlyStop:
    """The rank's stop handler until the trainer's take over (finetune.train.signals.PreemptionCallback): one
    StoppedBeforeTraining, however many signals come (a killed launcher whose threads die one by one sends its
    parent-death SIGTERM once per thread; a repeat must not cut the record short).

    What the trainer's handlers read when they replace this one: `stopped`, a request whose exception was swallowed
    (raised inside a finalizer, which Python only reports), which still stops the run; and they set `training` once
    training begins. Their handlers are put back to this one as the rank ends, and a signal after that (torchrun's
    SIGTERM to the survivors of a dead rank, while this rank unwinds its own error) is no stop before training: the
    rank's own outcome stands."""

    def __init__(self):
        self.stopped: list[str] = []
        self.training = False

    def __call__(self, signum, _frame):
        if not (self.stopped or self.training):
            self.stopped.append(signal.Signals(signum).name)
            raise StoppedBeforeTraining(self.stopped[0])


def _report_early_stop(run_dir: Path, why: str) -> int:
    """Say in the run directory (the console may be gone: its death is what stopped us) that no step was
    trained, so there is no checkpoint to save, and exit EXIT_PREEMPTED."""
    from finetune.checkpoints.resume import resume_advice
    from finetune.errors import FinetuneError
    from finetune.rundir import write_rank_error

    err = FinetuneError(
        f"stopped by {why} before training started: no step was trained, so there was nothing to checkpoint",
        hint=resume_advice(run_dir),
    )
    try:
        write_rank_error(run_dir, exit_code=EXIT_PREEMPTED, message=err.render())
    except OSError:
        pass
    try:
        print(f"error: {err.render()}", file=sys.stderr, flush=True)
    except OSError:  # the console went with the launcher
        pass
    return EXIT_PREEMPTED


# True when this module is the process's entry point (the rank): it then owns the garbage collector's settings
_ENTRY_POINT = False


def _import_libraries():
    """run_rank, whose module imports torch, transformers, trl and peft; as the rank's entry point, with the
    collector held off while they load (finetune/train/collector.py)."""
    try:
        from finetune.train.run import run_rank
    finally:
        if _ENTRY_POINT:
            collector.loaded()
    return run_rank


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune.train", description=__doc__.splitlines()[0])
    parser.add_argument("resolved", help="RUN_DIR/recipe.resolved.yaml written by `finetune compile`/`run`")
    parser.add_argument(
        "--resume",
        default="auto",
        metavar="auto|never|PATH",
        help="auto: newest complete checkpoint (default); never: start over; or a checkpoint dir",
    )
    args = parser.parse_args(argv)
    run_dir = Path(args.resolved).resolve().parent
    from finetune.launch import PREEMPT_SIGNALS, die_with_parent

    handle = _EarlyStop()
    try:
        # until run_rank installs the handlers that save a checkpoint (finetune.train.signals), a stop request
        # ends the rank with a record that nothing was trained (SIGINT: KeyboardInterrupt, handled below)
        previous = {sig: signal.signal(sig, handle) for sig in PREEMPT_SIGNALS}
        try:
            # SIGTERM as soon as the launcher dies, not only once training runs; a launcher that died
            # before this request counts as the same stop (the kernel would never send it)
            if not die_with_parent(parent=_LAUNCHER):
                handle(signal.SIGTERM, None)
            from finetune.recipe.load import load_resolved_recipe
            from finetune.train.notices import quiet_unused_library_notices

            recipe = load_resolved_recipe(args.resolved)
            quiet_unused_library_notices(device=recipe.resolved.device, adapter=recipe.adapter.type)
            run_rank = _import_libraries()
            run_rank(args.resolved, resume=args.resume, recipe=recipe)
        except StoppedBeforeTraining as stop:
            return _report_early_stop(run_dir, str(stop))  # with the handler still in place
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    except KeyboardInterrupt:  # Ctrl-C before the trainer's handler was installed: nothing to save yet
        print(
            "error: interrupted before training started; nothing was written\n  fix: run the same command again",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_INTERRUPTED
    except Exception as exc:
        from finetune.train.failure import as_finetune_error

        if os.environ.get("FINETUNE_DEBUG"):
            traceback.print_exc()
        err = as_finetune_error(exc, run_dir=run_dir)
        print(f"error: {err.render()}", file=sys.stderr, flush=True)
        return err.exit_code
    return 0


if __name__ == "__main__":
    _ENTRY_POINT = True
    collector.hold_until_loaded()  # until _import_libraries
    collector.exit_rank(main())
