"""finetune/train/attention.py: packed rows on torch's varlen flash kernel, everything else on sdpa.

The kernel needs CUDA, so the equivalence test is in tests/gpu/test_attention.py; the routing (which batches take the
varlen path, that the fallback is transformers' own sdpa) is checked on CPU with a real Llama layer.
"""

from __future__ import annotations

import torch

from finetune.train import attention
from tests.helpers.attention import AttentionModule, packed
from tests.helpers.paths import TINY_MODEL


def test_bounds_only_for_one_packed_row():
    q, k, _, kwargs = packed([3, 5])
    assert attention._packed_bounds(q, k, kwargs)[1] == 5
    assert attention._packed_bounds(q, k, {}) is None  # no boundaries: not packed
    assert attention._packed_bounds(q.expand(2, -1, -1, -1), k, kwargs) is None  # padded batch of rows
    assert attention._packed_bounds(q[:, :, :1], k, kwargs) is None  # one query against a cache


def test_without_boundaries_it_is_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q, k, v, _ = packed([6])
    ours, _ = attention.varlen_attention_forward(AttentionModule(), q, k, v, None, scaling=0.25)
    theirs, _ = sdpa_attention_forward(AttentionModule(), q, k, v, None, scaling=0.25)
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


def _mask(**overrides):
    """What the registered mask function returns for one packed training row (CUDA, bf16), with overrides (None:
    the argument left out); 'sdpa' where it hands the request to sdpa's mask function unchanged."""
    from transformers import LlamaConfig

    args = dict(batch_size=1, q_length=8, kv_length=8, device="cuda", dtype=torch.bfloat16, config=LlamaConfig())
    args.update(overrides)  # the device is only named, never used: the decision reads it
    args = {k: v for k, v in args.items() if v is not None}
    seen = {}
    got = attention.varlen_mask(lambda **kw: seen.update(kw) or "sdpa", **args)
    assert got is None or seen == args  # passed through as transformers gave it
    return got


def test_a_packed_row_the_kernel_runs_gets_no_mask():
    """transformers would build a (1, 1, T, T) block-diagonal mask from the position_ids for every forward:
    T^2 bytes that the kernel never reads. Anything the kernel does not run keeps sdpa's mask."""
    from transformers import Gemma2Config

    assert _mask() is None
    assert _mask(local_size=4) == "sdpa"  # a sliding window's mask: its layers fall back
    assert _mask(batch_size=2, q_length=8) == "sdpa"  # padded rows
    assert _mask(attention_mask=torch.ones(1, 8, dtype=torch.bool)) == "sdpa"
    assert _mask(q_length=1, kv_offset=7) == "sdpa"  # a cache
    assert _mask(dtype=torch.float32) == "sdpa"
    assert _mask(config=Gemma2Config()) == "sdpa"  # soft-capped: every layer falls back
    assert _mask(device="cpu") == "sdpa"
    # transformers releases that pass cache_position instead of q_length/q_offset (and no device: its tensor's)
    position = torch.arange(8)
    assert _mask(q_length=None, device=None, cache_position=position) == "sdpa"  # a CPU tensor
    assert attention._one_unpadded_row({"batch_size": 1, "kv_length": 8, "cache_position": position})
    assert not attention._one_unpadded_row({"batch_size": 1, "kv_length": 8, "cache_position": position[-1:]})


def test_a_layer_that_falls_back_without_a_mask_builds_its_packed_row_mask():
    """CPU is a fallback: given no mask and the row's boundaries, the layer masks each example to itself."""
    from tests.helpers.attention import block_causal_reference

    lengths = [3, 5, 2]
    q, k, v, kwargs = packed(lengths)
    ours, _ = attention.varlen_attention_forward(AttentionModule(), q, k, v, None, **kwargs)
    torch.testing.assert_close(ours, block_causal_reference(q, k, v, lengths), rtol=1e-4, atol=1e-5)
    mask = attention.block_mask(kwargs["cu_seq_lens_q"], 10, causal=False)[0, 0]
    assert mask[0, 2] and not mask[2, 3] and mask[4, 7] and not mask[9, 0]


def test_a_packed_row_without_boundaries_is_kept_apart_by_its_position_ids():
    """A packed row whose cu_seq_lens did not come along (no mask either): the position_ids' restarts bound it."""
    from tests.helpers.attention import block_causal_reference

    lengths = [4, 2, 5]
    q, k, v, _ = packed(lengths)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    ours, _ = attention.varlen_attention_forward(AttentionModule(), q, k, v, None, position_ids=positions)
    torch.testing.assert_close(ours, block_causal_reference(q, k, v, lengths), rtol=1e-4, atol=1e-5)
    assert attention._bounds_from_positions(torch.arange(11)[None], 11) is None  # one sequence: plain causal
    # the layers of one forward share the answer for their (same) position_ids tensor
    first = attention._bounds_from_positions(positions, 11)
    assert attention._bounds_from_positions(positions, 11) is first and first[0].tolist() == [0, 4, 6, 11]
