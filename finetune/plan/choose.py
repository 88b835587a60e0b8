"""The search: every applicable strategy x micro-batch x activation checkpointing, then the choice.

Rule: per strategy, the fastest setting (lowest modelled step time) whose peak fits in HEADROOM of the
GPU memory (and whose offloaded states fit in host RAM / NVMe); among equally fast settings the larger
micro-batch, no checkpointing and the Trainer's no_sync win. A setting is a micro-batch, how many layers are
checkpointed and, for the FSDP2 tiers with gradient accumulation, accelerate's sync_each_batch
(`sync_options`): reduce-scattering every micro-batch frees the unsharded gradients no_sync keeps
(memory.fsdp_accumulated_gradients) for one reduce-scatter per micro-batch instead of one per step.
Across strategies, offload goes by levels first (strategies.StrategyInfo.offload_level): optimizer-only
offload is considered only when nothing fits with every state on the GPUs, parameter offload only when
optimizer-only offload does not fit either, NVMe last. Within the level, the earliest strategy in
strategies.NAMES whose step is within CLEARLY_FASTER of the fastest wins (`simplest_near_fastest`). Recipe
pins (strategy, micro-batch, checkpointing, sync_each_batch) restrict the search; a pinned strategy that
does not fit yields fits=False with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from finetune import strategies
from finetune.plan.memory import (
    AT_FINAL_SAVE,
    checkpointed_layers,
    footprint,
    peaks_at_final_save,
    shard_degree,
    state_shard_degree,
    steps_16bit_weights,
    task_eval_fits,
)
from finetune.plan.optimizer import BNB_MAX_ELEMENTS, largest_stepped_elements
from finetune.plan.timing import step_time
from finetune.plan.types import GIB, Candidate, memory_unit
from finetune.plan.workload import Job, accumulation_steps, batch_share, holds_a_micro_batch
from finetune.recipe.schema import BNB_OPTIMIZERS, bnb_under_fsdp
from finetune.strategies import ZERO3_SUB_GROUP_ELEMENTS, info, offload_level, weighs_sync_each_batch

HEADROOM = 0.90  # plan to at most 90% of GPU memory / host RAM: spikes, other processes, the CUDA context
# When no setting keeps every state on the GPUs within HEADROOM, one that does within TIGHT_HEADROOM of GPU
# memory is chosen over offloading, if it is faster. Offloading costs 2-3x in measured step time (full 14B on
# 4 x H100: 3,337 tokens/s under ZeRO-3 optimizer offload, 8,550 under FSDP2 at 98% of the card), while the
# planner's GPU peaks have never been more than 4% under a measured one (tests/unit/plan/test_calibration.py:
# lowest ratio 0.96; full fine-tunes under ZeRO-3/FSDP2 1.07-1.10), and a rank that still runs out of memory
# re-plans and resumes (finetune/plan/replan.py). Host RAM and NVMe keep HEADROOM.
TIGHT_HEADROOM = 0.95
# A strategy later in strategies.NAMES (the order from the least machinery to the most: ddp, fsdp2, hybrid,
# zero2, zero3, then the offload tiers) is chosen over an earlier one that fits only when its modelled step
# is more than this share shorter. The step-time model misses measured tokens/s by up to 25%
# (tests/unit/plan/test_calibration.py), so a few percent between two tiers is noise, and the earlier tier is the
# one with fewer moving parts (and, for fsdp2, checkpoints that reshard to another GPU count).
CLEARLY_FASTER = 0.10


def not_applicable(job: Job, strategy: str) -> str:
    """Why `strategy` makes no sense on this preset/adapter ("" when it does)."""
    p = job.preset
    tier = info(strategy)
    if p.vendor == "cpu":
        return "" if tier.backend == "ddp" else "the cpu preset runs one process; only ddp applies"
    if tier.hybrid and p.nodes < 2:
        return "hybrid sharding replicates across nodes; this preset has one node"
    if tier.hybrid and p.gpus_per_node < 2:
        # accelerate refuses an FSDP mesh whose shard dimension is 1 (seen on 2 x 1-GPU nodes)
        return (
            "hybrid sharding shards within a node; with one GPU per node use ddp (replicate) "
            "or fsdp2 (shard across nodes)"
        )
    masters_needed = steps_16bit_weights(job, "ddp")
    if tier.backend == "ddp" and job.strategy != strategy and masters_needed:
        # measured on GPUs (docs/validation.md): 12 steps of a full 3B fine-tune on one H200 took the loss to
        # 9.5 under ddp on bf16 weights, to 6.2 under zero2 (fp32 masters, 0.87x the tokens/s) and to 6.1 with
        # fp32 weights under autocast (0.81x, more memory): zero2 is the cheaper way to masters
        instead = (
            "zero2 replicates the parameters as ddp does and keeps fp32 masters"
            if not bnb_tensor_too_large(job, "zero2")
            else f"zero2, which keeps fp32 masters, cannot step {job.optimizer} here (bitsandbytes' element limit): "
            "model.dtype float32 keeps them under ddp"
        )
        return (
            f"keeps no fp32 master weights: a 16-bit full fine-tune loses most AdamW updates to rounding; {instead} "
            "(pin distributed.strategy: ddp to train without them)"
        )
    splits = tier.shards_params or tier.zero_stage >= 2
    # on one GPU ZeRO-2 shards nothing but is the way to fp32 masters of a 16-bit full fine-tune
    masters_on_one_gpu = tier.zero_stage == 2 and masters_needed
    if splits and tier.offload_level == 0 and p.world_size < 2 and job.strategy != strategy and not masters_on_one_gpu:
        # never chosen on one GPU (no memory to gain), but allowed when pinned: an FSDP2
        # checkpoint saved on several GPUs resumes on one under the same strategy
        return "sharding needs more than one GPU"
    if tier.offload == "nvme" and not job.nvme_path:
        return "the preset has no NVMe path; set distributed.nvme_path"
    if strategies.offloads_quantized_weights(strategy, adapter=job.adapter):
        return strategies.QUANTIZED_OFFLOAD_REFUSAL
    if bnb_under_fsdp(job.optimizer, strategy):
        return strategies.BNB_UNDER_FSDP_REFUSAL
    if job.int8_base and tier.shards_params:
        # from_pretrained quantizes the whole base onto each rank's GPU (device_map), and neither FSDP2 nor
        # ZeRO-3 shards bitsandbytes' Int8Params; finetune's sharded load builds 4-bit weights only
        return (
            "adapter.load_in_8bit weights are not sharded (every rank would quantize the whole base onto its GPU): "
            "use ddp, or adapter.type: qlora, whose 4-bit weights fsdp2 shards"
        )
    if job.lora_experts and tier.shards_params:
        # peft's target_parameters folds each adapter into the whole expert tensor (a parametrization), which these
        # tiers hold in shards; recipe.schema refuses such a pin
        return "adapter.target_experts folds its adapters into whole expert tensors, which this tier shards"
    too_large = bnb_tensor_too_large(job, strategy)
    if too_large:
        return too_large
    pinned = job.strategy == strategy  # a user's choice that works is planned, not second-guessed
    if tier.zero_stage == 2 and job.adapter != "full" and not pinned:
        return "ZeRO-2 splits gradients and optimizer states; an adapter's are small: use ddp"
    if tier.offload_optimizer and not tier.offload_params and job.adapter != "full" and not pinned:
        return "an adapter's optimizer states are small: offloading them frees little; use zero3"
    return ""


def bnb_tensor_too_large(job: Job, strategy: str) -> str:
    """Why bitsandbytes' optimizer cannot step what `strategy` hands it ("" when it can): a tensor of more than
    BNB_MAX_ELEMENTS elements (DeepSpeed's flat partition, or one large parameter). DeepSpeed's offload tiers step
    with their own CPU Adam instead (compile/deepspeed.py)."""
    tier = info(strategy)
    if job.optimizer not in BNB_OPTIMIZERS or (tier.backend == "deepspeed" and tier.offload_optimizer):
        return ""
    deepspeed = tier.backend == "deepspeed"
    shard = state_shard_degree(job, strategy) if deepspeed else shard_degree(job, strategy)
    sub_group = ZERO3_SUB_GROUP_ELEMENTS if tier.zero_stage == 3 else None
    elements = largest_stepped_elements(job, flat=deepspeed, shard=shard, sub_group=sub_group)
    if elements <= BNB_MAX_ELEMENTS:
        return ""
    what = "its flat partition of the trained parameters" if deepspeed else "its largest trained tensor"
    return (
        f"bitsandbytes' {job.optimizer} counts a tensor's elements in a 32-bit int, and {strategy} hands it "
        f"{what} as one tensor of {elements / 1e9:.1f}B elements (at most {BNB_MAX_ELEMENTS / 1e9:.2f}B)"
    )


def applicable_strategies(job: Job) -> list[str]:
    return [s for s in strategies.NAMES if not not_applicable(job, s)]


def micro_batch_options(job: Job) -> list[int]:
    """The micro-batches weighed: every divisor of the GPU's share of the global batch (so an accumulation of whole
    micro-batches makes it exactly: 5 x 3 for a share of 15, not only 1 x 15), from the method's least."""
    if job.micro_batch:
        return [job.micro_batch]
    share = batch_share(job)
    return [m for m in range(job.min_micro_batch, share + 1) if share % m == 0]


