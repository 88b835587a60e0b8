"""finetune/train/attention.py on CUDA: the varlen flash kernel equals per-example causal attention, forward
and backward (the CPU routing tests are in tests/unit/train/test_attention.py)."""

from __future__ import annotations

import pytest
import torch

from finetune.train import attention
from tests.helpers.attention import AttentionModule, block_causal_reference, packed


@pytest.mark.gpu
@pytest.mark.skipif(not attention.available(), reason="needs CUDA and torch.nn.attention.varlen")
def test_varlen_matches_per_example_attention_forward_and_backward():
    lengths = [7, 130, 1, 64]
    q, k, v, kwargs = packed(lengths, heads=8, kv_heads=2, dim=64, device="cuda", dtype=torch.bfloat16)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, _ = attention.varlen_attention_forward(AttentionModule(), q, k, v, None, scaling=64**-0.5, **kwargs)
    ref = block_causal_reference(q, k, v, lengths)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for ours, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(ours.float(), theirs.float(), atol=5e-2, rtol=5e-2)
    # 8 query heads on 2 key/value heads: which path this torch took (printed for the session's record)
    print(f"torch {torch.__version__}: grouped key/value heads native = {attention.native_gqa()}")
    assert attention.native_gqa() is not None


@pytest.mark.gpu
@pytest.mark.skipif(not attention.available(), reason="needs CUDA and torch.nn.attention.varlen")
def test_a_packed_row_through_the_model_without_a_mask_equals_its_examples_one_by_one():
    """The registered mask function gives a packed bf16 row on CUDA no mask (varlen_mask); the varlen kernel
    keeps the examples apart from cu_seq_lens alone: each example's logits are its own run's."""
    from transformers import AutoModelForCausalLM
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from tests.helpers.paths import TINY_MODEL

    name = attention.register()
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, attn_implementation=name, dtype=torch.bfloat16).cuda()
    lengths = [5, 9, 3]
    g = torch.Generator().manual_seed(0)
    examples = [torch.randint(3, model.config.vocab_size, (n,), generator=g).cuda() for n in lengths]
    ids = torch.cat(examples)[None]
    positions = torch.cat([torch.arange(n) for n in lengths]).cuda()[None]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32).cuda()
    masks = []
    mask_fn = ALL_MASK_ATTENTION_FUNCTIONS[name]
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, lambda *a, **k: masks.append(mask_fn(*a, **k)) or masks[-1])
    try:
        with torch.no_grad():
            packed_logits = model(
                input_ids=ids,
                position_ids=positions,
                cu_seq_lens_q=cu,
                cu_seq_lens_k=cu,
                max_length_q=9,
                max_length_k=9,
            ).logits[0]
            alone = [model(input_ids=e[None]).logits[0] for e in examples]
    finally:
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask_fn)
    assert masks[0] is None  # the packed row got no (1, 1, 17, 17) mask
    torch.testing.assert_close(packed_logits.float(), torch.cat(alone).float(), atol=3e-2, rtol=3e-2)
