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

It runs where peft's own forward would not be taken instead: plain LoRA (adapter.fuses_lora), not under
ZeRO-3 (its partitioned parameters are gathered only by each submodule's own forward) and not where peft
casts the adapter's input to fp32 (adapter.cast_adapter_inputs).
"""

from __future__ import annotations

from finetune import strategies
from finetune.plan.bandwidth import memory_seconds
from finetune.plan.memory import adapter_input_casts
from finetune.plan.workload import Job, computed_tokens_per_micro_batch, targeted_linears

KERNELS_SAVED_PER_FUSED_LINEAR = 2.0


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
    forward = 4 * a * out_features
    backward = 2 * a * out_features + (2 * a * in_features if job.lora_dropout == 0 else 0)
    tokens = computed_tokens_per_micro_batch(job, micro_batch)
    return memory_seconds(job.preset, tokens * ((1.0 + checkpointed_share) * forward + backward))


def fused_lora_share(compute: float, saved: float) -> float:
    """Seconds the fused layer takes off a calibrated compute time that includes `saved` seconds of peft's
    passes: their share of it, compute x saved / (compute + saved) (see the module docstring)."""
    return compute * saved / (compute + saved) if saved > 0 else 0.0
