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


def block_causal_reference(q, k, v, lengths):
    """Each example attends causally to itself only (eager math, fp32)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, sl].float(), k[:, :, sl].float(), v[:, :, sl].float(), is_causal=True
            )
        )
        start += n
    return torch.cat(outs, dim=2).transpose(1, 2)  # (b, s, h, d)
