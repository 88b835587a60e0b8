"""Measure torch's scaled_dot_product_attention forward + backward on this GPU, per kernel path.

The planner times attention at the card's matmul rate (plan/timing.py) plus a masked kernel's mask traffic
(plan/attention_time.py). This script measures what the kernels transformers' sdpa path reaches really run at,
for the shapes where attention is a large share of a step: one packed row of T tokens (micro-batch x seq) with
its block-diagonal mask, with and without attention dropout, at head_dim 64 and 128. Each case prints its
seconds for one forward + backward, the FLOPs the kernel executes (the causal triangle for an unmasked causal
kernel, the whole square for a masked one) and the TFLOP/s that makes, and the kernels the profiler saw.

    python3 scripts/attention_rates.py --out rates.json

With --new-lengths N it times instead the first forward + backward of the masked kernel at N new row lengths
(T, T - 8, T - 16, ...: a packed row's length changes with every micro-batch) and then the same lengths again,
per call with the GPU synchronized: what a kernel pays once per new shape (e.g. cuDNN building an execution plan).

    python3 scripts/attention_rates.py --new-lengths 6 --out new-lengths.json

With --varlen it times instead finetune's own varlen path (finetune/train/attention.py, the kernel packed SFT rows
run on NVIDIA GPUs) on one row of VARLEN_ROW_TOKENS tokens holding causal examples of one length each, from
2,048 tokens to the whole row: how the kernel's rate changes with the examples' length, which the planner's one
step efficiency does not see where long examples make attention most of a step; and the same path with its long
examples on cuDNN's causal kernel (model.cudnn_long_examples), case by case.

    python3 scripts/attention_rates.py --varlen --out varlen.json

With --varlen --windows W... it also times the varlen path as a sliding-window layer calls it (its `sliding_window`,
flash-attention's left window) over the same rows, for each window W: the rate of the band
(finetune/plan/attention_time.py WINDOW_RATES, from --windows 512 1024 4096 on an H200).

    python3 scripts/attention_rates.py --varlen --windows 512 1024 4096 --out varlen-windows.json

With --padded it times instead padded rows as TRL's preference collators make them (PADDED_ROWS rows of one length,
each causal over its own tokens, the shorter ones padded at the end) through transformers' masked sdpa path (the key
and value heads repeated, a boolean mask), on cuDNN's kernel and on the memory-efficient one, which takes the rows
where the run turns cuDNN's attention off (plan.cudnn_attention_off): the memory-efficient kernel's time over
cuDNN's, by head_dim and length (finetune/plan/attention_time.py EFFICIENT_KERNEL_SLOWDOWN).

    python3 scripts/attention_rates.py --padded --out padded.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F  # noqa: N812

# (label, heads, kv_heads, head_dim): Granite-3.1-3B-A800M's attention and Llama-3.1-8B's
SHAPES = [("granite-3b-a800m", 24, 8, 64), ("llama-3.1-8b", 32, 8, 128)]
TOKENS = [4096, 16384]
DOCUMENT_TOKENS = 2048  # the packed row's examples: block-diagonal mask of 2048-token causal blocks
VARLEN_ROW_TOKENS = 65536
VARLEN_EXAMPLE_TOKENS = [2048, 4096, 8192, 16384, 32768, 65536]
PADDED_ROWS = 8  # a micro-batch of 4 pairs, chosen and rejected
PADDED_LENGTHS = [1000, 2000, 4000]  # the longest row's; not whole 128-key tiles, as ORPO's collator leaves them
PADDED_SHAPES = [*SHAPES, ("llama-3.2-3b", 24, 8, 128)]


def block_causal_mask(tokens: int, device: torch.device) -> torch.Tensor:
    """(1, 1, T, T) boolean: True where a query may attend (same example, not in the future)."""
    doc = torch.arange(tokens, device=device) // DOCUMENT_TOKENS
    pos = torch.arange(tokens, device=device)
    allowed = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    return allowed[None, None]


def qkv(*, heads, kv_heads, head_dim, tokens, device) -> tuple:
    """Random bf16 queries, keys and values of one row of `tokens`, (1, heads, tokens, head_dim), with gradients."""
    return tuple(
        torch.randn(1, n, tokens, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        for n in (heads, kv_heads, kv_heads)
    )


def seconds_per_step(step, iters: int) -> float:
    """CUDA-event seconds of one `step()` over `iters` calls, after three warm-up calls."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / iters


