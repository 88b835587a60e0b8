"""The distributed-strategy vocabulary, once: names, the planner's order, and what each one means.

Callers ask questions (`is_deepspeed(name)`, `offloads(name)`), never compare names or prefixes, so a new
tier is one row in STRATEGIES. Torch-free: the schema, planner, compiler and ranks all import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Backend = Literal["ddp", "fsdp", "deepspeed"]
Offload = Literal["none", "cpu", "nvme"]


@dataclass(frozen=True)
class StrategyInfo:
    name: str
    backend: Backend
    shards_params: bool  # weights, gradients and optimizer states are split across ranks
    hybrid: bool = False  # replicate across nodes, shard within a node
    offload: Offload = "none"  # where the sharded states live between uses
    # torch.distributed.checkpoint reshards on load: a checkpoint resumes on another world size
    reshardable: bool = False
    summary: str = ""
    zero_stage: int = 0  # DeepSpeed's ZeRO stage (0 for the torch backends)
    # what leaves the GPU when `offload` is not "none": the parameters (and with them the compute copy's
    # source) and/or the optimizer (fp32 master, moments, gradients, and the optimizer step itself)
    offload_params: bool = False
    offload_optimizer: bool = False

    @property
    def offload_level(self) -> int:
        """0 all on the GPUs, 1 optimizer only in host RAM, 2 parameters too, 3 on NVMe: the planner
        takes the lowest level anything fits at (offload's modelled cost leaves out fetch stalls)."""
        if self.offload == "nvme":
            return 3
        return 2 if self.offload_params else (1 if self.offload_optimizer else 0)


# The planner's order: among equally fast candidates the earlier one wins.
STRATEGIES: tuple[StrategyInfo, ...] = (
    StrategyInfo(
        "ddp", "ddp", shards_params=False, summary="replicate the model on every GPU; all-reduce the gradients"
    ),
    StrategyInfo("fsdp2", "fsdp", shards_params=True, reshardable=True, summary="FSDP2 full shard across every GPU"),
    StrategyInfo(
        "fsdp2-hybrid",
        "fsdp",
        shards_params=True,
        hybrid=True,
        reshardable=True,
        summary="FSDP2 hybrid shard: shard within a node, replicate across nodes",
    ),
    StrategyInfo(
        "zero2",
        "deepspeed",
        shards_params=False,
        zero_stage=2,
        summary="DeepSpeed ZeRO-2: gradients and optimizer states sharded, parameters replicated "
        "(no parameter gathering)",
    ),
    StrategyInfo("zero3", "deepspeed", shards_params=True, zero_stage=3, summary="DeepSpeed ZeRO-3 across every GPU"),
    StrategyInfo(
        "zero3-optim-offload",
        "deepspeed",
        shards_params=True,
        zero_stage=3,
        offload="cpu",
        offload_optimizer=True,
        summary="ZeRO-3 with the optimizer states and CPU Adam in host RAM; parameters stay on the GPUs",
    ),
    StrategyInfo(
        "fsdp2-offload",
        "fsdp",
        shards_params=True,
        reshardable=True,
        offload="cpu",
        offload_params=True,
        offload_optimizer=True,
        summary="FSDP2 with sharded parameters, gradients and the optimizer step in host RAM "
        "(accelerate's fsdp_offload_params)",
    ),
    StrategyInfo(
        "zero3-offload",
        "deepspeed",
        shards_params=True,
        zero_stage=3,
        offload="cpu",
        offload_params=True,
        offload_optimizer=True,
        summary="ZeRO-3 with parameters and optimizer states in host RAM (CPU Adam)",
    ),
    StrategyInfo(
        "zero3-nvme",
        "deepspeed",
        shards_params=True,
        zero_stage=3,
        offload="nvme",
        offload_params=True,
        offload_optimizer=True,
        summary="ZeRO-Infinity: parameters and optimizer states on NVMe",
    ),
)
_BY_NAME = {s.name: s for s in STRATEGIES}

AUTO = "auto"

# DeepSpeed ZeRO-3's optimizer sub-groups (sub_group_size, elements per rank): the compiled config sets
# them and the planner counts the host buffers DeepSpeed allocates per sub-group. NVMe offload swaps the
# optimizer states one sub-group at a time, so it takes smaller ones (its pinned swap buffers scale with it).
ZERO3_SUB_GROUP_ELEMENTS = 1_000_000_000
ZERO3_NVME_SUB_GROUP_ELEMENTS = 100_000_000
# ZeRO-3 keeps a parameter of at most this many hidden sizes of elements whole on every rank (the compiled
# stage3_param_persistence_threshold, transformers' "auto" value); larger ones are gathered by their module's
# hooks at every use, which the planner's host time counts (plan/host_time.py)
ZERO3_PERSISTENCE_HIDDEN_SIZES = 10


def zero3_persistence_threshold(hidden_size: int) -> int:
    """Elements at or below which ZeRO-3 does not partition a parameter."""
    return ZERO3_PERSISTENCE_HIDDEN_SIZES * hidden_size


NAMES: tuple[str, ...] = tuple(_BY_NAME)  # every concrete strategy, in the planner's order
# the recipe's distributed.strategy: auto (the planner chooses) or a concrete name. Spelled out for
# type checkers; the check below keeps it equal to STRATEGIES.
StrategyName = Literal[
    "auto",
    "ddp",
    "fsdp2",
    "fsdp2-hybrid",
    "zero2",
    "zero3",
    "zero3-optim-offload",
    "fsdp2-offload",
    "zero3-offload",
    "zero3-nvme",
]
if get_args(StrategyName) != (AUTO, *NAMES):
    raise ImportError("finetune.strategies: StrategyName and STRATEGIES disagree; edit both together")


def info(name: str) -> StrategyInfo:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(NAMES)}") from None


