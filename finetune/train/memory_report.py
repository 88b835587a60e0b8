"""Per-rank peak memory at the end of training: RUN_DIR/memory/rank-K.json.

metrics.jsonl holds rank 0's figures; validating the planner needs every rank's peak GPU
memory (allocated and reserved, since the caching allocator's reserve is what runs out) and
the host RAM each process used (CPU-RAM efficient loading must not put N copies in RAM).
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

from transformers import TrainerCallback

GIB = 2**30


def memory_figures() -> dict:
    import torch

    out = {"host_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["gpu_max_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        out["gpu_max_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        out["gpu_name"] = torch.cuda.get_device_name()
    return out


class PeakMemoryCallback(TrainerCallback):
    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir) / "memory"

    def on_train_end(self, args, state, control, **kwargs):
        rank = int(os.environ.get("RANK", "0"))
        self.dir.mkdir(parents=True, exist_ok=True)
        figures = {"rank": rank, "step": state.global_step, **memory_figures()}
        (self.dir / f"rank-{rank}.json").write_text(json.dumps(figures, indent=2) + "\n")