def measure(*, heads, kv_heads, head_dim, tokens, masked, dropout, iters, device) -> dict:
    torch.manual_seed(0)
    q, k, v = qkv(heads=heads, kv_heads=kv_heads, head_dim=head_dim, tokens=tokens, device=device)
    mask = block_causal_mask(tokens, device) if masked else None
    grad = torch.randn(1, heads, tokens, head_dim, device=device, dtype=torch.bfloat16)

    def step():
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=not masked, enable_gqa=True
        )
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    seconds = seconds_per_step(step, iters)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sorted(
        ((e.key, e.device_time_total / 1e3) for e in prof.key_averages() if e.device_time_total > 0),
        key=lambda kv: -kv[1],
    )[:6]
    # forward 4*T*T*H*D over the positions computed (QK^T and PV, 2 FLOPs a multiply-add), backward twice that
    positions = tokens * tokens if masked else tokens * (tokens + 1) / 2
    flops = 12 * heads * head_dim * positions
    return {
        "seconds": seconds,
        "executed_tflop": flops / 1e12,
        "tflops": flops / seconds / 1e12,
        "kernels_ms": [[name[:120], round(ms, 3)] for name, ms in kernels],
    }


def measure_varlen(*, heads, kv_heads, head_dim, example_tokens, on_cudnn, iters, device, window=None) -> dict:
    """Forward + backward of finetune's varlen attention over one packed row of VARLEN_ROW_TOKENS tokens made of
    causal examples of `example_tokens` each (`on_cudnn`: those long enough on cuDNN's kernel; `window`: as a layer
    with that sliding window calls it), with the kernel's executed FLOPs (each example's triangle or band, without
    cuDNN's padding)."""
    from finetune.plan.workload import band_positions
    from finetune.train.attention import register, varlen_attention_forward

    register(long_examples_on_cudnn=on_cudnn)

    class Layer:  # what the attention function reads of the calling module
        is_causal = True

    torch.manual_seed(0)
    q, k, v = qkv(heads=heads, kv_heads=kv_heads, head_dim=head_dim, tokens=VARLEN_ROW_TOKENS, device=device)
    grad = torch.randn(1, VARLEN_ROW_TOKENS, heads, head_dim, device=device, dtype=torch.bfloat16)
    examples = VARLEN_ROW_TOKENS // example_tokens
    cu = torch.arange(examples + 1, device=device, dtype=torch.int32) * example_tokens
    bounds = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=example_tokens, max_length_k=example_tokens)

    layer = {"sliding_window": window} if window else {}

    def step():
        out, _ = varlen_attention_forward(Layer(), q, k, v, None, is_causal=True, **bounds, **layer)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    seconds = seconds_per_step(step, iters)
    # keys a query sees on average: the triangle's (e + 1) / 2, or the band's
    keys = band_positions(window, example_tokens) if window else (example_tokens + 1) / 2
    flops = 12 * heads * head_dim * examples * example_tokens * keys
    return {"seconds": seconds, "executed_tflop": flops / 1e12, "tflops": flops / seconds / 1e12}


