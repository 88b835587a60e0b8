"""Packed attention inputs and an eager reference for finetune/train/attention.py (CPU and GPU tests)."""

from __future__ import annotations

import torch


class AttentionModule(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def packed(lengths, *, heads=4, kv_heads=2, dim=16, value_dim=None, device="cpu", dtype=torch.float32):
    """Packed q/k/v (value_dim: the values' head size where it differs from the queries', as MLA's)."""
    total = sum(lengths)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, total, dim, generator=g).to(device, dtype)
    k = torch.randn(1, kv_heads, total, dim, generator=g).to(device, dtype)
    v = torch.randn(1, kv_heads, total, value_dim or dim, generator=g).to(device, dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}
    return q, k, v, kwargs


def block_causal_reference(q, k, v, lengths, *, sliding_window: int | None = None):
    """Each example attends causally to itself only (eager math, fp32); with `sliding_window`, each query to itself
    and the window - 1 keys before it, transformers' own mask function for the window (masking_utils)."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    allowed = sliding_window_causal_mask_function(sliding_window) if sliding_window else causal_mask_function
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        idx = torch.arange(n, device=q.device)
        mask = allowed(0, 0, idx[:, None], idx[None, :])
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, sl].float(), k[:, :, sl].float(), v[:, :, sl].float(), attn_mask=mask
            )
        )
        start += n
    return torch.cat(outs, dim=2).transpose(1, 2)  # (b, s, h, d)


def gemma3_config(attn_implementation: str, *, hidden: int = 32, heads: int = 2, head_dim: int = 16, window: int = 4):
    """A Gemma-3 text config of two layers, a sliding-window one and a full one: the two kinds of mask a packed row
    gets (transformers' create_sliding_window_causal_mask and create_causal_mask)."""
    import transformers

    return transformers.Gemma3TextConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=head_dim,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=window,
        vocab_size=2 * hidden,
        attn_implementation=attn_implementation,
    )
