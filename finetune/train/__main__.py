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
import sys
import traceback

# the launcher that started this rank, read before the first slow import: if it is killed before
# main() asks for its death signal, the pid no longer matches and the rank does not start (see main)
_LAUNCHER = os.getppid()

from finetune.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED  # noqa: E402


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
    from finetune.launch import die_with_parent

    # SIGTERM as soon as the launcher dies (until training can save, its default action: exit at once,
    # with nothing trained to lose); a rank orphaned earlier stops here instead of training unwatched
    if not die_with_parent(parent=_LAUNCHER):
        return EXIT_PREEMPTED
    try:
        from finetune.train.run import run_rank

        run_rank(args.resolved, resume=args.resume)
    except KeyboardInterrupt:  # Ctrl-C before the trainer's handler was installed: nothing to save yet
        print(
            "error: interrupted before training started; nothing was written\n  fix: run the same command again",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_INTERRUPTED
    except Exception as exc:
        from pathlib import Path

        from finetune.train.failure import as_finetune_error

        if os.environ.get("FINETUNE_DEBUG"):
            traceback.print_exc()
        err = as_finetune_error(exc, run_dir=Path(args.resolved).resolve().parent)
        print(f"error: {err.render()}", file=sys.stderr, flush=True)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
