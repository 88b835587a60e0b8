"""After a rank ran out of memory: a setting that fits, chosen with the evidence. Pure arithmetic.

The planner predicted the failed setting X at total(X) = other(X) + act(X), where act is the part
that grows with the micro-batch and shrinks with activation checkpointing (activations and the loss
head, with their fragmentation share). The run proved that X needs more than the memory the rank had:
at least its measured peak plus the allocation that failed, and more than its capacity. The whole
miss is attributed to the activation term, the least certain one: it is scaled by

    scale = (demand(X) - other'(X)) / act(X),    other' = max(other, what the rank held when training began)

(the measured baseline keeps a miss in the fixed part, e.g. a CPU process's address space, from being
blamed on the activations), and every setting Y of the same strategy and the same global batch (another
micro-batch with more accumulation, activation checkpointing on, and for FSDP2 with accumulation
reduce-scattering every micro-batch: choose.sync_options) is predicted at other'(Y) + scale x act(Y),
which reproduces the measured demand at X. The fastest Y
(the planner's step-time model) that fits in HEADROOM of the capacity and was not tried yet is chosen.
When even other'(Y) alone does not fit, or the rank failed before its first step (loading the model), no
micro-batch or checkpointing can help, and the answer says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from finetune.plan.choose import HEADROOM, evaluate, micro_batch_options, search, sync_options
from finetune.plan.memory import CUDA_CONTEXT_BYTES, FRAGMENTATION, NCCL_BYTES, footprint
from finetune.plan.render import sync_words
from finetune.plan.types import GIB, Candidate, MemoryBreakdown
from finetune.plan.workload import Job, accumulation_steps

# device memory outside a rank's allocator beyond its own CUDA context and NCCL buffers (and a margin):
# another process holds it, and no micro-batch or checkpointing setting of this run is the fix
SHARED_DEVICE_BYTES = CUDA_CONTEXT_BYTES + NCCL_BYTES + 2 * GIB


@dataclass(frozen=True)
class OomEvidence:
    """What a rank recorded when it ran out of memory (RUN_DIR/logs/oom-rank-K.json)."""

    rank: int
    micro_batch: int
    checkpointing: bool
    peak_bytes: float  # measured when it failed: max reserved on CUDA, the address space/RSS on CPU
    capacity_bytes: float  # what the rank could use: the device's memory, or the CPU address-space limit
    requested_bytes: float = 0.0  # the allocation that failed (0 when the message did not say)
    baseline_bytes: float = 0.0  # held when training began (the same kind as peak_bytes; 0: unknown)
    peak_kind: str = "max reserved"
    before_training: bool = False  # it failed loading or wrapping the model, before the first step
    other_bytes: float = 0.0  # device memory held outside the rank's allocator (other processes, its context)
    # FSDP2 reduce-scattered every micro-batch (accelerate's sync_each_batch); records written before the key
    # ran under the Trainer's default no_sync
    sync_each_batch: bool = False

    @property
    def demand_bytes(self) -> float:
        """A lower bound of what the setting needs: it did not fit in the capacity."""
        return max(self.peak_bytes + self.requested_bytes, self.capacity_bytes)

    @classmethod
    def from_record(cls, record: dict) -> OomEvidence:
        return cls(
            rank=int(record["rank"]),
            micro_batch=int(record["micro_batch_size"]),
            checkpointing=bool(record["activation_checkpointing"]),
            peak_bytes=float(record.get("peak_bytes") or 0.0),
            capacity_bytes=float(record.get("capacity_bytes") or 0.0),
            requested_bytes=float(record.get("requested_bytes") or 0.0),
            baseline_bytes=float(record.get("baseline_bytes") or 0.0),
            peak_kind=str(record.get("peak_kind", "max reserved")),
            before_training=bool(record.get("before_training", False)),
            other_bytes=float(record.get("other_bytes") or 0.0),
            sync_each_batch=bool(record.get("sync_each_batch", False)),
        )


@dataclass(frozen=True)
class Replan:
    """The setting to retry with, or (micro_batch None) why none is expected to fit."""

    micro_batch: int | None
    checkpointing: bool | None
    gradient_accumulation_steps: int | None
    scale: float  # the factor applied to the planner's activation term
    predicted_bytes: float  # the chosen setting, scaled (or the smallest one when none fits)
    limit_bytes: float  # HEADROOM x the capacity the rank had
    text: str  # one sentence for the user
    # when no setting of the strategy fits: the strategy the planner chooses within HEADROOM without tight fits
    # (choose.TIGHT_HEADROOM), e.g. an offload tier after a tight ZeRO-3 plan ran out; None when there is none
    other_strategy: str | None = None
    sync_each_batch: bool | None = None  # the setting's choose.sync_options value (None: no such setting)


def activation_term(
    job: Job, *, strategy: str, micro_batch: int, checkpointing: bool, sync_each_batch: bool = False
) -> tuple[float, float]:
    """(total, the part that scales with the micro-batch) of the planner's per-device peak, bytes."""
    memory = footprint(
        job, strategy=strategy, micro_batch=micro_batch, checkpointing=checkpointing, sync_each_batch=sync_each_batch
    ).memory
    return memory.total, _scaled_part(memory)