def sync_is_a_setting(job: Job, *, strategy: str, micro_batch: int) -> bool:
    """Whether sync_each_batch changes anything: a tier where no_sync holds the gradients
    (strategies.weighs_sync_each_batch), and accumulation (one micro-batch per step always syncs)."""
    return accumulation_steps(job, micro_batch) > 1 and weighs_sync_each_batch(strategy)


def sync_options(job: Job, *, strategy: str, micro_batch: int) -> tuple[bool | None, ...]:
    """The sync_each_batch settings weighed for `strategy` at `micro_batch`: (None,) where it is no setting;
    the recipe's pin; else no_sync first, so that on equal time the Trainer's default stays."""
    if not sync_is_a_setting(job, strategy=strategy, micro_batch=micro_batch):
        return (None,)
    return (False, True) if job.sync_each_batch is None else (job.sync_each_batch,)


def usable_fraction(choice) -> float:
    """The share of GPU memory a Candidate or Plan is held to: TIGHT_HEADROOM for a tight fit."""
    return TIGHT_HEADROOM if choice.tight else HEADROOM


def evaluate(
    job: Job,
    *,
    strategy: str,
    micro_batch: int,
    checkpointing: bool | int,
    headroom: float = HEADROOM,
    sync_each_batch: bool | None = False,
) -> Candidate:
    """One setting; `checkpointing` is True (every layer), False, or how many layers (the first k);
    `headroom` the share of GPU memory it may take; `sync_each_batch` counts only where it is a setting
    (`sync_options`)."""
    p = job.preset
    k = checkpointed_layers(job, checkpointing)
    grad_accum = accumulation_steps(job, micro_batch)
    sync = bool(sync_each_batch) if sync_is_a_setting(job, strategy=strategy, micro_batch=micro_batch) else None
    fp = footprint(job, strategy=strategy, micro_batch=micro_batch, checkpointing=k, sync_each_batch=bool(sync))
    t = step_time(
        job,
        strategy=strategy,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        checkpointing=k,
        sync_each_batch=bool(sync),
    )
    reason = ""
    limit = headroom * p.gpu_memory_gib * GIB
    if fp.memory.total > limit:
        unit = "RAM" if p.vendor == "cpu" else "GPU memory"
        reason = (
            f"needs {fp.memory.total / GIB:.1f} GiB per {'process' if p.vendor == 'cpu' else 'GPU'}; "
            f"{limit / GIB:.1f} GiB usable ({headroom:.0%} of {p.gpu_memory_gib:g} GiB {unit})"
        )
    elif fp.host_ram_bytes > HEADROOM * p.host_ram_gib * GIB:
        at_save = peaks_at_final_save(
            peak=fp.host_ram_bytes, training=fp.host_ram_training_bytes, saving=fp.host_ram_saving_bytes
        )
        reason = (
            f"needs {fmt_bytes(fp.host_ram_bytes)} host RAM per node{' ' + AT_FINAL_SAVE if at_save else ''}; "
            f"{fmt_bytes(HEADROOM * p.host_ram_gib * GIB)} usable"
        )
    elif p.nvme_capacity_gib and fp.nvme_bytes > HEADROOM * p.nvme_capacity_gib * GIB:
        reason = f"needs {fmt_bytes(fp.nvme_bytes)} of NVMe per node; the preset has {p.nvme_capacity_gib:g} GiB"
    return Candidate(
        strategy=strategy,
        micro_batch_size=micro_batch,
        activation_checkpointing=k > 0,
        checkpoint_layers=k,
        memory=fp.memory,
        fits=not reason,
        host_ram_bytes=fp.host_ram_bytes,
        host_ram_training_bytes=fp.host_ram_training_bytes,
        host_ram_saving_bytes=fp.host_ram_saving_bytes,
        nvme_bytes=fp.nvme_bytes,
        compute_time_s=t.compute_s,
        comm_time_s=t.intra_s + t.inter_s + t.offload_s,
        step_time_s=t.step_s,
        bottleneck=t.bottleneck,
        reason=reason,
        gradient_accumulation_steps=grad_accum,
        tight=not reason and fp.memory.total > HEADROOM * p.gpu_memory_gib * GIB,
        sync_each_batch=sync,
    )


