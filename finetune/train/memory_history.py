"""logging.memory_profile_step: N -> what held the GPU memory at the peak of optimizer step N.

Over that one step the CUDA caching allocator records every allocation with the Python stack that made it
(torch.cuda.memory._record_memory_history). At the step's end each rank writes
RUN_DIR/profile/rank-K.memory.json: the step's peak of allocated memory, split into what was already held when
the step began (weights, gradients, optimizer states, the allocator's cached blocks do not count) and what the
step allocated and still held at that moment, by the code that allocated it; the reserved memory (what
`max_memory_reserved` reports, and the planner predicts) at the same moment and at its own peak, and the
allocator's counters. RUN_DIR/profile/rank-K.memory.pickle.gz is the raw snapshot for https://pytorch.org/memory_viz.

The recording costs the host a few microseconds an allocation, so the step is slower than the others; keep it out
of a window that is timed (logging.profile_steps), and after the first step, which allocates the optimizer states.
"""

from __future__ import annotations

import gzip
import json
import pickle
from collections import defaultdict
from pathlib import Path

from transformers import TrainerCallback

from finetune import rundir
from finetune.plan.types import GIB
from finetune.train.profile import package_path

MAX_ENTRIES = 400_000  # allocator events kept (a ring buffer); an 8B LoRA step makes ~30,000
SITES = 25  # the largest allocation sites listed
# modules that say where torch was called from, not why: the site is the innermost frame outside them
_PLUMBING = ("torch/", "contextlib.py", "functools.py", "accelerate/utils/operations.py")
NO_FRAME = "(no Python frame: an operator of the autograd engine's backward)"


def site(frames: list[dict]) -> str:
    """'package/module.py:LINE function' of the innermost frame outside torch's own plumbing."""
    for f in frames:  # innermost first, as the allocator records them
        raw = str(f.get("filename", ""))
        if not raw or raw.startswith("<"):
            continue
        path = package_path(raw)
        if path.startswith(_PLUMBING):
            continue
        return f"{path}:{f.get('line')} {f.get('name')}"
    return NO_FRAME


def peak_summary(trace: list[dict], *, allocated_at_start: int, reserved_at_start: int) -> dict:
    """Replays one device's allocator trace from the step's start: the peak of allocated bytes and, at that
    moment, the bytes held from before the step and those the step allocated, grouped by site."""
    live: dict[int, tuple[int, str]] = {}  # addr -> (bytes, site) of the step's own allocations
    before = allocated_at_start  # held from before the step, less what the step freed of it
    allocated, reserved = allocated_at_start, reserved_at_start
    peak = allocated
    peak_reserved = reserved
    at_peak: dict = {"before": before, "live": {}, "reserved": reserved}
    for e in trace:
        action, addr, size = e.get("action"), e.get("addr"), int(e.get("size", 0))
        if action == "alloc":
            live[addr] = (size, site(e.get("frames") or []))
            allocated += size
        elif action in ("free_requested", "free_completed"):
            if addr in live:
                allocated -= live.pop(addr)[0]
            elif action == "free_requested":  # a block allocated before the step (free_completed follows it)
                before -= size
                allocated -= size
        elif action in ("segment_alloc", "segment_map"):
            reserved += size
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
        peak_reserved = max(peak_reserved, reserved)
        if allocated > peak:
            peak = allocated
            at_peak = {"before": before, "live": dict(live), "reserved": reserved}
    by_site: dict[str, int] = defaultdict(int)
    for size, where in at_peak["live"].values():
        by_site[where] += size
    top = sorted(by_site.items(), key=lambda kv: -kv[1])
    listed, rest = top[:SITES], top[SITES:]
    sites = [{"gib": round(b / GIB, 3), "site": s} for s, b in listed]
    if rest:
        sites.append({"gib": round(sum(b for _, b in rest) / GIB, 3), "site": f"({len(rest)} other sites)"})
    return {
        "allocated_at_start_gib": round(allocated_at_start / GIB, 3),
        "peak_allocated_gib": round(peak / GIB, 3),
        "held_from_before_the_step_gib": round(at_peak["before"] / GIB, 3),
        "allocated_in_the_step_gib": round(sum(s for s, _ in at_peak["live"].values()) / GIB, 3),
        "reserved_at_that_peak_gib": round(at_peak["reserved"] / GIB, 3),
        "peak_reserved_in_the_step_gib": round(peak_reserved / GIB, 3),
        "by_site": sites,
        "events": len(trace),
        # the ring buffer dropped the step's first events: the replay starts late and its figures are partial
        "complete": len(trace) < MAX_ENTRIES,
    }


ALLOCATOR_COUNTERS = {
    "max_allocated_gib": "allocated_bytes.all.peak",
    "max_reserved_gib": "reserved_bytes.all.peak",
    "max_inactive_split_gib": "inactive_split_bytes.all.peak",  # cached pieces of split blocks: fragmentation
}


def allocator_counters(stats: dict) -> dict:
    out = {name: round(stats.get(key, 0) / GIB, 3) for name, key in ALLOCATOR_COUNTERS.items()}
    out["alloc_retries"] = int(stats.get("num_alloc_retries", 0))  # cache flushed to satisfy a request
    return out


class MemoryHistoryCallback(TrainerCallback):
    """Records the allocator's history over optimizer step `step` (1-based, counted like the Trainer's
    global_step + 1) on a CUDA device and writes the peak's breakdown (module docstring)."""

    def __init__(self, run_dir: Path, *, step: int, rank: int):
        self.run_dir = Path(run_dir)
        self.step, self.rank = step, rank
        self.recording = False
        self.start: tuple[int, int] = (0, 0)

    def on_step_begin(self, args, state, control, **kwargs):
        import torch

        if self.recording or state.global_step + 1 != self.step or not torch.cuda.is_available():
            return
        torch.cuda.synchronize()
        self.start = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
        torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python", max_entries=MAX_ENTRIES)
        self.recording = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.recording:
            self._finish()

    def on_train_end(self, args, state, control, **kwargs):
        if self.recording:  # training ended inside the step
            self._finish()

    def _finish(self) -> None:
        import torch

        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(None)
        self.recording = False
        device = torch.cuda.current_device()
        trace = snapshot["device_traces"][device] if len(snapshot["device_traces"]) > device else []
        summary = {
            "step": self.step,
            **peak_summary(trace, allocated_at_start=self.start[0], reserved_at_start=self.start[1]),
            "run": allocator_counters(torch.cuda.memory_stats()),
        }
        stem = self.run_dir / rundir.profile_stem(self.rank)
        stem.parent.mkdir(parents=True, exist_ok=True)
        Path(str(stem) + ".memory.json").write_text(json.dumps(summary, indent=2) + "\n")
        with gzip.open(str(stem) + ".memory.pickle.gz", "wb") as f:
            pickle.dump(snapshot, f)
