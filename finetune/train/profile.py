"""logging.profile_steps: [start, stop] -> torch.profiler over those optimizer steps.

Writes, per rank, RUN_DIR/profile/rank-K.trace.json.gz (open in https://ui.perfetto.dev),
rank-K.txt (the top operators by device time, then by CPU time) and rank-K.json: wall time of
the profiled steps, the time kernels kept the GPU busy, and that busy time split by kind
(matmul, attention, communication, elementwise/other). Busy time well under wall time means the
GPU waits for the host (Python, kernel launches, synchronizations), not for its own work; the JSON's
`idle` says where: the host operations that ran while no kernel did (`idle_gaps`), and `syncs` where the
host itself waited for the GPU (`SyncSites`: each synchronizing CUDA call, by its Python call site).
"""

from __future__ import annotations

import bisect
import json
import re
import time
import traceback
import warnings
from collections import Counter
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


GPU_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_EVENT_CATEGORIES = ("cpu_op", "user_annotation", "python_function")


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _outermost(events: list[dict]) -> list[dict]:
    """The events of one thread that no other event of that thread encloses."""
    top: list[dict] = []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if not top or e["ts"] >= top[-1]["ts"] + top[-1]["dur"]:
            top.append(e)
    return top


def idle_gaps(trace: dict, *, min_gap_us: float = 10.0, top: int = 12) -> dict:
    """Where the GPU sat idle inside a Chrome trace of torch.profiler: the gaps between kernels (any
    stream), and the host operations running during them, by name (each thread's outermost operator or
    annotation, e.g. the optimizer step, a DataLoader fetch, `aten::item`), weighted by their overlap with
    the gaps. Host time in no recorded operation is Python between operators."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") in GPU_EVENT_CATEGORIES]
    gpu = _merged([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    if len(gpu) < 2:
        return {"idle_s": 0.0, "gaps": 0, "host_ops_during_gaps_s": {}}
    gaps = [(a[1], b[0]) for a, b in zip(gpu, gpu[1:]) if b[0] - a[1] >= min_gap_us]
    idle = sum(end - start for start, end in gaps)
    by_thread: dict[tuple, list[dict]] = {}
    for e in events:
        if e.get("cat") in HOST_EVENT_CATEGORIES and not str(e.get("name", "")).startswith("ProfilerStep"):
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    overlap: dict[str, float] = {}
    covered = [0.0] * len(gaps)
    gap_ends = [g1 for _, g1 in gaps]
    for thread_events in by_thread.values():
        mine = [0.0] * len(gaps)  # this thread's operators do not overlap each other: their shares add
        for e in _outermost(thread_events):
            start, end = e["ts"], e["ts"] + e["dur"]
            for i in range(bisect.bisect_right(gap_ends, start), len(gaps)):
                g0, g1 = gaps[i]
                if g0 >= end:
                    break
                shared = min(end, g1) - max(start, g0)
                if shared > 0:
                    overlap[e["name"]] = overlap.get(e["name"], 0.0) + shared
                    mine[i] += shared
        covered = [max(a, b) for a, b in zip(covered, mine)]
    # no host operation recorded during that part of a gap: Python (the Trainer, callbacks, collation)
    python = sum(max(0.0, (g1 - g0) - c) for (g0, g1), c in zip(gaps, covered))
    named = sorted(overlap.items(), key=lambda kv: -kv[1])[:top]
    largest = sorted(gaps, key=lambda g: g[0] - g[1])[:8]
    # CUPTI's correlation id links each kernel to the runtime call that launched it
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and e.get("args", {}).get("correlation") is not None
    }
    return {
        "idle_s": round(idle / 1e6, 4),
        "gaps": len(gaps),
        "largest_gaps_ms": [round((g1 - g0) / 1e3, 2) for g0, g1 in largest],
        # what launched the kernel before and the kernel after each of the largest gaps
        "largest_gaps": [_gap_context(kernels, launches, by_thread, g0, g1) for g0, g1 in largest],
        "host_ops_during_gaps_s": {name: round(us / 1e6, 6) for name, us in named},
        "no_host_op_s": round(python / 1e6, 6),
    }


def _gap_context(kernels: list[dict], launches: dict, by_thread: dict[tuple, list[dict]], g0: float, g1: float) -> dict:
    """The host operators that launched the GPU work ending at g0 and starting at g1 (the launch call's
    innermost enclosing operator names it, with its outermost one)."""

    def launcher(kernel: dict | None) -> str | None:
        launch = launches.get((kernel or {}).get("args", {}).get("correlation"))
        if launch is None:
            return None
        around = [
            e
            for e in by_thread.get((launch.get("pid"), launch.get("tid")), [])
            if e["ts"] <= launch["ts"] <= e["ts"] + e["dur"]
        ]
        outer = max(around, key=lambda e: e["dur"], default=None)
        inner = min(around, key=lambda e: e["dur"], default=None)
        if inner is None:
            return launch.get("name")
        return inner["name"] if outer is inner else f"{outer['name']} > {inner['name']}"

    before = max((e for e in kernels if e["ts"] + e["dur"] <= g0), key=lambda e: e["ts"] + e["dur"], default=None)
    after = min((e for e in kernels if e["ts"] >= g1), key=lambda e: e["ts"], default=None)
    return {"ms": round((g1 - g0) / 1e3, 2), "after": launcher(before), "before": launcher(after)}


class SyncSites:
    """Counts the synchronizing CUDA calls (`.item()`, a blocking copy, `torch.cuda.synchronize`, a
    boolean of a device tensor) by call site, through torch's sync debug mode: each one warns, and the
    hook keeps the innermost frames of the Python stack that issued it. A sync drains the launch queue,
    so the GPU idles while the host prepares what follows it; these are the first places to look."""

    MESSAGE = "synchronizing CUDA operation"
    FRAMES = 4  # innermost frames kept per site

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._catch: warnings.catch_warnings | None = None

    def start(self) -> None:
        import torch

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()  # restores the filters and showwarning at stop
        warnings.filterwarnings("always", message=f".*{self.MESSAGE}.*")
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if self.MESSAGE in str(message):
                self.record(traceback.extract_stack()[:-1])
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> list[dict]:
        import torch

        torch.cuda.set_sync_debug_mode("default")
        if self._catch is not None:
            self._catch.__exit__(None, None, None)
            self._catch = None
        return self.table()

    def record(self, stack: list[traceback.FrameSummary]) -> None:
        frames = [f for f in stack if "/warnings.py" not in f.filename][-self.FRAMES :]
        self.counts[" < ".join(_frame(f) for f in reversed(frames))] += 1

    def table(self, top: int = 20) -> list[dict]:
        return [{"calls": n, "site": site} for site, n in self.counts.most_common(top)]


def package_path(path: str) -> str:
    """A source file's path from its package on: cut at site-packages, else its last two parts."""
    path = path.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return "/".join(path.split("/")[-2:])


