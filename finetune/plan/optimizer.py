"""Optimizer state and step temporaries by optimizer, from the tensors it steps. Pure arithmetic.

Each offered optimizer (recipe `train.optimizer`) as its library allocates it: torch's AdamW, bitsandbytes'
8-bit and paged variants (bitsandbytes/optim/optimizer.py Optimizer2State), transformers' Adafactor
(transformers/optimization.py).
"""

from __future__ import annotations

from finetune.plan.workload import Job, Tensors, adapter_tensors, model_tensors, numel, saved_module_tensors

BNB_BLOCK, BNB_MIN_8BIT_SIZE = 256, 4096  # bitsandbytes' 8-bit state block and smallest 8-bit tensor
# bitsandbytes' optimizer kernels take a tensor's element count as a C int (csrc/ops.cu: `int n`): a larger
# tensor fails at the first step with CUDA's "invalid argument" (DeepSpeed ZeRO-2 hands the optimizer one flat
# tensor of a rank's whole partition: a full 7B on one H200 did, docs/validation.md)
BNB_MAX_ELEMENTS = 2**31 - 1


def optimizer_bytes(optimizer: str, tensors: Tensors, *, param_bytes: float, flat: bool) -> float:
    """The optimizer state of `tensors` as each offered optimizer allocates it.

    `param_bytes` is the dtype of the parameters the optimizer steps (fp32 masters, or the model dtype
    where DDP trains it in place); `flat`: DeepSpeed hands its optimizer flat 1-D fp32 partitions
    (ZeRO's single_partition_of_fp32_groups / fp32_partitioned_groups_flat), so Adafactor cannot factor
    them and keeps a full second moment."""
    total = 0.0
    for count, shape in tensors:
        n = numel(shape)
        if optimizer in ("adamw", "adamw_torch_fused"):
            per = 2 * param_bytes * n  # torch AdamW: exp_avg and exp_avg_sq like the parameter
        elif optimizer == "paged_adamw_32bit":
            per = 8 * n  # bitsandbytes' 32-bit states are fp32 whatever the parameter's dtype
        elif optimizer in ("adamw_8bit", "paged_adamw_8bit"):
            # uint8 state1/state2 + an fp32 absmax each per 256-element block; a tensor under
            # bitsandbytes' min_8bit_size keeps fp32 states
            per = 8 * n if n < BNB_MIN_8BIT_SIZE else 2 * n + 2 * 4 * -(-n // BNB_BLOCK)
        elif optimizer == "adafactor":
            # transformers' Adafactor (beta1 None: no first moment): fp32 row and column means of the
            # squared gradient of a matrix (shape[:-1] and shape[:-2] + shape[-1:]), a full fp32 second
            # moment of a vector
            if flat or len(shape) < 2:
                per = 4 * n
            else:
                per = 4 * (numel(shape[:-1]) + numel(shape[:-2]) * shape[-1])
        else:
            raise ValueError(f"no state model for optimizer {optimizer!r}")
        total += count * per
    return total


def optimizer_step_transient_bytes(job: Job, *, flat: bool, shard: int) -> float:
    """Temporaries of the optimizer step, which runs after the backward has freed the activations.
    torch's fused AdamW and bitsandbytes' kernels make none worth counting; transformers' Adafactor steps
    tensor by tensor through fp32 copies (the gradient, the 16-bit parameter, the squared-gradient update
    and its factored approximation): about 3 fp32 copies of the largest tensor it steps (DeepSpeed: this
    rank's flat partition)."""
    if job.optimizer != "adafactor":
        return 0.0
    return 3 * 4 * largest_stepped_elements(job, flat=flat, shard=shard)


def largest_stepped_elements(job: Job, *, flat: bool, shard: int, sub_group: float | None = None) -> float:
    """Elements of the largest tensor the optimizer steps on one rank: DeepSpeed's flat partition of the trained
    parameters (`flat`; ZeRO-3 cuts it into sub-groups of at most `sub_group` elements), else the largest trained
    tensor, split `shard` ways (FSDP2 shards each tensor)."""
    tensors = trained_tensors(job)
    if flat:
        largest = sum(n * numel(shape) for n, shape in tensors) / shard
        return min(largest, sub_group) if sub_group else largest
    return max((numel(shape) for _, shape in tensors), default=0) / shard


def trained_tensors(job: Job) -> Tensors:
    if job.adapter == "full":
        return model_tensors(job.arch)
    return adapter_tensors(job) + saved_module_tensors(job)
