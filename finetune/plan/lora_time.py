"""The step time adapter.fused_lora saves against peft's LoRA layer: elementwise passes and their kernels.

peft's layer (tuners/lora/layer.py) computes `result + lora_B(lora_A(dropout(x))) * scaling` through
autograd. Per targeted module, token and feature, with a the compute dtype's bytes, beyond what the
fused layer (finetune/train/fused_lora.py) moves:
  forward   lora_B writes its (out) product (a), the scale reads and writes it (2a), the add reads it
            and the base output and writes the sum (3a): 6a, where the fused `addmm_` reads the base
            output and writes it back (2a): 4a per output feature saved;
  backward  the scale's gradient is a pass over the (out) gradient (2a), which the fused backward puts
            in the small (tokens x r) product instead: 2a per output feature; the adapter's input gradient
            is written (a) and added to the base's (3a), where the fused `addmm_` reads and writes the
            base's (2a): 2a per input feature, when the adapter reads the layer's input itself (no
            dropout; with dropout the adapter's input is another tensor and autograd adds the two).
Those passes move bytes, not FLOPs: timed at the streaming bandwidth (plan/bandwidth.py). The GPU
efficiency of plan/timing.py is calibrated on peft's layer, whose compute time C includes them; the fused
layer is planned as C less their share of it, C x S / (C + S) for S seconds of passes (`fused_lora_share`):
about S where the passes are a small part of the step (8B: S / C ~ 0.1), never all of C for a model so
small that its passes would outweigh its FLOPs' time. Measured on 8B LoRA, one H100 (docs/benchmarks.md):
+8.8% steady tokens/s (13,996 -> 15,225); this model plans +10.5% (13,143 -> 14,529). The fused layer also
launches two kernels fewer per module and micro-batch (the scale and the add, forward and backward, against
two in-place GEMMs: 21,266 -> 19,486 kernel launches over 896 module passes in the same profiles).

With adapter.fused_lora_groups the linears that read one input (SHARED_INPUT_NAMES: q/k/v, gate/up; k of
them, in_features each) run as one function (finetune/train/fused_lora.py), which saves per token and group,
beyond the above:
  forward   one GEMM reads the input for all k adapters' A: a x in_features x (k - 1), again in a recompute;
  backward  the base GEMMs accumulate their input gradients in place (reading the sum, a) where autograd
            adds each to the others (3a): 2a x in_features x (k - 1); one adapter GEMM adds every adapter's
            share (2a saved per further member: it reads and writes the sum once): 2a x in_features x (k - 1);
            one GEMM reads the input for the A gradients: a x in_features x (k - 1);
and 6k - 8 kernels a micro-batch (the A GEMMs, casts, adds and adapter GEMMs of the k - 1 further members,
less the concatenations): 10 for q/k/v, 4 for gate/up. Without dropout only (with it each adapter reads its
own input).

It runs where peft's own forward would not be taken instead: plain LoRA (adapter.fuses_lora), not under
ZeRO-3 (its partitioned parameters are gathered only by each submodule's own forward) and not where peft
casts the adapter's input to fp32 (adapter.cast_adapter_inputs).
"""

from __future__ import annotations

from finetune import strategies
from finetune.plan.bandwidth import memory_seconds
from finetune.plan.memory import adapter_input_casts
from finetune.plan.workload import Job, computed_tokens_per_micro_batch, layer_kinds, targeted_linears

KERNELS_SAVED_PER_FUSED_LINEAR = 2.0

# the sibling linears of a decoder layer that read one input, by the names transformers gives them (Llama, Qwen,
# Mistral, Gemma: attention's q/k/v, the gated MLP's gate/up; the split ones of workload.NORM_OUTPUT_READERS):
# adapter.fused_lora_groups runs each set as one
SHARED_INPUT_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def shared_input_groups(job: Job) -> list[tuple[int, int, int]]:
    """(how many in the model, in_features, members) of each set of targeted linears that adapter.fused_lora_groups
    runs as one function (none with dropout, which gives each adapter its own input)."""
    if not job.fused_lora_groups or job.lora_dropout != 0:
        return []
    return [
        (count * shapes[names[0]][2], shapes[names[0]][0], len(names))
        for count, _, shapes in layer_kinds(job.arch)
        for names in SHARED_INPUT_NAMES
        if all(name in shapes and name in job.lora_targets for name in names)
    ]


def grouped_kernels_saved(job: Job, strategy: str) -> float:
    """Kernels a micro-batch the groups do not launch (module docstring), 0 where the fused layer does not run."""
    if not fused_lora_runs(job, strategy):
        return 0.0
    return sum(n * (6 * k - 8) for n, _, k in shared_input_groups(job))


def fused_lora_runs(job: Job, strategy: str) -> bool:
    """Whether the fused LoRA layer takes its own path in this job (else peft's forward runs)."""
    return (
        job.fused_lora
        and job.adapter == "lora"
        and strategies.info(strategy).zero_stage != 3
        and not adapter_input_casts(job, strategy)
    )


def fused_lora_saved_seconds(job: Job, *, strategy: str, micro_batch: int, checkpointed_share: float) -> float:
    """Seconds of one micro-batch's elementwise passes that the fused layer does not run (0 where it does
    not run); activation checkpointing repeats the forward's share."""
    if not fused_lora_runs(job, strategy):
        return 0.0
    linears = targeted_linears(job.arch, job.lora_targets)
    out_features = sum(n * fout for n, _, fout in linears)
    in_features = sum(n * fin for n, fin, _ in linears)
    a = job.act_bytes
    grouped = sum(n * a * fin * (k - 1) for n, fin, k in shared_input_groups(job))
    forward = 4 * a * out_features + grouped
    backward = 2 * a * out_features + (2 * a * in_features if job.lora_dropout == 0 else 0) + 5 * grouped
    tokens = computed_tokens_per_micro_batch(job, micro_batch)
    return memory_seconds(job.preset, tokens * ((1.0 + checkpointed_share) * forward + backward))


def fused_lora_share(compute: float, saved: float) -> float:
    """Seconds the fused layer takes off a calibrated compute time that includes `saved` seconds of peft's
    passes: their share of it, compute x saved / (compute + saved) (see the module docstring)."""
    return compute * saved / (compute + saved) if saved > 0 else 0.0
