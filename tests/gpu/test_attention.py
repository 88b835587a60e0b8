"""finetune/train/attention.py on CUDA: the varlen flash kernel equals per-example causal attention, forward
and backward (the CPU routing tests are in tests/unit/train/test_attention.py)."""

from __future__ import annotations

import pytest
import torch

from finetune.train import attention
from tests.helpers.attention import AttentionModule, block_causal_reference, gemma3_config, packed


def _assert_per_example_attention(out, q, k, v, lengths, *, sliding_window: int | None = None) -> None:
    """`out` (and its gradients for q, k, v) is each example's own causal attention (bf16 tolerances)."""
    ref = block_causal_reference(q, k, v, lengths, sliding_window=sliding_window)
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
@pytest.mark.parametrize("cudnn", [False, True], ids=["varlen", "cudnn-long-examples-on"])
def test_sliding_window_layers_match_per_example_windowed_attention(cudnn):
    """A layer that passes `sliding_window` (Gemma-3's local layers, Mistral-7B-v0.1) runs the varlen kernel with the
    window: each query sees itself and the window - 1 keys before it in its own example, forward and backward, as
    transformers' sliding-window mask says; a long example stays on the varlen kernel where cuDNN runs the full
    layers' (cuDNN has no window)."""
    from finetune.kernels import CUDNN_MIN_EXAMPLE_TOKENS

    assert attention.takes_windows(), f"torch {torch.__version__}: varlen_attn has no window_size"
    window = 48
    lengths = [7, 130, 1, 64, 47, 49] + ([CUDNN_MIN_EXAMPLE_TOKENS + 5] if cudnn else [])
    q, k, v, kwargs = packed(lengths, heads=8, kv_heads=2, dim=64, device="cuda", dtype=torch.bfloat16)
    for t in (q, k, v):
        t.requires_grad_(True)
    attention.register(long_examples_on_cudnn=cudnn)
    try:
        out, _ = attention.varlen_attention_forward(
            AttentionModule(), q, k, v, None, scaling=64**-0.5, sliding_window=window, **kwargs
        )
    finally:
        attention.register(long_examples_on_cudnn=False)
    _assert_per_example_attention(out, q, k, v, lengths, sliding_window=window)
    full = block_causal_reference(q, k, v, lengths)
    assert not torch.allclose(out.float(), full, atol=2e-2)  # the window changed the long examples' output


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


@pytest.mark.gpu
@pytest.mark.skipif(not attention.available(), reason="needs CUDA and torch.nn.attention.varlen")
def test_a_packed_row_trains_without_transformers_mask_and_the_same_logits_as_masked_sdpa():
    """A Gemma-3 text model (a sliding layer and a full one) under finetune's attention with the hooks of
    skip_packed_row_masks: given a packed row's bounds, transformers builds no mask, the layers run the varlen kernel
    (the sliding one with its window), and the logits and the gradients are sdpa's over transformers' masks."""
    import transformers

    def model(name: str):
        torch.manual_seed(0)
        config = gemma3_config(name, hidden=256, heads=4, head_dim=64, window=64)
        return transformers.Gemma3ForCausalLM(config).to("cuda", torch.bfloat16)

    ours, theirs = model(attention.register()), model("sdpa")
    theirs.load_state_dict(ours.state_dict())
    attention.skip_packed_row_masks(ours)
    lengths = [100, 300, 7, 200]
    ids = torch.randint(0, 512, (1, sum(lengths)), device="cuda")
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    bounds = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=300, max_length_k=300)
    before = torch.cuda.memory_allocated()
    packed = ours(input_ids=ids, position_ids=position_ids, use_cache=False, **bounds).logits
    assert attention.skipped_packed_row_masks()
    reference = theirs(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    torch.testing.assert_close(packed.float(), reference.float(), atol=3e-2, rtol=3e-2)
    packed.float().square().mean().backward()
    reference.float().square().mean().backward()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        difference = (a.grad.float() - b.grad.float()).norm() / b.grad.float().norm().clamp_min(1e-12)
        assert difference < 0.05, f"{name}: gradients differ by {difference:.3f} of their norm"
    print(f"packed forward and backward held {(torch.cuda.max_memory_allocated() - before) / 2**20:.1f} MiB")
