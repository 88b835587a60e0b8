"""The garbage collector's settings in a rank's process (finetune.train's entry point, and test ranks that stand in
for it).

torch, transformers, trl and peft load ~600k objects that live as long as the rank. Each collection while they load
would rescan them all (about a sixth of the import time, 1 s of CPU a rank), and the interpreter's exit would
collect them over and over while it clears their modules (1.5-2 s of CPU on every rank, which the launcher and a
requeued job wait for). So a rank keeps the collector off until they are loaded, then freezes them out of every
later pass, and freezes again before it exits. Exit handlers and non-daemon threads still run as usual.
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def hold_until_loaded() -> None:
    """No collections until `loaded`: call first thing in the rank's entry point."""
    gc.disable()


def loaded() -> None:
    """The libraries are in: freeze what is alive now out of later collections and turn the collector back on."""
    gc.freeze()
    gc.enable()


def exit_rank(code: int) -> NoReturn:
    """Exit with `code`, everything written and flushed, without the exit's collections of the frozen objects."""
    gc.freeze()
    sys.exit(code)