def _least_checkpointing(
    job: Job, *, strategy: str, micro_batch: int, headroom: float, sync_each_batch: bool | None
) -> list[Candidate]:
    """No checkpointing if it fits, else the fewest checkpointed layers that fit: memory falls and time
    rises with every layer checkpointed, so the smallest fitting k is the fastest. k = L - 1 needs less
    memory than k = L (memory.activation_bytes), so all L are never the automatic choice (L > 1)."""

    def at(k: int) -> Candidate:
        return evaluate(
            job,
            strategy=strategy,
            micro_batch=micro_batch,
            checkpointing=k,
            headroom=headroom,
            sync_each_batch=sync_each_batch,
        )

    none = at(0)
    layers = job.arch.num_layers
    if none.fits or layers == 1:
        return [none] if none.fits else [none, at(1)]
    most = at(layers - 1)
    if not most.fits:
        return [none, most]
    low, high, best = 1, layers - 1, most  # fits at high; find the smallest k that fits
    while low < high:
        mid = (low + high) // 2
        c = at(mid)
        if c.fits:
            high, best = mid, c
        else:
            low = mid + 1
    return [none, best]


def pinned_checkpointing(job: Job) -> bool | int:
    """The recipe's checkpointing pin as `evaluate` takes it: off, every layer, or the first k."""
    if job.checkpointing != "on":
        return False
    return job.checkpoint_layers if job.checkpoint_layers else True


