"""Per-rank entrypoint.

    python -m finetune.train RUN_DIR/recipe.resolved.yaml [--resume auto|never|PATH]
    accelerate launch --config_file RUN_DIR/accelerate.yaml ... -m finetune.train RUN_DIR/recipe.resolved.yaml

--resume auto (default) continues from the newest complete checkpoint in RUN_DIR/checkpoints,
if any; never starts over; PATH names a checkpoint-N directory. A FinetuneError is printed
without a traceback and exits with its code (2 bad recipe/data, 4 training failed).
"""

from __future__ import annotations

import argparse
import sys

from finetune.errors import FinetuneError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m finetune.train", description=__doc__.splitlines()[0])
    parser.add_argument("resolved", help="RUN_DIR/recipe.resolved.yaml written by `finetune compile`/`run`")
    parser.add_argument("--resume", default="auto", metavar="auto|never|PATH",
                        help="auto: newest complete checkpoint (default); never: start over; or a checkpoint dir")
    args = parser.parse_args(argv)
    from finetune.train.run import run_rank

    try:
        run_rank(args.resolved, resume=args.resume)
    except FinetuneError as err:
        print(f"error: {err.render()}", file=sys.stderr, flush=True)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
