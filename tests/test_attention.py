"""finetune/train/attention.py: packed rows on torch's varlen flash kernel, everything else on sdpa.

The kernel needs CUDA, so the equivalence test is marked gpu; the routing (which batches take the
varlen path, that the fallback is transformers' own sdpa) is checked on CPU with a real Llama layer.
"""

from __future__ import annotations

import pytest
import torch

from finetune.train import attention
from tests.helpers.paths import TINY_MODEL


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def _packed(lengths, *, heads=4, kv_heads=2, dim=16, device="cpu", dtype=torch.float32):
    total = sum(lengths)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, total, dim, generator=g).to(device, dtype)
    k = torch.randn(1, kv_heads, total, dim, generator=g).to(device, dtype)
    v = torch.randn(1, kv_heads, total, dim, generator=g).to(device, dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}
    return q, k, v, kwargs


def _block_causal_reference(q, k, v, lengths):
    """Each example attends causally to itself only (eager math, fp32)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[:, :, sl].float(), k[:, :, sl].float(), v[:, :, sl].float(), is_causal=True))
        start += n
    return torch.cat(outs, dim=2).transpose(1, 2)  # (b, s, h, d)


def test_bounds_only_for_one_packed_row():
    q, k, _, kwargs = _packed([3, 5])
    assert attention._packed_bounds(q, k, kwargs)[1] == 5
    assert attention._packed_bounds(q, k, {}) is None  # no boundaries: not packed
    assert attention._packed_bounds(q.expand(2, -1, -1, -1), k, kwargs) is None  # padded batch of rows
    assert attention._packed_bounds(q[:, :, :1], k, kwargs) is None  # one query against a cache


def test_without_boundaries_it_is_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v, _ = _packed([6])
    ours, _ = attention.varlen_attention_forward(_Module(), q, k, v, None, scaling=0.25)
    theirs, _ = sdpa_attention_forward(_Module(), q, k, v, None, scaling=0.25)
    torch.testing.assert_close(ours, theirs)


def test_registered_name_loads_a_model():
    from transformers import AutoModelForCausalLM

    name = attention.register()
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL, attn_implementation=name)
    assert model.config._attn_implementation == name
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():  # CPU: the fallback path, same logits as sdpa
        ours = model(ids).logits
        model.set_attn_implementation("sdpa")
        assert torch.allclose(ours, model(ids).logits, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not attention.available(), reason="needs CUDA and torch.nn.attention.varlen")
def test_varlen_matches_per_example_attention_forward_and_backward():
    lengths = [7, 130, 1, 64]
    q, k, v, kwargs = _packed(lengths, heads=8, kv_heads=2, dim=64, device="cuda", dtype=torch.bfloat16)
    for t in (q, k, v):
        t.requires_grad_(True)
    out, _ = attention.varlen_attention_forward(_Module(), q, k, v, None, scaling=64 ** -0.5, **kwargs)
    ref = _block_causal_reference(q, k, v, lengths)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for ours, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(ours.float(), theirs.float(), atol=5e-2, rtol=5e-2)