def best_for_strategy(job: Job, strategy: str, *, headroom: float = HEADROOM) -> Candidate:
    """The fastest fitting setting of `strategy`, or its smallest-memory setting with the reason."""
    why_not = not_applicable(job, strategy)
    tried = []
    for m in micro_batch_options(job):
        for sync in sync_options(job, strategy=strategy, micro_batch=m):
            if job.checkpointing == "auto":
                tried += _least_checkpointing(
                    job, strategy=strategy, micro_batch=m, headroom=headroom, sync_each_batch=sync
                )
            else:
                tried.append(
                    evaluate(
                        job,
                        strategy=strategy,
                        micro_batch=m,
                        checkpointing=pinned_checkpointing(job),
                        headroom=headroom,
                        sync_each_batch=sync,
                    )
                )
    fitting = [c for c in tried if c.fits]
    if fitting and not why_not:
        return min(
            fitting,
            key=lambda c: (round(c.step_time_s, 6), -c.micro_batch_size, c.checkpoint_layers, bool(c.sync_each_batch)),
        )
    smallest = min(tried, key=lambda c: (c.memory.total, c.host_ram_bytes))
    if why_not:
        smallest.fits, smallest.reason = False, why_not
    return smallest


def search(job: Job, *, tight: bool = True) -> tuple[Candidate, list[Candidate]]:
    """(chosen, every candidate). The chosen one may not fit; then it is the best attempt. `tight=False`:
    without the TIGHT_HEADROOM exception (what fits within HEADROOM only)."""
    names = applicable_strategies(job)
    if job.strategy != "auto" and job.strategy not in names:
        names.append(job.strategy)
    candidates = [best_for_strategy(job, s) for s in names]
    pool = [c for c in candidates if job.strategy in ("auto", c.strategy)]
    fitting = [c for c in pool if c.fits]
    if fitting:
        # offload by levels: its modelled cost (PCIe, CPU Adam) leaves out fetch stalls and pinned-
        # memory pressure, so a deeper offload never wins on a small modelled margin
        level = min(offload_level(c.strategy) for c in fitting)
        fitting = [c for c in fitting if offload_level(c.strategy) == level]
    if fitting:
        chosen = simplest_near_fastest(fitting)
    else:
        chosen = min(pool, key=lambda c: c.memory.total)
    # GPUs only: on the cpu preset the "device" memory is the host's RAM, shared with everything else
    if tight and job.preset.vendor != "cpu" and not (chosen.fits and offload_level(chosen.strategy) == 0):
        close = _tight_fits(job, pool)
        best = simplest_near_fastest(list(close.values())) if close else None
        if best is not None and (not chosen.fits or best.step_time_s < chosen.step_time_s):
            candidates = [close.get(c.strategy, c) for c in candidates]
            chosen = best
    return chosen, candidates


