"""logging.profile_steps: [start, stop] -> torch.profiler over those optimizer steps.

Writes, per rank, RUN_DIR/profile/rank-K.trace.json.gz (open in https://ui.perfetto.dev),
rank-K.txt (the top operators by device time, then by CPU time) and rank-K.json: wall time of
the profiled steps, the time kernels kept the GPU busy, and that busy time split by kind
(matmul, attention, communication, elementwise/other). Busy time well under wall time means the
GPU waits for the host (Python, kernel launches, synchronizations), not for its own work.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from transformers import TrainerCallback

from finetune import rundir

# kernel-name patterns, tried in order (cuBLAS/CUTLASS gemms are named gemm/nvjet/xmma/wgmma)
KINDS = (
    ("attention", re.compile(r"flash|fmha|attention|varlen|sdpa|efficient_attention", re.I)),
    ("communication", re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|xmma|wgmma|cutlass|matmul|splitk|cublas", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
)


def kernel_kind(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "elementwise/other"


def device_time_us(event) -> float:
    """Self device time of a profiler event (the attribute was renamed from cuda to device)."""
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def summarize(events, *, wall_s: float, steps: int) -> dict:
    """Busy GPU time by kernel kind from key_averages() rows of device (kernel) events."""
    import torch

    kinds: dict[str, float] = {}
    busy = queue_full = 0.0
    for event in events:
        if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = device_time_us(event)
        if event.key == "Command Buffer Full":  # CUPTI: the host waited for launch-queue room, not a kernel
            queue_full += us
            continue
        busy += us
        kind = kernel_kind(event.key)
        kinds[kind] = kinds.get(kind, 0.0) + us
    return {
        "steps": steps,
        "wall_s": round(wall_s, 4),
        "gpu_busy_s": round(busy / 1e6, 4),
        "gpu_busy_share": round(busy / 1e6 / wall_s, 4) if wall_s else None,
        "by_kind_s": {k: round(v / 1e6, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        # time the host blocked on a full launch queue: the GPU, not Python, set the pace
        "host_waited_on_full_queue_s": round(queue_full / 1e6, 4),
    }


class ProfilerCallback(TrainerCallback):
    """Profiles optimizer steps start..stop-1 (1-based, counted like the Trainer's global_step + 1)."""

    def __init__(self, run_dir: Path, *, start: int, stop: int, rank: int):
        self.run_dir = Path(run_dir)
        self.out = self.run_dir / rundir.PROFILE_DIR
        self.start, self.stop, self.rank = start, stop, rank
        self.prof = None
        self.began = 0.0
        self.done = None  # (profiler, wall seconds, steps) once the window has closed

    def on_step_begin(self, args, state, control, **kwargs):
        if self.prof is None and state.global_step + 1 == self.start:
            import torch
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self.prof = profile(activities=activities, record_shapes=False, with_stack=False)
            self.prof.__enter__()
            self.began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is not None and state.global_step + 1 >= self.stop:
            self._stop(steps=self.stop - self.start)

    def on_train_end(self, args, state, control, **kwargs):
        # written here, after the Trainer has taken its throughput figures
        if self.prof is not None:  # training ended inside the window
            self._stop(steps=max(1, state.global_step + 1 - self.start))
        if self.done is not None:
            self._write(*self.done)
            self.done = None

    def _stop(self, *, steps: int) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.began
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.done = (prof, wall, steps)

    def _write(self, prof, wall: float, steps: int) -> None:
        import torch

        self.out.mkdir(parents=True, exist_ok=True)
        stem = self.run_dir / rundir.profile_stem(self.rank)
        prof.export_chrome_trace(str(stem) + ".trace.json")
        _gzip(Path(str(stem) + ".trace.json"))
        events = prof.key_averages()
        cuda = torch.cuda.is_available()
        tables = []
        if cuda:
            tables.append(events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90))
        tables.append(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=90))
        Path(str(stem) + ".txt").write_text("\n\n".join(tables) + "\n")
        summary = summarize(events, wall_s=wall, steps=steps) if cuda else {"steps": steps, "wall_s": round(wall, 4)}
        Path(str(stem) + ".json").write_text(json.dumps(summary, indent=2) + "\n")


def _gzip(path: Path) -> None:
    import gzip
    import shutil

    with path.open("rb") as src, gzip.open(str(path) + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
