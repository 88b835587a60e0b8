"""The step time eager attention adds: passes over the materialized scores that the FLOPs do not see.

A flash or varlen kernel keeps the (heads x queries x keys) scores on chip; eager attention (transformers'
`eager_attention_forward`, which finetune runs for soft-capped and sink layers (plan/workload.py
needs_model_eager), e.g. models/gemma2/modeling_gemma2.py) writes them to memory and runs one kernel per
step over them. Per score element, with `a` the compute
dtype's bytes and fp32 softmax (4 bytes), reads + writes of each CUDA kernel:
  forward   QK^T writes the scores (a); `* scaling` (2a); soft-capping `/ cap`, tanh, `* cap` (6a); the
            additive mask, read per element (3a); softmax to fp32, one kernel on CUDA (half_to_float:
            a + 4); the cast back (4 + a); the PV matmul reads them (a)   = 15a + 8 with soft-capping
  backward  the PV matmul's grad writes dP and its dV reads P (2a); the cast's backward (a + 4); softmax's
            backward reads grad and output in fp32 and writes the input dtype (8 + a); soft-capping's
            three (`* cap` 2a, tanh 3a with its saved output, `/ cap` 2a); `* scaling` (2a); QK^T's
            grads read dS twice (2a)                                   = 15a + 12 with soft-capping
(On CPU the fp32 casts around softmax are kernels of their own; tests/unit/plan/test_eager_time.py
traces the ops.) Without soft-capping the forward drops 6a and the backward 7a.
With attention sinks (GPT-OSS's eager_attention_forward: the sink logit is concatenated as one more key,
the row's max subtracted, softmax in the compute dtype, the sink column sliced off) no fp32 passes and no
soft-capping, per element of the (keys + 1)-wide scores:
  forward   QK^T (a); `* scaling` (2a); the mask (3a); cat (2a); max reads (a); `- max` (2a); softmax (2a);
            the PV matmul reads them (a)                                = 14a
  backward  the PV matmul's grad and dV (2a); the slice's backward pads a column (2a); softmax's backward
            (3a); the max's gradient: neg (2a), zeros (a), scatter (2a), its add (3a); `* scaling` (2a);
            QK^T's grads (2a)                                           = 19a Checkpointed layers run
the forward again. The elements are the executed attention positions (`executed_attention_positions`:
a packed row under a mask computes every block) x tokens x heads, timed at the bandwidth streaming
kernels reach (plan/bandwidth.py), as the DoRA and mask passes are. Not counted: kernel launch latency,
repeat_kv's copies of keys and values.
"""

from __future__ import annotations

from finetune.plan.bandwidth import memory_seconds
from finetune.plan.workload import Job, computed_tokens_per_micro_batch, executed_attention_positions

FP32 = 4


def score_pass_bytes(job: Job) -> tuple[float, float]:
    """(forward, backward) bytes moved per score element by eager attention (module docstring)."""
    a = job.act_bytes
    if job.arch.attention_sinks:
        return 14 * a, 19 * a
    softcap = bool(job.arch.attn_logit_softcap)
    forward = 15 * a + 2 * FP32 - (0 if softcap else 6 * a)
    backward = 15 * a + 3 * FP32 - (0 if softcap else 7 * a)
    return forward, backward


def eager_seconds(job: Job, *, micro_batch: int, checkpointed_share: float = 0.0) -> float:
    """Seconds one micro-batch's forward and backward spend on eager attention's score passes, per GPU
    (0 for the fused kernels, or when the preset has no memory bandwidth)."""
    if job.attention != "eager":
        return 0.0
    elements = (
        job.arch.num_attention_heads
        * computed_tokens_per_micro_batch(job, micro_batch)
        * executed_attention_positions(job, micro_batch=micro_batch)
    )
    forward, backward = score_pass_bytes(job)
    return memory_seconds(job.preset, elements * ((1 + checkpointed_share) * forward + backward))