def measure_padded(*, heads, kv_heads, head_dim, length, backend, iters, device) -> dict:
    """Forward + backward of sdpa on PADDED_ROWS rows padded to `length` (row i keeps length - 16 i tokens) on
    `backend`, as transformers' sdpa path calls it with a mask: the key and value heads repeated, a boolean mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    shape = (PADDED_ROWS, heads, length, head_dim)
    q = torch.randn(*shape, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(PADDED_ROWS, kv_heads, length, head_dim, device=device, dtype=torch.bfloat16) for _ in "kv")
    k.requires_grad_(), v.requires_grad_()
    kept = length - 16 * torch.arange(PADDED_ROWS, device=device)
    pos = torch.arange(length, device=device)
    mask = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < kept[:, None, None])
    grad = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    repeat = heads // kv_heads

    def step():
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            out = F.scaled_dot_product_attention(
                q, k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1), attn_mask=mask[:, None]
            )
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    seconds = seconds_per_step(step, iters)
    flops = 12 * heads * head_dim * PADDED_ROWS * length * length  # the whole square, as a masked kernel runs it
    return {"seconds": seconds, "executed_tflop": flops / 1e12, "tflops": flops / seconds / 1e12}


def new_length_seconds(*, heads, kv_heads, head_dim, tokens, dropout, lengths, device) -> dict:
    """Seconds of one synchronized forward + backward of the masked kernel at `lengths` new row lengths below
    `tokens`, each timed on its first call and again on a second pass over the same lengths."""
    sizes = [tokens - 8 * i for i in range(lengths)]
    inputs = {}
    for t in sizes:
        q, k, v = qkv(heads=heads, kv_heads=kv_heads, head_dim=head_dim, tokens=t, device=device)
        inputs[t] = (q, k, v, block_causal_mask(t, device), torch.randn_like(q))

    def timed(t: int) -> float:
        q, k, v, mask, grad = inputs[t]
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=True)
        out.backward(grad)
        torch.cuda.synchronize()
        q.grad = k.grad = v.grad = None
        return time.perf_counter() - start

    first = [timed(t) for t in sizes]
    again = [timed(t) for t in sizes]
    return {"lengths": sizes, "first_s": [round(x, 4) for x in first], "again_s": [round(x, 4) for x in again]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--new-lengths", type=int, default=0, help="time the masked kernel at this many new lengths")
    parser.add_argument("--varlen", action="store_true", help="time finetune's varlen path by example length")
    parser.add_argument("--padded", action="store_true", help="time padded rows on cuDNN's and the efficient kernel")
    parser.add_argument(
        "--windows", type=int, nargs="*", default=[], help="with --varlen: also as sliding-window layers of these"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    if args.varlen:
        # the full layers' paths, then each window's (a sliding layer never takes cuDNN's kernel)
        paths = [(False, None), (True, None), *((False, w) for w in args.windows)]
        for label, heads, kv_heads, head_dim in SHAPES:
            for example_tokens in VARLEN_EXAMPLE_TOKENS:
                for on_cudnn, window in paths:
                    case = {"shape": label, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
                    case |= {"row_tokens": VARLEN_ROW_TOKENS, "example_tokens": example_tokens, "on_cudnn": on_cudnn}
                    case |= {"window": window} if window else {}
                    shape = {k: case[k] for k in ("heads", "kv_heads", "head_dim", "example_tokens", "on_cudnn")}
                    case |= measure_varlen(**shape, window=window, iters=args.iters, device=device)
                    print(json.dumps(case), flush=True)
                    rows.append(case)
    if args.padded:
        for label, heads, kv_heads, head_dim in PADDED_SHAPES:
            for length in PADDED_LENGTHS:
                timed = {}
                for backend in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
                    case = {"shape": label, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
                    case |= {"rows": PADDED_ROWS, "length": length, "backend": backend}
                    shape = {k: case[k] for k in ("heads", "kv_heads", "head_dim", "length", "backend")}
                    try:
                        case |= measure_padded(**shape, iters=args.iters, device=device)
                        timed[backend] = case["seconds"]
                    except RuntimeError as err:  # a path this torch build does not offer
                        case["error"] = str(err)[:300]
                    if len(timed) == 2:
                        case["over_cudnn"] = timed["EFFICIENT_ATTENTION"] / timed["CUDNN_ATTENTION"]
                    print(json.dumps(case), flush=True)
                    rows.append(case)
    if args.new_lengths:
        label, heads, kv_heads, head_dim = SHAPES[0]
        for tokens in TOKENS:
            for dropout in (0.0, 0.1):
                case = {"shape": label, "tokens": tokens, "dropout": dropout}
                case |= new_length_seconds(
                    heads=heads,
                    kv_heads=kv_heads,
                    head_dim=head_dim,
                    tokens=tokens,
                    dropout=dropout,
                    lengths=args.new_lengths,
                    device=device,
                )
                print(json.dumps(case), flush=True)
                rows.append(case)
    for label, heads, kv_heads, head_dim in SHAPES if not (args.new_lengths or args.varlen or args.padded) else []:
        for tokens in TOKENS:
            for masked in (False, True):
                for dropout in (0.0, 0.1):
                    case = {
                        "shape": label,
                        "heads": heads,
                        "kv_heads": kv_heads,
                        "head_dim": head_dim,
                        "tokens": tokens,
                        "masked": masked,
                        "dropout": dropout,
                    }
                    try:
                        shape = {k: v for k, v in case.items() if k != "shape"}
                        case |= measure(**shape, iters=args.iters, device=device)
                    except RuntimeError as err:  # a path this torch build does not offer
                        case["error"] = str(err)[:300]
                    print(json.dumps({k: v for k, v in case.items() if k != "kernels_ms"}), flush=True)
                    rows.append(case)
    meta = {
        "card": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "host": platform.node(),
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
