"""The 4-D masks a forward builds (plan/memory.py shared_mask_bytes). transformers builds a packed row's
block-diagonal boolean mask (one per kind of layer) unless finetune's mask function declines it
(train/attention.py packed_row_mask: a packed row whose example bounds the layers get, the varlen kernel reading them
and a falling-back layer building the same mask from them); the planner counts the masks that are built, and the
runs before that skip (Job.builds_packed_row_mask) as they ran."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers
from transformers.masking_utils import create_causal_mask

from finetune.plan.memory import activation_bytes, shared_mask_bytes
from finetune.registry import get_preset
from finetune.train import attention
from tests.helpers.attention import gemma3_config
from tests.helpers.recipes import shape_job

H100 = get_preset("server-8xh100").model_copy(update={"gpus_per_node": 1})


def _llama_config():
    """A one-layer Llama config under finetune's attention (what the mask builders read of it)."""
    return transformers.LlamaConfig(
        hidden_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        vocab_size=64,
        attn_implementation=attention.register(),
    )


def test_transformers_builds_a_packed_rows_boolean_mask_for_the_varlen_attention():
    config = _llama_config()
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


@pytest.mark.parametrize(("attn", "per_element"), [("varlen", 0), ("sdpa", 1), ("eager", 2), ("flash_attention_2", 0)])
def test_the_packed_rows_mask_is_counted_once_a_micro_batch(attn, per_element):
    job = _job(attn)
    row = 2 * 4096  # micro-batch 2 of 4,096-token packed sequences: one flat row
    assert shared_mask_bytes(job, micro_batch=2) == per_element * row * row
    if attn == "varlen":  # the runs that held transformers' mask: the same kept tensors as flash attention's but it
        held = replace(job, builds_packed_row_mask=True)
        assert shared_mask_bytes(held, micro_batch=2) == row * row
        with_mask = activation_bytes(held, micro_batch=2, checkpointing=True)
        without = activation_bytes(replace(job, attention="flash"), micro_batch=2, checkpointing=True)
        assert with_mask - without == pytest.approx(row * row)
        assert activation_bytes(job, micro_batch=2, checkpointing=True) == pytest.approx(without)


def test_a_model_of_full_and_sliding_layers_builds_a_mask_for_each_kind():
    """Gemma-3 builds the packed row's causal mask and its sliding-window mask (create_causal_mask and
    create_sliding_window_causal_mask, each row x row booleans); a model whose every layer slides (Mistral-7B-v0.1)
    builds only the second. Seen on transformers' own Gemma-3 text model, then the planner's count."""
    model = transformers.Gemma3TextModel(gemma3_config(attention.register())).eval()
    masks: list[torch.Tensor] = []

    def keep(module, args, kwargs):
        masks.append(kwargs["attention_mask"])

    for layer in model.layers:
        layer.register_forward_pre_hook(keep, with_kwargs=True)
    lengths = [5, 9, 2]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():  # training runs without a cache (a cache hides the packing from the mask builders)
        model(input_ids=torch.ones(1, sum(lengths), dtype=torch.long), position_ids=position_ids, use_cache=False)
    sliding, full = masks
    assert sliding is not full and sliding.shape == full.shape == (1, 1, 16, 16)
    assert full[0, 0, 13, 5] and not sliding[0, 0, 13, 5]  # 8 back in the 9-token example: outside the window

    row = 2 * 4096
    gemma = shape_job(
        "gemma-3-12b", "lora", H100, seq=4096, global_batch=8, data__packing=True, train__micro_batch_size=2
    )
    mistral = shape_job(
        "mistral-7b-v0.1", "lora", H100, seq=4096, global_batch=8, data__packing=True, train__micro_batch_size=2
    )
    assert gemma.attention == mistral.attention == "varlen"
    assert shared_mask_bytes(replace(gemma, builds_packed_row_mask=True), micro_batch=2) == 2 * row * row
    assert shared_mask_bytes(replace(mistral, builds_packed_row_mask=True), micro_batch=2) == row * row
    assert shared_mask_bytes(gemma, micro_batch=2) == shared_mask_bytes(mistral, micro_batch=2) == 0


