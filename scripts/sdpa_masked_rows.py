"""Does sdpa's backward on this GPU give non-finite gradients for a padded batch whose mask leaves some query rows
with no key to see (a sliding-window layer's padding queries more than a window past the last real token)?

Each of sdpa's CUDA backends in turn, then transformers' own sdpa path in a small Gemma-3 (its real attention shape:
head_dim 256, one key/value head, a 512-token window) over right-padded rows, with the loss on real tokens only, as
TRL's DPO loss takes it. Prints one JSON object: for each case, the non-finite counts of the output and of the
gradients, and the same with the fully masked rows given their own key back (the fix transformers once applied to
such masks). On an H200 (torch 2.11) every case that ran was finite, and the memory-efficient kernel took none of
them (docs/results/sdpa-masked-rows-2026-11-30-h200.json).

Then the row length's remainder modulo 128, cuDNN's key tile: a masked backward at a length of 64 mod 128 with every
query row's logsumexp below ln(FLT_MAX) = -88.7 (the score pattern of an outlier head) is reported to give NaN in the
query gradient on H100/H200 (pytorch/pytorch#196678, huggingface/trl#7181), which finetune's padded rows meet unless
they are padded to a multiple of 128 (plan/__init__.py PADDED_ROW_MULTIPLE). Each length below runs on cuDNN and on
the memory-efficient kernel, with ordinary random scores and with every score shifted to about -120, and Gemma-3's
model case runs again at lengths 64 mod 128. On an H200 (torch 2.11): NaN query gradients on cuDNN at 704, 1,984 and
2,112 tokens with the shifted scores only, none at 640, 768 or 2,048 nor on the memory-efficient kernel; the Gemma-3
model (random weights) had 30 parameters with non-finite gradients at 1,984 and 2,112 tokens and none at 2,048
(docs/results/sdpa-tile-remainder-2026-11-30-h200.json).

    python scripts/sdpa_masked_rows.py > masked_rows.json
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F  # noqa: N812
from torch.nn.attention import SDPBackend, sdpa_kernel

WINDOW, LENGTH, REAL = 512, 2048, (2028, 1200)
# lengths at and beside 64 mod 128: the first three from the upstream reports, the last three DPO rows' lengths
REMAINDER_LENGTHS = (640, 704, 768, 1984, 2048, 2112)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a dry run of the script itself


def sliding_padded_mask(device) -> torch.Tensor:
    """(batch, 1, L, L) booleans: causal, inside the window, real keys only."""
    pos = torch.arange(LENGTH, device=device)
    causal = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - WINDOW)
    real = torch.stack([pos < n for n in REAL])  # (batch, L)
    return causal[None, None] & real[:, None, None, :]


def with_own_key(mask: torch.Tensor) -> torch.Tensor:
    """Rows that see no key see their own (the diagonal): finite, and no real token's output changes."""
    empty = ~mask.any(-1, keepdim=True)
    return mask | (empty & torch.eye(mask.shape[-1], dtype=torch.bool, device=mask.device))


def nonfinite(t: torch.Tensor | None) -> int:
    return -1 if t is None else int((~torch.isfinite(t)).sum())


def kernel_case(backend, mask) -> dict:
    torch.manual_seed(0)
    shape = (len(REAL), 4, LENGTH, 256)
    q = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(shape[0], 1, LENGTH, 256, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    try:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            real = torch.stack([torch.arange(LENGTH, device=DEVICE) < n for n in REAL])[:, None, :, None]
            (out * real).float().sum().backward()
    except RuntimeError as exc:
        return {"error": str(exc).splitlines()[0][:160]}
    return {"out": nonfinite(out), "dq": nonfinite(q.grad), "dk": nonfinite(k.grad), "dv": nonfinite(v.grad)}


def remainder_case(backend, length: int, *, low_lse: bool, head_dim: int = 64) -> dict:
    """One head over a causal boolean mask (all keys real) at `length`; `low_lse`: every score about -120."""
    torch.manual_seed(0)
    q = torch.randn(1, 1, length, head_dim, device=DEVICE, dtype=torch.bfloat16) * 0.1
    k = torch.randn(1, 1, length, head_dim, device=DEVICE, dtype=torch.bfloat16) * 0.1
    v = torch.randn(1, 1, length, head_dim, device=DEVICE, dtype=torch.bfloat16)
    if low_lse:  # one channel carries a large negative product: the softmax's normalizer underflows fp32's exp
        q[..., 0] = 1.0
        k[..., 0] = -120.0 * head_dim**0.5
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = torch.ones(length, length, dtype=torch.bool, device=DEVICE).tril()[None, None]
    try:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            out.backward(torch.randn_like(out))
    except RuntimeError as exc:
        return {"error": str(exc).splitlines()[0][:160]}
    return {"out": nonfinite(out), "dq": nonfinite(q.grad), "dk": nonfinite(k.grad), "dv": nonfinite(v.grad)}


def model_case(length: int = LENGTH) -> dict:
    """transformers' Gemma-3 (4 layers, the 1B model's widths) over the padded batch, sdpa as transformers picks."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=4096,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).to(DEVICE, torch.bfloat16)
    real = [min(n, length - 20) for n in REAL]
    ids = torch.randint(3, 4096, (len(real), length), device=DEVICE)
    attention = torch.stack([torch.arange(length, device=DEVICE) < n for n in real]).long()
    logits = model(input_ids=ids, attention_mask=attention).logits
    logps = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    (logps * attention[:, 1:]).sum().backward()  # masked as TRL's losses mask padding: zero weight, not removed
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    return {"logits": nonfinite(logits), "params_with_nonfinite_grads": len(bad), "first": bad[-1:]}


def main() -> None:
    mask = sliding_padded_mask(DEVICE)
    empty_rows = int((~mask.any(-1)).sum())
    report: dict = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "fully_masked_rows": empty_rows,
    }
    for name in ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, name)
        report[name] = {"as_built": kernel_case(backend, mask), "own_key": kernel_case(backend, with_own_key(mask))}
    try:
        import transformers

        report["transformers"] = transformers.__version__
        report["gemma3_model"] = model_case()
        report["gemma3_model_by_length"] = {n: model_case(n) for n in REMAINDER_LENGTHS[-3:]}
    except Exception as exc:  # report what failed, keep the kernel cases
        report["gemma3_model"] = {"error": repr(exc)[:300]}
    report["tile_remainder"] = {
        f"{n} ({n % 128} mod 128), {name}, {'low' if low else 'plain'} scores": remainder_case(
            getattr(SDPBackend, name), n, low_lse=low
        )
        for n in REMAINDER_LENGTHS
        for name in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
        for low in (False, True)
    }
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