def _tight_fits(job: Job, pool: list[Candidate]) -> dict[str, Candidate]:
    """{strategy: its fastest setting within TIGHT_HEADROOM} of the strategies of `pool` that keep every
    state on the GPUs and fit there."""
    tight = {}
    for c in pool:
        if offload_level(c.strategy) == 0:
            best = best_for_strategy(job, c.strategy, headroom=TIGHT_HEADROOM)  # not applicable: fits=False
            if best.fits:
                tight[c.strategy] = best
    return tight


def clearly_faster(fast_s: float, slow_s: float) -> bool:
    """A step of `fast_s` seconds beats one of `slow_s` by more than CLEARLY_FASTER: the step-time model's
    spread, within which the simpler setting is kept."""
    return slow_s > fast_s * (1 + CLEARLY_FASTER)


def simplest_near_fastest(fitting: list[Candidate]) -> Candidate:
    """The earliest strategy (strategies.NAMES) whose step is within CLEARLY_FASTER of the fastest: a
    later tier wins only by being clearly faster than every earlier one that fits."""
    fastest = min(c.step_time_s for c in fitting)
    near = [c for c in fitting if not clearly_faster(fastest, c.step_time_s)]
    return min(near, key=lambda c: (strategies.NAMES.index(c.strategy), c.step_time_s))


def fmt_bytes(n: float) -> str:
    return f"{n / 1024**4:.1f} TiB" if n >= 1024**4 else f"{n / GIB:.1f} GiB"


