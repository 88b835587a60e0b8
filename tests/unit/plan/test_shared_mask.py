"""The one 4-D mask transformers builds a forward (plan/memory.py shared_mask_bytes): for a packed row it is the
row's block-diagonal boolean mask, built for finetune's varlen attention too (whose kernel reads the example bounds,
never the mask) and held through the layers; the planner counts it once a micro-batch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers
from transformers.masking_utils import create_causal_mask

from finetune.plan.memory import activation_bytes, shared_mask_bytes
from finetune.registry import get_preset
from finetune.train import attention
from tests.helpers.recipes import shape_job

H100 = get_preset("server-8xh100").model_copy(update={"gpus_per_node": 1})


def test_transformers_builds_a_packed_rows_boolean_mask_for_the_varlen_attention():
    name = attention.register()
    config = transformers.LlamaConfig(
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        vocab_size=64,
        attn_implementation=name,
    )
    lengths = [5, 9, 2]
    row = sum(lengths)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    mask = create_causal_mask(config, torch.zeros(1, row, 16), None, None, position_ids=position_ids)
    assert mask is not None and mask.dtype == torch.bool and tuple(mask.shape) == (1, 1, row, row)
    assert mask.numel() * mask.element_size() == row * row
    assert not mask[0, 0, 5, 4]  # the second example does not see the first


def _job(attn: str):
    return shape_job(
        "llama-3.1-8b",
        "lora",
        H100,
        seq=4096,
        global_batch=8,
        model__attn_implementation=attn,
        data__packing=True,
        train__micro_batch_size=2,
    )


@pytest.mark.parametrize(("attn", "per_element"), [("varlen", 1), ("sdpa", 1), ("eager", 2), ("flash_attention_2", 0)])
def test_the_packed_rows_mask_is_counted_once_a_micro_batch(attn, per_element):
    job = _job(attn)
    row = 2 * 4096  # micro-batch 2 of 4,096-token packed sequences: one flat row
    assert shared_mask_bytes(job, micro_batch=2) == per_element * row * row
    if attn == "varlen":  # the same kept tensors as flash attention's but for the mask
        with_mask = activation_bytes(job, micro_batch=2, checkpointing=True)
        without = activation_bytes(replace(job, attention="flash"), micro_batch=2, checkpointing=True)
        assert with_mask - without == pytest.approx(row * row)
