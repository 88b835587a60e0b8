"""The plan as a readable table for `finetune plan`."""

from __future__ import annotations

from finetune.plan.types import GIB, Plan, memory_unit

_COLUMNS = [  # header, width, value(candidate)
    ("strategy", 19, lambda c: c.strategy),
    ("mb", 3, lambda c: str(c.micro_batch_size)),
    ("ckpt", 5, None),  # checkpointed layers: off, k/L or all
    ("sync", 4, lambda c: _sync(c.sync_each_batch)),
    ("weights", 7, lambda c: _g(c.memory.weights)),
    ("train", 6, lambda c: _g(c.memory.trainable)),
    ("grads", 6, lambda c: _g(c.memory.gradients)),
    ("optim", 6, lambda c: _g(c.memory.optimizer)),
    ("acts", 6, lambda c: _g(c.memory.activations)),
    ("logits", 6, lambda c: _g(c.memory.logits)),
    ("comm", 6, lambda c: _g(c.memory.comm_buffers)),
    ("ovhd", 5, lambda c: _g(c.memory.overhead)),
    ("total", 7, lambda c: _g(c.memory.total)),
    ("host", 7, lambda c: _g(c.host_ram_bytes)),
    ("fits", 4, lambda c: "yes" if c.fits else "no"),
    ("step s", 8, lambda c: f"{c.step_time_s:.2f}"),
    ("bound by", 10, lambda c: c.bottleneck),
]


def _sync(sync_each_batch: bool | None) -> str:
    """When FSDP2 reduce-scatters the gradients: after each micro-batch (sync_each_batch), after a step's last
    (the Trainer's no_sync), or - where that is no setting."""
    return {True: "each", False: "last", None: "-"}[sync_each_batch]


def sync_text(plan: Plan) -> str:
    """The choice line's words for Plan.sync_each_batch ('' where it is no setting)."""
    return sync_words(plan.sync_each_batch)


def sync_words(sync_each_batch: bool | None) -> str:
    """', gradients reduce-scattered ...' for a setting's sync_each_batch ('' where it is no setting)."""
    if sync_each_batch is None:
        return ""
    if sync_each_batch:
        return ", gradients reduce-scattered every micro-batch (sync_each_batch)"
    return ", gradients reduce-scattered on each step's last micro-batch (no_sync)"


def _ckpt(k: int, layers: int) -> str:
    return "off" if not k else ("all" if k == layers else f"{k}/{layers}")


def _g(n: float) -> str:
    return f"{n / GIB:.1f}"


def _params(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _active(plan: Plan) -> str:
    """Mixture-of-experts: the parameters one token uses, next to the total; a multimodal checkpoint's
    towers, which text never runs."""
    if not plan.active_params or plan.active_params >= plan.total_params:
        return ""
    towers = (
        f", {_params(plan.frozen_tower_params)} of them in frozen vision towers" if plan.frozen_tower_params else ""
    )
    return f" total{towers}, {_params(plan.active_params)} active per token"


def checkpointing_text(plan: Plan) -> str:
    """off | on (every decoder layer) | on k of L layers."""
    k = plan.checkpoint_layers
    if not k:
        return "off"
    return "on" if k == plan.num_layers else f"on {k} of {plan.num_layers} layers"


def render_plan_table(plan: Plan) -> str:
    lines = [
        f"model {plan.model} ({_params(plan.total_params)} params{_active(plan)}, "
        f"{_params(plan.trainable_params)} trainable), {plan.method} {plan.adapter}, seq {plan.seq_len}",
        f"hardware {plan.hardware}: {plan.num_nodes} node(s) x {plan.gpus_per_node} "
        f"{'process' if plan.device == 'cpu' else 'GPU'}(s)",
        "memory per GPU in GiB (host RAM per node) at its peak; step time per optimizer step; sync: FSDP2 reduces "
        "the gradients after each micro-batch or a step's last (-: no such setting); grads: those alive during "
        "the forward (a single process without accumulation frees them first: their excess over the freed "
        "activations is in ovhd)",
        "",
    ]
    header = "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w, _) in enumerate(_COLUMNS))
    lines += [header, "-" * len(header)]
    for c in plan.candidates:
        cells = [f(c) if f else _ckpt(c.checkpoint_layers, plan.num_layers) for _, _, f in _COLUMNS]
        row = "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, (_, w, _)) in enumerate(zip(cells, _COLUMNS)))
        marker = "  <- chosen" if c.strategy == plan.strategy and plan.fits else ""
        lines.append(row + marker)
        if c.reason:
            lines.append(f"{'':19}  {c.reason}")
    lines.append("")
    if plan.fits:
        lines += [
            f"choice: {plan.strategy}, micro-batch {plan.micro_batch_size}, gradient accumulation "
            f"{plan.gradient_accumulation_steps}, activation checkpointing "
            f"{checkpointing_text(plan)}{sync_text(plan)}, "
            f"{plan.per_gpu_memory_gib:.1f} {memory_unit(plan.device)} peak",
            f"estimate: {plan.step_time_s:.2f} s/step, {plan.tokens_per_second:,.0f} tokens/s, MFU {plan.mfu:.0%}",
            f"kernels: {plan.kernels}",
            *([f"basis: {plan.basis}"] if plan.basis else []),
            *([f"disk: {plan.disk}"] if plan.disk else []),
            f"why: {plan.why}",
        ]
        lines += [f"substituted: {s}" for s in plan.substitutions]
        lines += [f"warning: {w}" for w in plan.warnings]
    else:
        lines.append(f"does not fit: {plan.why}")
        if plan.suggestions:
            lines.append("what would fit:")
            lines += [f"  - {s}" for s in plan.suggestions]
        else:
            lines.append("no variant tried (QLoRA, shorter sequences, other presets) fits either")
    return "\n".join(lines)