def _gemma3_pair(*, bidirectional: bool = False):
    """A tiny Gemma-3 under finetune's attention with the mask hooks, the same weights under sdpa, and the list the
    first one's layers append the mask they get to."""
    models = []
    for name in (attention.register(), "sdpa"):
        config = gemma3_config(name)
        config.use_bidirectional_attention = bidirectional
        torch.manual_seed(0)
        models.append(transformers.Gemma3ForCausalLM(config).eval())
    ours, theirs = models
    attention.skip_packed_row_masks(ours)
    seen: list = []
    for layer in ours.model.layers:
        layer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["attention_mask"]), with_kwargs=True)
    return ours, theirs, seen


def _packed_row():
    """A row of three examples (5, 9 and 2 tokens): its ids, position_ids and the bounds TRL's collator passes."""
    lengths = [5, 9, 2]
    ids = torch.randint(0, 64, (1, sum(lengths)))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    return ids, position_ids, dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)


def test_a_packed_row_with_its_bounds_gets_no_mask_from_transformers_and_the_same_logits():
    """With the hooks of attention.skip_packed_row_masks, a forward given the example bounds (as TRL's padding-free
    collator gives them) builds no mask; on CPU every layer falls back to sdpa, which gets the mask built from the
    bounds (the sliding layer's with its window): the logits are sdpa's with transformers' own masks. Without the
    bounds, transformers' masks are built as before."""
    ours, theirs, seen = _gemma3_pair()
    ids, position_ids, bounds = _packed_row()
    with torch.no_grad():
        packed = ours(input_ids=ids, position_ids=position_ids, use_cache=False, **bounds).logits
        assert seen == [None, None] and attention.skipped_packed_row_masks()
        reference = theirs(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        torch.testing.assert_close(packed, reference)
        seen.clear()
        ours(input_ids=ids, position_ids=position_ids, use_cache=False)  # no bounds: transformers' masks
        assert all(m is not None and m.shape == (1, 1, 16, 16) for m in seen)


def test_a_bidirectional_model_keeps_transformers_masks():
    """A Gemma-3 with use_bidirectional_attention (its layers not causal, so every one falls back from the causal
    kernel): transformers' bidirectional masks are built as before, the bounds notwithstanding, and the logits are
    sdpa's."""
    ours, theirs, seen = _gemma3_pair(bidirectional=True)
    ids, position_ids, bounds = _packed_row()
    with torch.no_grad():
        got = ours(input_ids=ids, position_ids=position_ids, use_cache=False, **bounds).logits
        expected = theirs(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    assert seen and all(m is not None for m in seen)
    torch.testing.assert_close(got, expected)


def test_only_a_plain_causal_packed_row_goes_without_a_mask():
    """In a forward given a packed row's bounds, transformers' causal mask is declined; a causal mask with a model's
    own overlay (built with vmap, as Gemma-3's bidirectional image tokens) is not."""
    config = _llama_config()

    class Masks(torch.nn.Module):
        def forward(self, embeds, position_ids, **bounds):
            overlay = {"or_mask_function": lambda *a: torch.tensor(False)}
            return (
                create_causal_mask(config, embeds, None, None, position_ids=position_ids),
                create_causal_mask(config, embeds, None, None, position_ids=position_ids, **overlay),
            )

    masks = Masks()
    attention.skip_packed_row_masks(masks)
    lengths = [5, 9, 2]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    causal, overlaid = masks(torch.zeros(1, 16, 16), position_ids, cu_seq_lens_q=cu)
    assert causal is None and overlaid is not None and overlaid.shape == (1, 1, 16, 16)
    causal, _ = masks(torch.zeros(1, 16, 16), position_ids)  # no bounds: built
    assert causal is not None and causal.shape == (1, 1, 16, 16)
