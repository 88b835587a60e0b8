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
# bitsandbytes' paged optimizers keep the 8-bit or 32-bit moments (state1, state2) of a tensor of PAGED_MIN_ELEMENTS
# or more in CUDA managed memory (Optimizer8bit.get_state_buffer: functional.get_paged, cudaMallocManaged), outside
# torch's allocator, and zero-fill them there; their block absmax stays an ordinary GPU tensor. Bytes of paged moments
# an element, by optimizer
PAGED_MIN_ELEMENTS = 100_000
PAGED_STATE_BYTES = {"paged_adamw_8bit": 2, "paged_adamw_32bit": 8}
EIGHT_BIT_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")


def keeps_32bit_states(optimizer: str, *, embedding: bool, flat: bool) -> bool:
    """Whether bitsandbytes steps a tensor of an 8-bit optimizer with 32-bit states: transformers' Trainer registers
    an optim_bits 32 override for every nn.Embedding weight (Trainer.create_optimizer: GlobalOptimManager
    .register_module_override). DeepSpeed's flat partitions (`flat`) are other tensors, which it never reaches: full
    Llama-3.2-3B with paged_adamw_8bit under DDP held 8.1 GiB of paged states where 8-bit ones weigh 6.0 (its
    embedding's fp32 moments 2.9 GiB), full Llama-3.2-1B under ZeRO-2 held its 8-bit figure (docs/validation.md,
    thirty-sixth session)."""
    return embedding and not flat and optimizer in EIGHT_BIT_OPTIMIZERS


def optimizer_bytes(
    optimizer: str, tensors: Tensors, *, param_bytes: float, flat: bool, embedding: bool = False
) -> float:
    """The optimizer state of `tensors` as each offered optimizer allocates it.

    `param_bytes` is the dtype of the parameters the optimizer steps (fp32 masters, or the model dtype
    where DDP trains it in place); `flat`: DeepSpeed hands its optimizer flat 1-D fp32 partitions
    (ZeRO's single_partition_of_fp32_groups / fp32_partitioned_groups_flat), so Adafactor cannot factor
    them and keeps a full second moment; `embedding`: the tensors are nn.Embedding weights (keeps_32bit_states)."""
    if keeps_32bit_states(optimizer, embedding=embedding, flat=flat):
        return sum(count * 8 * numel(shape) for count, shape in tensors)  # fp32 state1 and state2
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


def paged_state_bytes(optimizer: str, tensors: Tensors, *, flat: bool, embedding: bool = False) -> float:
    """The part of optimizer_bytes that a paged optimizer keeps in CUDA managed memory (PAGED_STATE_BYTES); `flat`:
    DeepSpeed's one flat partition, paged whole; `embedding`: nn.Embedding weights, whose states may be 32-bit."""
    per = PAGED_STATE_BYTES.get(optimizer, 0)
    if per and keeps_32bit_states(optimizer, embedding=embedding, flat=flat):
        per = PAGED_STATE_BYTES["paged_adamw_32bit"]
    if flat:
        n = sum(count * numel(shape) for count, shape in tensors)
        return per * n if n >= PAGED_MIN_ELEMENTS else 0.0
    return sum(count * per * numel(shape) for count, shape in tensors if numel(shape) >= PAGED_MIN_ELEMENTS)


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
