"""Per-rank peak memory: RUN_DIR/memory/rank-K.json, rewritten at each logged step and at the end.

metrics.jsonl holds rank 0's figures; validating the planner needs every rank's peak GPU
memory (allocated and reserved, since the caching allocator's reserve is what runs out) and
the host RAM each process used (CPU-RAM efficient loading must not put N copies in RAM).
Rewriting it as training goes keeps the peaks of a run that is stopped or killed (`final` says
whether training ended).
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

from transformers import TrainerCallback

from finetune import rundir
from finetune.plan.types import GIB
from finetune.train import attention


def _proc_fields(path: str, *keys: str) -> dict[str, int]:
    """{key: the first number after it} of a /proc file of this process, one read for all `keys`; a key
    that cannot be read is left out."""
    out: dict[str, int] = {}
    try:
        for line in Path(path).read_text().splitlines():
            key = next((k for k in keys if line.startswith(k)), None)
            if key is not None and key not in out:
                out[key] = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return out


def _proc_field(path: str, key: str) -> int | None:
    """The first number after `key` in a /proc file of this process, or None where it cannot be read."""
    return _proc_fields(path, key).get(key)


def host_pss_gib(field: str = "Pss:") -> float | None:
    """This process's proportional set size: pages shared with other ranks (the mmapped safetensors,
    the libraries) count once across the node when summed over ranks, unlike RSS, which counts them
    in every rank. `field="Pss_Anon:"`: its anonymous part alone, without mapped files' pages (page
    cache the kernel can drop, which the planner does not count). None where /proc/self/smaps_rollup
    (or the field, before Linux 5.7) does not exist."""
    return host_pss_figures(field)[field]


def host_pss_figures(*fields: str) -> dict[str, float | None]:
    """{field: GiB or None} of /proc/self/smaps_rollup's `fields`, from one read of the file (the kernel
    walks every mapping of the process for it)."""
    kib = _proc_fields("/proc/self/smaps_rollup", *fields)
    return {f: kib[f] * 1024 / GIB if f in kib else None for f in fields}


def storage_read_gib() -> float | None:
    """Bytes this process has had read from storage (not from the page cache) so far, from
    /proc/self/io's read_bytes: at the first step it says whether loading the weights waited on the disk
    or copied cached pages. None where the file does not exist or is not readable."""
    read = _proc_field("/proc/self/io", "read_bytes:")
    return None if read is None else read / GIB


def memory_figures() -> dict:
    import torch

    out = {"host_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["gpu_max_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        out["gpu_max_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        out["gpu_name"] = torch.cuda.get_device_name()
    kv_heads = attention.kv_heads()
    if kv_heads is not None:  # how the varlen kernel got grouped key/value heads (the planner's Job.varlen_repeats_kv)
        out["kv_heads"] = kv_heads
    if attention.skipped_packed_row_masks():  # transformers built no packed-row mask (the planner's shared_mask_bytes)
        out["packed_row_masks"] = attention.PACKED_ROW_MASKS_SKIPPED
    return out


def weights_on_gpu_bytes(model) -> int:
    """Bytes of parameter storage this rank holds on its GPU: local shards of FSDP2 DTensors, the
    packed bytes of bitsandbytes 4-bit weights (what "the weights are sharded" means, measurably)."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        if local.is_cuda:
            total += local.numel() * local.element_size()
    return total


def load_figures(model) -> dict:
    """This rank's GPU memory right after the model is loaded, before the Trainer wraps it: the peak says
    whether loading ever held the whole model (QLoRA under FSDP2 loads only the rank's shard), the weights
    what the rank kept. Empty without CUDA."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {
        "gpu_peak_after_load_gib": torch.cuda.max_memory_allocated() / GIB,
        "weights_on_gpu_after_load_gib": weights_on_gpu_bytes(model) / GIB,
    }


# smaps_rollup field -> the names of its peak over every sample and over the logged steps' samples
_PSS_PEAKS = {
    "Pss:": ("host_pss_sampled_peak_gib", "host_pss_steps_peak_gib"),
    "Pss_Anon:": ("host_pss_anon_sampled_peak_gib", "host_pss_anon_steps_peak_gib"),
}


class PeakMemoryCallback(TrainerCallback):
    def __init__(self, run_dir: Path, *, at_load: dict | None = None):
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / rundir.MEMORY_DIR
        self.at_load = dict(at_load or {})
        self.at_start: dict = {}
        self.ended = False  # an evaluation after training logs again; the file stays final
        # the host PSS peaks written to the file, by name: sampled after loading and at every logged step, and at
        # the logged steps only (what training holds, without what loading left behind until the first step);
        # each whole and its anonymous part
        self.host_peaks: dict[str, float] = {}
        self.at_end: dict = {}  # the host peak when training ended, before the final save

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # after loading and wrapping (FSDP2/ZeRO-3/device_map), before the first step: a model that
        # loaded whole onto GPU 0 shows here as a load peak far above the rank's shard
        import torch

        self._sample_pss(at_step=False)
        # wall clock when training starts: a launcher that noted its own start gets the load time
        self.at_start = {
            "train_begin_unix": time.time(),
            "host_threads": torch.get_num_threads(),
            "storage_read_gib_at_start": storage_read_gib(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.at_start |= {
                "gpu_load_peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
                "gpu_allocated_at_start_gib": torch.cuda.memory_allocated() / GIB,
            }
            if model is not None:
                self.at_start["weights_on_gpu_gib"] = weights_on_gpu_bytes(model) / GIB

    def on_log(self, args, state, control, **kwargs):
        self._write(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.ended = True
        self.at_end = {"host_rss_peak_before_save_gib": memory_figures()["host_rss_peak_gib"]}
        self._write(state.global_step)

    def after_final_save(self, step: int) -> None:
        """Rewrite the file once more after the final model is saved: gathering a sharded model for the save
        may be the rank's host RAM peak, which host_rss_peak_gib then includes (host_rss_peak_before_save_gib
        is the peak without it)."""
        self.at_end["saved_final"] = True
        self._write(step)

    def _sample_pss(self, *, at_step: bool = True) -> None:
        figures = host_pss_figures("Pss:", "Pss_Anon:")
        for field, (sampled, steps) in _PSS_PEAKS.items():
            value = figures[field]
            if value is None:
                continue
            for name in (sampled, steps) if at_step else (sampled,):
                self.host_peaks[name] = max(value, self.host_peaks.get(name, 0.0))

    def _write(self, step: int) -> None:
        rank = int(os.environ.get("RANK", "0"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self._sample_pss()
        figures = {
            "rank": rank,
            "step": step,
            "final": self.ended,
            **memory_figures(),
            **self.at_load,
            **self.at_start,
            **self.at_end,
            **self.host_peaks,
        }
        tmp = self.dir / f".rank-{rank}.json.tmp"  # never a half-written file, whenever we are killed
        tmp.write_text(json.dumps(figures, indent=2) + "\n")
        tmp.replace(self.run_dir / rundir.memory_file(rank))
