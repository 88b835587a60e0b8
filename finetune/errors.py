"""One user-facing error type. The CLI prints it without a traceback."""

from __future__ import annotations

import errno

# Exit codes the CLI uses; documented in the README.
EXIT_USAGE = 2  # bad recipe, bad data, bad arguments
EXIT_DOES_NOT_FIT = 3  # the planner found no strategy that fits
EXIT_TRAINING_FAILED = 4  # a rank failed during training
EXIT_INTERRUPTED = 130  # Ctrl-C: a checkpoint was saved (once) or the run stopped at once (twice)
EXIT_PREEMPTED = 75  # saved a checkpoint on SIGTERM/SIGUSR1; requeue (EX_TEMPFAIL)


class FinetuneError(Exception):
    """A problem the user can fix: names where it is (key path or file) and how to fix it."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, *, key: str | None = None, file: str | None = None, hint: str | None = None):
        self.message = message
        self.key = key
        self.file = file
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        where = []
        if self.file:
            where.append(str(self.file))
        if self.key:
            where.append(self.key)
        text = f"{': '.join(where)}: {self.message}" if where else self.message
        if self.hint:
            text += f"\n  fix: {self.hint}"
        return text


class RecipeError(FinetuneError):
    """Invalid recipe: unknown key, wrong type, conflicting settings."""

    # an unknown key's machine-applicable fix, (key, its name here, value converter or None): set by the
    # loader for peers' names and close typos; `finetune convert` and the hint tests apply it
    rename: tuple | None = None


class DataError(FinetuneError):
    """Invalid training data found in preflight (names file and row)."""


class DoesNotFitError(FinetuneError):
    """No strategy fits the hardware; the message lists what would."""

    exit_code = EXIT_DOES_NOT_FIT


class TrainingFailed(FinetuneError):
    exit_code = EXIT_TRAINING_FAILED


# the errnos of a write that found no room: the disk, the user's quota, the largest file the system allows
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_FULL