def _frame(f: traceback.FrameSummary) -> str:
    """'package/module.py:LINE function'."""
    return f"{package_path(f.filename)}:{f.lineno} {f.name}"


class ProfilerCallback(TrainerCallback):
    """Profiles optimizer steps start..stop-1 (1-based, counted like the Trainer's global_step + 1)."""

    def __init__(self, run_dir: Path, *, start: int, stop: int, rank: int):
        self.run_dir = Path(run_dir)
        self.out = self.run_dir / rundir.PROFILE_DIR
        self.start, self.stop, self.rank = start, stop, rank
        self.prof = None
        self.began = 0.0
        self.done = None  # (profiler, wall seconds, steps, sync sites) once the window has closed
        self.syncs: SyncSites | None = None

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
            if torch.cuda.is_available():
                self.syncs = SyncSites()
                self.syncs.start()
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

        syncs = self.syncs.stop() if self.syncs is not None else None  # before the window's own sync
        self.syncs = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.began
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        self.done = (prof, wall, steps, syncs)

    def _write(self, prof, wall: float, steps: int, syncs: list[dict] | None) -> None:
        import torch

        self.out.mkdir(parents=True, exist_ok=True)
        stem = self.run_dir / rundir.profile_stem(self.rank)
        cuda = torch.cuda.is_available()
        trace_path = Path(str(stem) + ".trace.json")
        prof.export_chrome_trace(str(trace_path))
        idle = idle_gaps(json.loads(trace_path.read_text())) if cuda else None
        _gzip(trace_path)
        events = prof.key_averages()
        tables = []
        if cuda:
            tables.append(events.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90))
        tables.append(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=90))
        Path(str(stem) + ".txt").write_text("\n\n".join(tables) + "\n")
        summary = summarize(events, wall_s=wall, steps=steps) if cuda else {"steps": steps, "wall_s": round(wall, 4)}
        if cuda:
            summary["idle"] = idle
            summary["syncs"] = syncs
        Path(str(stem) + ".json").write_text(json.dumps(summary, indent=2) + "\n")


def _gzip(path: Path) -> None:
    import gzip
    import shutil

    with path.open("rb") as src, gzip.open(str(path) + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
