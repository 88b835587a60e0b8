"""The search: every applicable strategy x micro-batch x activation checkpointing, then the choice.

Rule: the fastest configuration (lowest modelled step time) whose peak fits in HEADROOM of the GPU
memory (and whose offloaded states fit in host RAM / NVMe). Among equally fast settings the larger
micro-batch and no checkpointing win. CPU/NVMe offload is chosen only when no strategy that keeps
the states on the GPUs fits. Recipe pins (strategy, micro-batch, checkpointing) restrict
the search; a pinned strategy that does not fit yields fits=False with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from finetune.plan.memory import OFFLOADED, footprint
from finetune.plan.timing import step_time
from finetune.plan.types import GIB, Candidate
from finetune.plan.workload import Job

HEADROOM = 0.90  # plan to at most 90% of GPU memory / host RAM: spikes, other processes
STRATEGY_ORDER = ("ddp", "fsdp2", "fsdp2-hybrid", "zero3", "zero3-offload", "zero3-nvme")


def not_applicable(job: Job, strategy: str) -> str:
    """Why `strategy` makes no sense on this preset/adapter ("" when it does)."""
    p = job.preset
    if p.vendor == "cpu":
        return "" if strategy == "ddp" else "the cpu preset runs one process; only ddp applies"
    if strategy == "fsdp2-hybrid" and p.nodes < 2:
        return "hybrid sharding replicates across nodes; this preset has one node"
    if strategy == "fsdp2-hybrid" and p.gpus_per_node < 2:
        # accelerate refuses an FSDP mesh whose shard dimension is 1 (seen on 2 x 1-GPU nodes)
        return ("hybrid sharding shards within a node; with one GPU per node use ddp (replicate) "
                "or fsdp2 (shard across nodes)")
    if strategy in ("fsdp2", "zero3") and p.world_size < 2 and job.strategy != strategy:
        # never chosen on one GPU (no memory to gain), but allowed when pinned: an FSDP2
        # checkpoint saved on several GPUs resumes on one under the same strategy
        return "sharding needs more than one GPU"
    if strategy == "zero3-nvme" and not job.nvme_path:
        return "the preset has no NVMe path; set distributed.nvme_path"
    if strategy in OFFLOADED and job.adapter == "qlora":
        return "DeepSpeed cannot offload 4-bit (bitsandbytes) weights; use fsdp2 or zero3"
    return ""


def applicable_strategies(job: Job) -> list[str]:
    return [s for s in STRATEGY_ORDER if not not_applicable(job, s)]


@dataclass
class Search:
    share: int  # sequences per GPU per optimizer step (global batch / data-parallel ranks)
    global_batch: int  # achieved global batch (sequences)
    candidates: list[Candidate] = field(default_factory=list)


def batch_share(job: Job) -> int:
    world = job.preset.world_size
    return max(1, round(job.global_batch_size / world))


def micro_batch_options(job: Job) -> list[int]:
    if job.micro_batch:
        return [job.micro_batch]
    share = batch_share(job)
    return [m for m in (2 ** k for k in range(0, 17)) if m <= share and share % m == 0]


def evaluate(job: Job, *, strategy: str, micro_batch: int, checkpointing: bool) -> Candidate:
    p = job.preset
    grad_accum = max(1, round(batch_share(job) / micro_batch))
    fp = footprint(job, strategy=strategy, micro_batch=micro_batch, checkpointing=checkpointing)
    t = step_time(job, strategy=strategy, micro_batch=micro_batch, grad_accum=grad_accum,
                  checkpointing=checkpointing)
    reason = ""
    limit = HEADROOM * p.gpu_memory_gib * GIB
    if fp.memory.total > limit:
        unit = "RAM" if p.vendor == "cpu" else "GPU memory"
        reason = (f"needs {fp.memory.total / GIB:.1f} GiB per {'process' if p.vendor == 'cpu' else 'GPU'}; "
                  f"{limit / GIB:.1f} GiB usable ({HEADROOM:.0%} of {p.gpu_memory_gib:g} GiB {unit})")
    elif fp.host_ram_bytes > HEADROOM * p.host_ram_gib * GIB:
        reason = (f"needs {fmt_bytes(fp.host_ram_bytes)} host RAM per node; "
                  f"{fmt_bytes(HEADROOM * p.host_ram_gib * GIB)} usable")
    elif p.nvme_capacity_gib and fp.nvme_bytes > HEADROOM * p.nvme_capacity_gib * GIB:
        reason = f"needs {fmt_bytes(fp.nvme_bytes)} of NVMe per node; the preset has {p.nvme_capacity_gib:g} GiB"
    return Candidate(
        strategy=strategy, micro_batch_size=micro_batch, activation_checkpointing=checkpointing,
        memory=fp.memory, fits=not reason, host_ram_bytes=fp.host_ram_bytes, nvme_bytes=fp.nvme_bytes,
        compute_time_s=t.compute_s, comm_time_s=t.intra_s + t.inter_s + t.offload_s,
        step_time_s=t.step_s, bottleneck=t.bottleneck, reason=reason,
        gradient_accumulation_steps=grad_accum)


def best_for_strategy(job: Job, strategy: str) -> Candidate:
    """The fastest fitting setting of `strategy`, or its smallest-memory setting with the reason."""
    why_not = not_applicable(job, strategy)
    ckpt_options = {"on": [True], "off": [False]}.get(job.checkpointing, [False, True])
    tried = [evaluate(job, strategy=strategy, micro_batch=m, checkpointing=c)
             for m in micro_batch_options(job) for c in ckpt_options]
    fitting = [c for c in tried if c.fits]
    if fitting and not why_not:
        return min(fitting, key=lambda c: (round(c.step_time_s, 6), -c.micro_batch_size,
                                           c.activation_checkpointing))
    smallest = min(tried, key=lambda c: (c.memory.total, c.host_ram_bytes))
    if why_not:
        smallest.fits, smallest.reason = False, why_not
    return smallest


def search(job: Job) -> tuple[Candidate, list[Candidate]]:
    """(chosen, every candidate). The chosen one may not fit; then it is the best attempt."""
    strategies = applicable_strategies(job)
    if job.strategy != "auto" and job.strategy not in strategies:
        strategies.append(job.strategy)
    candidates = [best_for_strategy(job, s) for s in strategies]
    pool = [c for c in candidates if job.strategy in ("auto", c.strategy)]
    fitting = [c for c in pool if c.fits]
    on_gpu = [c for c in fitting if c.strategy not in OFFLOADED]
    if on_gpu:
        # offload is the last resort: its modelled cost (PCIe, CPU Adam) leaves out DeepSpeed's
        # fetch stalls and pinned-memory pressure, so it never wins on a small modelled margin
        fitting = on_gpu
    if fitting:
        chosen = min(fitting, key=lambda c: (c.step_time_s, STRATEGY_ORDER.index(c.strategy)))
    else:
        chosen = min(pool, key=lambda c: c.memory.total)
    return chosen, candidates


def fmt_bytes(n: float) -> str:
    return f"{n / 1024 ** 4:.1f} TiB" if n >= 1024 ** 4 else f"{n / GIB:.1f} GiB"


def _fits_text(job: Job) -> tuple[bool, str]:
    chosen, _ = search(job)
    if not chosen.fits:
        return False, ""
    extra = ""
    if chosen.strategy in OFFLOADED:
        extra = f", needs {fmt_bytes(chosen.host_ram_bytes)} host RAM per node"
    return True, f"fits at {chosen.per_gpu_memory_gib:.1f} GiB/GPU with {chosen.strategy}{extra}"


def suggestions(job: Job, candidates: list[Candidate]) -> list[str]:
    """Concrete changes that make the recipe fit, each verified by re-planning the variant."""
    out: list[str] = []
    if job.strategy != "auto":
        for c in sorted((c for c in candidates if c.fits and c.strategy != job.strategy),
                        key=lambda c: c.step_time_s)[:2]:
            extra = (f", needs {fmt_bytes(c.host_ram_bytes)} host RAM per node"
                     if c.strategy in OFFLOADED else "")
            out.append(f"distributed.strategy: {c.strategy} fits at {c.per_gpu_memory_gib:.1f} GiB/GPU{extra}")
    variants: list[tuple[str, Job]] = []
    if job.micro_batch and job.micro_batch > 1:
        variants.append(("train.micro_batch_size: auto", replace(job, micro_batch=None)))
    if job.checkpointing == "off":
        variants.append(("train.activation_checkpointing: auto", replace(job, checkpointing="auto")))
    adapters = {"full": ["lora", "qlora"], "lora": ["qlora"]}.get(job.adapter, [])
    for adapter in adapters:
        strategy = job.strategy
        if adapter == "qlora" and strategy in OFFLOADED:
            strategy = "auto"
        variants.append((f"adapter.type: {adapter}", replace(
            job, adapter=adapter, strategy=strategy,
            reference="implicit" if job.reference == "copy" else job.reference)))
    if job.adapter == "full" and "8bit" not in job.optimizer:
        variants.append(("train.optimizer: adamw_8bit", replace(job, optimizer="adamw_8bit")))
    if job.reference == "copy":
        variants.append(("method.reference: precompute", replace(job, reference="precompute")))
    for label, variant in variants:
        ok, text = _fits_text(variant)
        if ok:
            out.append(f"{label} {text}")
    seq = job.seq_len // 2
    while seq >= 256:
        ok, text = _fits_text(replace(job, seq_len=seq))
        if ok:
            out.append(f"data.max_length: {seq} {text}")
            break
        seq //= 2
    out.extend(_hardware_suggestions(job))
    return out


def _hardware_suggestions(job: Job, limit: int = 2) -> list[str]:
    from finetune.registry import list_presets

    current = job.preset
    bigger = [p for p in list_presets() if p.vendor != "cpu" and p.name != current.name
              and p.world_size * p.gpu_memory_gib > current.world_size * current.gpu_memory_gib]
    bigger.sort(key=lambda p: (p.world_size * p.gpu_memory_gib, p.world_size))
    out = []
    for preset in bigger:
        ok, text = _fits_text(replace(job, preset=preset, nvme_path=preset.nvme_path))
        if ok:
            out.append(f"hardware: {preset.name} (--hardware {preset.name}) {text}")
            if len(out) >= limit:
                break
    return out