def is_fsdp(name: str) -> bool:
    return info(name).backend == "fsdp"


def is_deepspeed(name: str) -> bool:
    return info(name).backend == "deepspeed"


def offloads(name: str) -> bool:
    """States leave the GPU between uses (host RAM or NVMe)."""
    return info(name).offload != "none"


def is_hybrid(name: str) -> bool:
    return info(name).hybrid


def reshardable(name: str) -> bool:
    return info(name).reshardable


def shards_params(name: str) -> bool:
    return info(name).shards_params


def zero_stage(name: str) -> int:
    return info(name).zero_stage


def is_zero3(name: str) -> bool:
    """DeepSpeed ZeRO-3 (any offload): parameters partitioned and gathered by module hooks at each use."""
    return zero_stage(name) == 3


def offloads_params(name: str) -> bool:
    return info(name).offload_params


# bitsandbytes' 4-bit weights (Params4bit, with their quantization state) are not moved to the host by
# FSDP2's CPU offload or by ZeRO-3's parameter offload: the planner refuses those tiers for QLoRA, and
# `finetune convert` maps a peer config's parameter offload under QLoRA to the tier without it
QUANTIZED_OFFLOAD_REFUSAL = "bitsandbytes 4-bit weights cannot be offloaded to the CPU; use fsdp2 or zero3"
# bitsandbytes' optimizers allocate their state like each parameter and run their kernels on plain tensors, so FSDP2's
# sharded (DTensor) parameters fail at the first step ("got mixed torch.Tensor and DTensor": bitsandbytes issue 89;
# seen on 2 H200s, docs/validation.md thirtieth session); DeepSpeed hands them plain flat partitions (ZeRO-2 measured)
BNB_UNDER_FSDP_REFUSAL = (
    "bitsandbytes' 8-bit and paged optimizers cannot step FSDP2's sharded (DTensor) parameters: use "
    "train.optimizer: adamw under fsdp2, or distributed.strategy: zero2 or zero3, which hand the optimizer plain flat "
    "partitions"
)


def offloads_quantized_weights(name: str, *, adapter: str) -> bool:
    """`name` would offload QLoRA's 4-bit weights to the host (not done: QUANTIZED_OFFLOAD_REFUSAL)."""
    return info(name).offload_params and adapter == "qlora"


def offloads_optimizer(name: str) -> bool:
    return info(name).offload_optimizer


def offload_level(name: str) -> int:
    return info(name).offload_level


def weighs_sync_each_batch(name: str) -> bool:
    """Whether accelerate's sync_each_batch (distributed.sync_each_batch) is a setting of this tier. The
    Trainer runs every micro-batch but a step's last under accelerate's no_sync, which for FSDP2 holds every
    unit's unsharded gradients until that last one; syncing each batch reduce-scatters them every
    micro-batch instead. DeepSpeed reduces every micro-batch whatever it is set to (the Trainer never enters
    no_sync there), and DDP's buckets hold a gradient copy either way, so syncing would only add
    all-reduces. fsdp2-offload stays on no_sync: its host traffic (plan/offload_time.py) is modelled with the
    gradients coming down once per step."""
    tier = info(name)
    return tier.backend == "fsdp" and tier.offload == "none"
