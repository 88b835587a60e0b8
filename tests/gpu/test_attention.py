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


@pytest.mark.gpu
@pytest.mark.skipif(not attention.available(), reason="needs CUDA and torch.nn.attention.varlen")
def test_long_examples_on_cudnn_keep_one_output_copy_more_than_the_varlen_kernel():
    """What the cuDNN path keeps for the backward beyond the varlen kernel (plan/memory.py
    cudnn_kept_bytes_per_token_layer): cuDNN's own output, of which the row's concatenated output is a second copy,
    and the zero padding of its copies of q, k and v; not the row's q, k and v themselves, which the short examples'
    copies leave free."""
    from finetune.kernels import CUDNN_MIN_EXAMPLE_TOKENS, cudnn_padded_length

    long = 2 * CUDNN_MIN_EXAMPLE_TOKENS + 100
    lengths = [long, 700, 300]
    heads, kv_heads, dim, total = 16, 4, 128, sum(lengths)
    kwargs = packed(lengths, device="cuda")[3]
    g = torch.Generator(device="cuda").manual_seed(0)
    leaves = [
        torch.randn(1, total, n, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(True)
        for n in (heads, kv_heads, kv_heads)
    ]

    def kept(on_cudnn: bool) -> int:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        # the model's layout, (1, t, h, d) projections seen as (1, h, t, d); `* 1.0` keeps nothing for its backward
        q, k, v = ((x * 1.0).transpose(1, 2) for x in leaves)
        attention.register(long_examples_on_cudnn=on_cudnn)
        try:
            out, _ = attention.varlen_attention_forward(AttentionModule(), q, k, v, None, scaling=dim**-0.5, **kwargs)
        finally:
            attention.register(long_examples_on_cudnn=False)
        del q, k, v
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        del out
        return held

    varlen, cudnn = kept(False), kept(True)
    out_bytes = 2 * total * heads * dim
    padding = 2 * (cudnn_padded_length(long) - long) * (2 * heads + 2 * kv_heads) * dim
    extra = cudnn - varlen
    print(f"kept: varlen {varlen / 2**20:.1f} MiB, cuDNN {cudnn / 2**20:.1f} MiB, output {out_bytes / 2**20:.1f} MiB")
    assert 0.9 * out_bytes <= extra <= 1.05 * (out_bytes + padding) + 2**20
