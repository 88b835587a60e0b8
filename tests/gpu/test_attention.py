"""finetune/train/attention.py on CUDA: the varlen flash kernel equals per-example causal attention, forward
and backward (the CPU routing tests are in tests/unit/train/test_attention.py)."""

from __future__ import annotations

import pytest
import torch

from finetune.train import attention
from tests.helpers.attention import AttentionModule, block_causal_reference, packed


def _assert_per_example_attention(out, q, k, v, lengths) -> None:
    """`out` (and its gradients for q, k, v) is each example's own causal attention (bf16 tolerances)."""
    ref = block_causal_reference(q, k, v, lengths)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for ours, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(ours.float(), theirs.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not attention.available(), reason="needs CUDA and torch.nn.attention.varlen")
@pytest.mark.parametrize("value_dim", [None, 48], ids=["same-head-size", "mla-smaller-values"])
def test_varlen_matches_per_example_attention_forward_and_backward(value_dim):
    # MLA (DeepSeek-V2/V3) gives values a smaller head size than queries and keys: padded for the flash kernel
    lengths = [7, 130, 1, 64]
    q, k, v, kwargs = packed(
        lengths, heads=8, kv_heads=2, dim=64, value_dim=value_dim, device="cuda", dtype=torch.bfloat16
    )
    for t in (q, k, v):
        t.requires_grad_(True)
    out, _ = attention.varlen_attention_forward(AttentionModule(), q, k, v, None, scaling=64**-0.5, **kwargs)
    _assert_per_example_attention(out, q, k, v, lengths)
    # 8 query heads on 2 key/value heads: which path this torch took (printed for the session's record)
    print(f"torch {torch.__version__}: grouped key/value heads native = {attention.native_gqa()}")
    assert attention.native_gqa() is not None


@pytest.mark.gpu
@pytest.mark.skipif(not attention.available(), reason="needs CUDA and torch.nn.attention.varlen")
@pytest.mark.parametrize("value_dim", [None, 48], ids=["same-head-size", "mla-smaller-values"])
def test_long_examples_on_cudnn_match_per_example_attention_forward_and_backward(value_dim):
    """model.cudnn_long_examples: examples of CUDNN_MIN_EXAMPLE_TOKENS or more run on cuDNN's causal kernel, each
    zero-padded at its end to its padded length, and the short ones around them on the varlen kernel, in row order:
    the same attention as each example's own, forward and backward."""
    from finetune.kernels import CUDNN_MIN_EXAMPLE_TOKENS, cudnn_padded_length

    long = CUDNN_MIN_EXAMPLE_TOKENS + 37  # padded by cudnn_padded_length
    assert cudnn_padded_length(long) > long
    lengths = [7, long, 130, 1, CUDNN_MIN_EXAMPLE_TOKENS, 64, 1]
    q, k, v, kwargs = packed(
        lengths, heads=8, kv_heads=2, dim=64, value_dim=value_dim, device="cuda", dtype=torch.bfloat16
    )
    for t in (q, k, v):
        t.requires_grad_(True)
    attention.register(long_examples_on_cudnn=True)
    try:
        out, _ = attention.varlen_attention_forward(AttentionModule(), q, k, v, None, scaling=64**-0.5, **kwargs)
    finally:
        attention.register(long_examples_on_cudnn=False)
    _assert_per_example_attention(out, q, k, v, lengths)
    print(f"cuDNN runs long examples on this GPU: {attention.cudnn_runs_long_examples()}")
