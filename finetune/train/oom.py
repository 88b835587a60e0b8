"""Inside a rank: recognise running out of memory, and record it for the launcher instead of a traceback.

The record (RUN_DIR/logs/oom-rank-K.json) holds what the launcher re-plans with
(finetune/plan/replan.py): the rank, the setting in force (micro-batch, accumulation, activation
checkpointing, strategy), the measured peak, the allocation that failed, the capacity the rank had, and
what it held when training began (or that it failed before the first step, while loading the model).
On CUDA the peak is torch.cuda.max_memory_reserved (what the caching allocator holds, what runs out);
on CPU it is the process's address-space peak under an RLIMIT_AS limit, else its resident-set peak.

FINETUNE_TEST_MEMORY_LIMIT_MIB (tests only): when training begins, each rank caps its own address space
at its current size plus that many MiB (resource.setrlimit RLIMIT_AS), so on CPU a micro-batch too large
for the cap fails inside torch's allocator exactly as a GPU's does when its memory runs out.
"""

from __future__ import annotations

import json
import os
import re
import resource
from pathlib import Path

from transformers import TrainerCallback

from finetune.errors import TrainingFailed
from finetune.plan.types import GIB
from finetune.recipe.schema import sync_each_batch_pin
from finetune.rundir import oom_record

TEST_LIMIT_ENV = "FINETUNE_TEST_MEMORY_LIMIT_MIB"
# torch's messages: "CUDA out of memory. Tried to allocate 2.00 GiB", and on CPU "DefaultCPUAllocator:
# can't allocate memory: you tried to allocate 800000000 bytes"
_CPU_OOM = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "bytes": 1}
_REQUEST = re.compile(r"[Tt]ried to allocate ([0-9.]+) ?(bytes|B|KiB|MiB|GiB|TiB)")


class OutOfMemory(TrainingFailed):
    """A rank ran out of memory; its record is in the run dir for the launcher to re-plan with."""


def out_of_memory_error(exc: BaseException) -> BaseException | None:
    """The out-of-memory error in `exc`'s chain (a library may wrap it), or None."""
    import torch

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
            return exc
        if isinstance(exc, RuntimeError) and any(text in str(exc) for text in _CPU_OOM):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def requested_bytes(message: str) -> float:
    match = _REQUEST.search(message)
    return float(match.group(1)) * _UNITS[match.group(2)] if match else 0.0


def _status_bytes(key: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return None


def _on_cuda() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _limited() -> bool:
    return resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY


def in_use_bytes() -> float:
    """What this rank holds now, in the same kind as its peak: reserved (CUDA), address space or RSS."""
    import torch

    if _on_cuda():
        return float(torch.cuda.memory_reserved())
    return (_status_bytes("VmSize") if _limited() else _status_bytes("VmRSS")) or 0.0


def measured() -> dict:
    """The peak and capacity figures of this rank right after the failure."""
    import torch

    if _on_cuda():
        from finetune.train.occupancy import others_bytes

        index = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(index)
        return {
            "other_bytes": others_bytes(free, total, torch.cuda.memory_reserved(index)),
            "peak_kind": "max reserved",
            "peak_bytes": float(torch.cuda.max_memory_reserved(index)),
            "peak_allocated_bytes": float(torch.cuda.max_memory_allocated(index)),
            "capacity_bytes": float(torch.cuda.get_device_properties(index).total_memory),
            "device_name": torch.cuda.get_device_name(index),
        }
    if _limited():
        return {
            "peak_kind": "address space (VmPeak)",
            "peak_bytes": _status_bytes("VmPeak") or 0.0,
            "capacity_bytes": float(resource.getrlimit(resource.RLIMIT_AS)[0]),
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    return {
        "peak_kind": "host RSS",
        "peak_bytes": rss,
        "capacity_bytes": float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
    }


_BASELINE: dict = {}  # what the rank held when training began (BaselineCallback), one rank per process


def record(run_dir: Path, recipe, *, error: BaseException) -> OutOfMemory:
    """Write this rank's record and return the error the rank exits with (no traceback)."""
    import torch

    rank = int(os.environ.get("RANK", "0"))
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    figures = measured()
    if recipe.resolved.device == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()  # after measuring: give the memory back while the launcher decides
    data = {
        "rank": rank,
        "world_size": recipe.resolved.world_size,
        "device": recipe.resolved.device,
        "strategy": recipe.distributed.strategy,
        "micro_batch_size": recipe.train.micro_batch_size,
        "gradient_accumulation_steps": recipe.resolved.gradient_accumulation_steps,
        "activation_checkpointing": recipe.train.activation_checkpointing == "on",
        "sync_each_batch": sync_each_batch_pin(recipe) is True,
        "predicted_peak_gib": recipe.resolved.predicted_peak_gib,
        "requested_bytes": requested_bytes(message),
        "message": message,
        **figures,
        "baseline_bytes": _BASELINE.get("bytes", 0.0),
        "before_training": "bytes" not in _BASELINE,
    }  # loading or wrapping the model, not a step
    path = Path(run_dir) / oom_record(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return OutOfMemory(
        f"rank {rank} ran out of memory at micro-batch {data['micro_batch_size']} with activation "
        f"checkpointing {'on' if data['activation_checkpointing'] else 'off'} ({figures['peak_kind']} peak "
        f"{figures['peak_bytes'] / GIB:.2f} GiB of {figures['capacity_bytes'] / GIB:.2f} GiB; planned "
        f"{recipe.resolved.predicted_peak_gib:.2f} GiB): {message}",
        file=str(path),
        hint="`finetune run` re-plans with this record and retries (train.oom_retries)",
    )


class BaselineCallback(TrainerCallback):
    """Remember what this rank holds when training begins (weights loaded, before any activation)."""

    def on_train_begin(self, args, state, control, **kwargs):
        _BASELINE["bytes"] = in_use_bytes()
        if os.environ.get(TEST_LIMIT_ENV):  # see the module docstring (the tests' CPU mechanism)
            extra = float(os.environ[TEST_LIMIT_ENV]) * 2**20
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (int((_status_bytes("VmSize") or 0.0) + extra), hard))
            _BASELINE["bytes"] = in_use_bytes()  # the same kind as the peak under the limit