def _fits_text(job: Job) -> tuple[bool, str]:
    if not holds_a_micro_batch(job):  # e.g. KTO's global batch spread over more GPUs than it has rows
        return False, ""
    chosen, _ = search(job)
    if not chosen.fits or not task_eval_fits(job, chosen.memory):  # the plan would refuse its data.task_eval
        return False, ""
    extra = ""
    if strategies.offloads(chosen.strategy):
        extra = f", needs {fmt_bytes(chosen.host_ram_bytes)} host RAM per node"
    unit = memory_unit(job.preset.vendor)
    return True, f"fits at {chosen.per_gpu_memory_gib:.1f} {unit} with {chosen.strategy}{extra}"


def suggestions(job: Job, candidates: list[Candidate], *, on_preset: Callable | None = None) -> list[str]:
    """Concrete changes that make the recipe fit, each verified by re-planning the variant. `on_preset(preset)`
    is the recipe's job on another hardware preset (None where the recipe cannot run there); without it no
    hardware is suggested."""
    out: list[str] = []
    if job.strategy != "auto":
        others = [c for c in candidates if c.fits and c.strategy != job.strategy and task_eval_fits(job, c.memory)]
        for c in sorted(others, key=lambda c: c.step_time_s)[:2]:
            extra = (
                f", needs {fmt_bytes(c.host_ram_bytes)} host RAM per node" if strategies.offloads(c.strategy) else ""
            )
            out.append(f"distributed.strategy: {c.strategy} fits at {c.per_gpu_memory_gib:.1f} GiB/GPU{extra}")
    variants: list[tuple[str, Job]] = []
    if job.micro_batch and job.micro_batch > 1:
        variants.append(("train.micro_batch_size: auto", replace(job, micro_batch=None)))
    if job.checkpointing == "off":
        variants.append(("train.activation_checkpointing: auto", replace(job, checkpointing="auto")))
    if job.sync_each_batch is False:
        variants.append(("distributed.sync_each_batch: auto", replace(job, sync_each_batch=None)))
    adapters = {"full": ["lora", "qlora"], "lora": ["qlora"]}.get(job.adapter, [])
    if job.int8_base or not job.autocast:  # QLoRA would conflict: adapter.load_in_8bit, or its 16-bit compute dtype
        adapters = [a for a in adapters if a != "qlora"]
    for adapter in adapters:
        strategy = job.strategy
        if adapter == "qlora" and strategy != "auto" and strategies.offloads(strategy):
            strategy = "auto"  # bitsandbytes' 4-bit weights are not offloaded
        variants.append(
            (
                f"adapter.type: {adapter}" + (" with distributed.strategy: auto" if strategy != job.strategy else ""),
                replace(
                    job,
                    adapter=adapter,
                    strategy=strategy,
                    reference="implicit" if job.reference == "copy" else job.reference,
                ),
            )
        )
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
    if on_preset is not None:
        out.extend(_hardware_suggestions(job, on_preset))
    return out


def _hardware_suggestions(job: Job, on_preset: Callable, limit: int = 2) -> list[str]:
    """Larger presets the recipe fits on, each planned as the run there would be: its kernels (attention, Liger,
    the rows' padding) and swap path are that preset's choice, not this one's (`on_preset`)."""
    from finetune.registry import list_presets

    current = job.preset
    bigger = [
        p
        for p in list_presets()
        if p.vendor != "cpu"
        and p.name != current.name
        and p.world_size * p.gpu_memory_gib > current.world_size * current.gpu_memory_gib
    ]
    bigger.sort(key=lambda p: (p.world_size * p.gpu_memory_gib, p.world_size))
    out = []
    for preset in bigger:
        there = on_preset(preset)
        if there is None:
            continue
        ok, text = _fits_text(there)
        if ok:
            out.append(f"hardware: {preset.name} (--hardware {preset.name}) {text}")
            if len(out) >= limit:
                break
    return out
