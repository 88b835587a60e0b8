"""DPO with data.packing (padding-free pairs) is planned as what runs: the varlen kernel on NVIDIA over a row
of both sequences of every pair, no padding mask; on a CPU, sdpa's block-diagonal mask over that row."""

from __future__ import annotations

from finetune.plan import plan_job
from finetune.plan.memory import masked_attention
from tests.helpers.recipes import shape_job


def _dpo(packing: bool, hardware="server-8xh100"):
    return shape_job(
        "llama-3.1-8b",
        "lora",
        hardware,
        method__type="dpo",
        data__format="preference",
        data__packing=packing,
    )


def test_padding_free_pairs_run_on_the_varlen_kernel_without_a_mask():
    padded, free = _dpo(False), _dpo(True)
    assert padded.attention == "sdpa" and masked_attention(padded, micro_batch=2) == (4, 2048)
    assert free.attention == "varlen" and masked_attention(free, micro_batch=2) is None
    assert free.example_tokens is None  # pairs are planned at max_length per sequence
    a, b = plan_job(padded), plan_job(free)
    assert b.per_gpu_memory_gib <= a.per_gpu_memory_gib
    assert b.tokens_per_second >= a.tokens_per_second


def test_on_a_cpu_the_row_holds_both_sequences_of_every_pair():
    free = _dpo(True, hardware="cpu")
    assert free.attention == "sdpa" and masked_attention(free, micro_batch=3) == (1, 3 * 2 * 2048)
