"""Inside a rank, before the model loads: is this rank's GPU free for the memory the plan needs?

The planner plans for the whole card. Another process on the same GPU (a run that has not
finished exiting, a notebook, a second job given the same CUDA_VISIBLE_DEVICES) makes the rank run out of
memory while loading, which looks like a planning error and re-planning cannot mend. So the rank looks
first: while other processes hold more than the plan leaves spare, it waits a little (a process that
has just exited frees its memory within seconds), then fails naming the GPU and what they hold.
"""

from __future__ import annotations

import logging
import time

from finetune.errors import TrainingFailed
from finetune.plan.types import GIB

log = logging.getLogger("finetune.train")

WAIT_S = 60.0  # how long a rank waits for memory held by other processes to be released
POLL_S = 2.0


def others_bytes(free: float, total: float, own_reserved: float) -> float:
    """Device memory held outside this process's caching allocator: other processes, plus this
    process's own CUDA context (a few hundred MiB)."""
    return max(0.0, total - free - own_reserved)


def shortfall(*, free: float, total: float, planned: float) -> bool:
    """The plan's peak does not fit in what is free, though it fits the card (a plan made for a bigger
    card is not this check's business: running out of memory re-plans it)."""
    return free < planned <= total


def check_device_free(recipe, *, wait_s: float = WAIT_S, poll_s: float = POLL_S) -> None:
    """Wait up to `wait_s` for this rank's GPU to have the planned peak free; fail with a clear error if it
    does not. Nothing to check on CPU runs."""
    import torch

    if recipe.resolved.device != "cuda" or not torch.cuda.is_available():
        return
    planned = recipe.resolved.predicted_peak_gib * GIB
    index = torch.cuda.current_device()
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        free, total = torch.cuda.mem_get_info(index)
        if not shortfall(free=free, total=total, planned=planned):
            if waited:
                log.info(f"GPU {index}: memory released, {free / GIB:.1f} GiB free")
            return
        held = others_bytes(free, total, torch.cuda.memory_reserved(index))
        if time.monotonic() >= deadline:
            raise TrainingFailed(
                f"GPU {index} ({torch.cuda.get_device_name(index)}) has {free / GIB:.1f} GiB free of "
                f"{total / GIB:.1f} GiB: other processes hold {held / GIB:.1f} GiB of it, and this run is "
                f"planned to peak at {planned / GIB:.1f} GiB per GPU (waited {wait_s:.0f} s for it to be released)",
                hint="stop the other processes on this GPU (`nvidia-smi` lists them) or give the run free GPUs "
                "with CUDA_VISIBLE_DEVICES; nothing was loaded or trained",
            )
        if not waited:
            log.info(
                f"GPU {index}: other processes hold {held / GIB:.1f} GiB and the plan needs "
                f"{planned / GIB:.1f} GiB; waiting up to {wait_s:.0f} s for it to be released"
            )
            waited = True
        time.sleep(poll_s)