def _scaled_part(memory: MemoryBreakdown) -> float:
    """The part of a peak the re-plan scales by the evidence: activations and the loss head."""
    return (memory.activations + memory.logits) * (1 + FRAGMENTATION)


def _describe(micro_batch: int, checkpointing: bool, accumulation: int, sync_each_batch: bool = False) -> str:
    return (
        f"micro-batch {micro_batch} x accumulation {accumulation}, activation checkpointing "
        f"{'on' if checkpointing else 'off'}"
        + (sync_words(True) if sync_each_batch else "")  # the Trainer's default goes unsaid
    )


def replan(
    job: Job, *, strategy: str, evidence: list[OomEvidence], tried: tuple[tuple[int, bool, bool], ...] = ()
) -> Replan:
    """The fastest setting of `strategy` with the job's global batch that the evidence says fits.

    `evidence` holds the failed attempt's records (one per rank that ran out; the worst one counts),
    `tried` the (micro-batch, checkpointing, sync_each_batch) settings already run, which are never
    proposed again.
    """
    if not evidence:
        raise ValueError("replan needs at least one out-of-memory record")
    worst = max(evidence, key=lambda e: e.demand_bytes / max(e.capacity_bytes, 1.0))
    shared = [e for e in evidence if e.other_bytes > SHARED_DEVICE_BYTES]
    if shared:  # the card was not the run's alone: no setting of this run is the fix
        e = shared[0]
        return Replan(
            None,
            None,
            None,
            1.0,
            e.demand_bytes,
            HEADROOM * e.capacity_bytes,
            f"rank {e.rank}'s GPU was shared: other processes held {e.other_bytes / GIB:.2f} GiB of its "
            f"{e.capacity_bytes / GIB:.2f} GiB when it ran out (this run held {e.peak_bytes / GIB:.2f} GiB); "
            f"free the GPU (`nvidia-smi` lists its processes) and run again",
        )
    if any(e.before_training for e in evidence):
        early = next(e for e in evidence if e.before_training)
        return Replan(
            None,
            None,
            None,
            1.0,
            early.demand_bytes,
            HEADROOM * early.capacity_bytes,
            f"rank {early.rank} ran out of memory before the first step (loading or wrapping the "
            f"model, {early.peak_kind} {early.peak_bytes / GIB:.2f} GiB of "
            f"{early.capacity_bytes / GIB:.2f} GiB): no micro-batch or checkpointing setting "
            f"changes that",
        )
    total, act = activation_term(
        job,
        strategy=strategy,
        micro_batch=worst.micro_batch,
        checkpointing=worst.checkpointing,
        sync_each_batch=worst.sync_each_batch,
    )
    other = max(total - act, worst.baseline_bytes)
    scale = (worst.demand_bytes - other) / act if act > 0 else float("inf")
    limit = HEADROOM * worst.capacity_bytes
    done = set(tried) | {(worst.micro_batch, worst.checkpointing, worst.sync_each_batch)}
    ckpt_options = (True,) if worst.checkpointing else (False, True)
    free = replace(job, micro_batch=None, sync_each_batch=None)  # re-planned like the micro-batch
    options = []  # (predicted bytes, the setting as the planner evaluates it)
    # no larger micro-batch than the one that ran out: the activation scale was measured there, and a larger
    # one (even with checkpointing) leans on the model beyond that evidence
    for mb in (m for m in micro_batch_options(free) if m <= worst.micro_batch):
        for ckpt in ckpt_options:
            for sync in sync_options(free, strategy=strategy, micro_batch=mb):
                if (mb, ckpt, bool(sync)) in done:
                    continue
                c = evaluate(job, strategy=strategy, micro_batch=mb, checkpointing=ckpt, sync_each_batch=sync)
                act = _scaled_part(c.memory)
                options.append((max(c.memory.total - act, worst.baseline_bytes) + scale * act, c))
    fitting = [o for o in options if o[0] <= limit]
    failed = _describe(
        worst.micro_batch,
        worst.checkpointing,
        accumulation_steps(job, worst.micro_batch),
        worst.sync_each_batch,
    )
    evidence_text = (
        f"rank {worst.rank} ran out of memory at {failed}: it needed more than "
        f"{worst.demand_bytes / GIB:.2f} GiB ({worst.peak_kind} {worst.peak_bytes / GIB:.2f} GiB"
        + (f" + a failed request of {worst.requested_bytes / GIB:.2f} GiB" if worst.requested_bytes else "")
        + f", {worst.capacity_bytes / GIB:.2f} GiB available"
        + (f", {worst.baseline_bytes / GIB:.2f} GiB held when training began" if worst.baseline_bytes else "")
        + f"), the plan said {total / GIB:.2f} GiB; activation estimate scaled x{scale:.2f}"
    )
    if not fitting:
        smallest = min(o[0] for o in options) if options else other
        instead = _other_strategy(job, strategy)
        return Replan(
            None,
            None,
            None,
            scale,
            smallest,
            limit,
            f"{evidence_text}; no other micro-batch or checkpointing setting of {strategy} is "
            f"expected to fit (the smallest needs {smallest / GIB:.2f} GiB of {limit / GIB:.2f} "
            f"GiB usable)"
            + (
                f"; within {HEADROOM:.0%} of GPU memory the planner chooses {instead.strategy} "
                f"({instead.per_gpu_memory_gib:.1f} GiB, {instead.step_time_s:.2f} s/step)"
                if instead
                else ""
            ),
            other_strategy=instead.strategy if instead else None,
        )
    # the fastest; on equal time the larger micro-batch, no checkpointing, the Trainer's no_sync
    predicted, c = min(
        fitting,
        key=lambda o: (
            round(o[1].step_time_s, 6),
            -o[1].micro_batch_size,
            o[1].activation_checkpointing,
            bool(o[1].sync_each_batch),
        ),
    )
    accumulation = c.gradient_accumulation_steps
    setting = _describe(c.micro_batch_size, c.activation_checkpointing, accumulation, bool(c.sync_each_batch))
    return Replan(
        c.micro_batch_size,
        c.activation_checkpointing,
        accumulation,
        scale,
        predicted,
        limit,
        f"{evidence_text}; expected to fit: {setting} (same global "
        f"batch) at {predicted / GIB:.2f} GiB of {limit / GIB:.2f} GiB usable",
        sync_each_batch=c.sync_each_batch,
    )


def _other_strategy(job: Job, failed: str) -> Candidate | None:
    """The planner's choice for `job` with nothing pinned, within HEADROOM only (no tight fit), when it is
    another strategy than the one that ran out of memory."""
    chosen, _ = search(replace(job, strategy="auto", micro_batch=None, checkpointing="auto"), tight=False)
    return chosen if chosen.fits and chosen.strategy != failed else None
