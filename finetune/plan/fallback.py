"""What finetune's varlen attention falling back to sdpa costs a plan, said as a warning.

finetune/train/attention.py runs packed rows on torch's varlen flash kernel (sliding windows included), except in
models with logit soft-capping, attention sinks or attention dropout (`workload.varlen_fallback_layers`): their
layers go to transformers' sdpa (soft-capped and sink ones to the model's eager attention, which also keeps the
scores) with a block-diagonal mask over the whole packed row, which computes every block of the row's
(micro_batch x seq)^2 square and keeps a float mask bias of that square per layer.
"""

from __future__ import annotations

from finetune.kernels import VARLEN_WINDOW_RELEASE
from finetune.plan.memory import attention_matrix_bytes, checkpointed_layers
from finetune.plan.types import GIB, Plan
from finetune.plan.workload import Job, packed_row_fallback_layers


def attention_fallback_warning(job: Job, plan: Plan) -> str:
    """'' unless the plan runs varlen-fallback layers on packed rows; else what falls back and its
    modelled cost at the chosen micro-batch: the share of the step's FLOPs spent on masked blocks and the
    mask bytes per GPU."""
    from finetune.plan.timing import flops_per_token

    fallback = packed_row_fallback_layers(job)
    if not fallback:
        return ""
    arch, micro = job.arch, plan.micro_batch_size
    why = [f"attention logit soft-capping ({arch.attn_logit_softcap:g})"] if arch.attn_logit_softcap else []
    if arch.attention_sinks:
        why.append("attention sinks")
    if arch.attention_dropout:
        # config.json's or the recipe's model.attention_dropout (registry.resolve_model applies the recipe's)
        why.append(f"attention dropout ({arch.attention_dropout:g}; model.attention_dropout: 0 turns it off)")
    if not why:  # the sliding layers on a torch whose varlen kernel has no window (workload.varlen_fallback_layers)
        why.append(
            f"{arch.sliding_window:,}-token sliding windows on a torch older than "
            f"{VARLEN_WINDOW_RELEASE} (its varlen kernel has no window: installing a newer torch "
            "keeps them on it)"
        )
    ckpt = plan.checkpoint_layers or False
    executed = flops_per_token(job, checkpointing=ckpt, micro_batch=micro)
    useful = flops_per_token(job, checkpointing=ckpt)
    extra = max(0.0, executed - useful) / executed if executed else 0.0
    k = checkpointed_layers(job, ckpt)  # checkpointed layers keep no mask; the one recomputing does
    kept = arch.num_layers - k + (1 if k == arch.num_layers else 0)
    mask = attention_matrix_bytes(job, micro_batch=micro) * kept / GIB
    row = micro * job.seq_len
    return (
        f"{arch.key} trains here with {' and '.join(why)}, which finetune's varlen flash kernel does not run: "
        f"{fallback} of {arch.num_layers} layers use {job.attention} with a block-diagonal mask over each packed "
        f"row of {micro} x {job.seq_len} = {row} tokens, computing all {row} x {row} blocks "
        f"(modelled {extra:.0%} of the step's FLOPs) and keeping {mask:.1f} GiB of mask bias per GPU; "
        f"a smaller train.micro_batch_size shrinks the row (model.attn_implementation: "
        f"flash_attention_2 runs both natively where flash-attn is installed)"
    )
