"""Measure the bf16 GEMMs of one decoder layer's linears on this GPU, by model width and tokens a micro-batch.

The planner times the linears' FLOPs at one share of the card's peak (plan/timing.py GEMM_EFFICIENCY, fitted on the
calibration rows) scaled by how full the micro-batch is (micro_batch_fill: tokens / (tokens + 512)), the same for a
1B model's 2,048-wide layers as for a 70B model's 8,192-wide ones. This script times what the linears of a layer
run in training: for each projection (q, k, v, o, gate, up, down at the config's widths) the forward product
X W^T, the input gradient dY W and, for a full fine-tune, the weight gradient dY^T X, over T tokens. Each case
records the seconds of the layer's forward + input-gradient GEMMs (LoRA's frozen base) and of those plus the weight
gradients (full fine-tuning), and their share of the card's dense bf16 peak (finetune.registry.detect).

    python3 scripts/gemm_rates.py --out gemm.json
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
from attention_rates import seconds_per_step  # scripts/ is the import path of a script run

# (label, hidden, q width, kv width, intermediate): the decoder layer widths of these models
WIDTHS = [
    ("gemma-3-1b", 1152, 1024, 256, 6912),
    ("llama-3.2-1b", 2048, 2048, 512, 8192),
    ("llama-3.2-3b", 3072, 3072, 1024, 8192),
    ("llama-3.1-8b", 4096, 4096, 1024, 14336),
    ("qwen2.5-14b", 5120, 5120, 1024, 13824),
    ("qwen2.5-32b", 5120, 5120, 1024, 27648),
    ("llama-3.1-70b", 8192, 8192, 1024, 28672),
]
TOKENS = (512, 1024, 2048, 4096, 8192, 16384)


def layer_linears(hidden: int, q: int, kv: int, inter: int) -> list[tuple[int, int]]:
    """(in_features, out_features) of q, k, v, o, gate, up, down."""
    return [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]


def measure(widths: tuple[int, int, int, int], tokens: int, *, device) -> dict:
    torch.manual_seed(0)
    shapes = layer_linears(*widths)
    xs = {fin: torch.randn(tokens, fin, device=device, dtype=torch.bfloat16) for fin, _ in shapes}
    ws = [torch.randn(fout, fin, device=device, dtype=torch.bfloat16) * 0.02 for fin, fout in shapes]
    gs = [torch.randn(tokens, fout, device=device, dtype=torch.bfloat16) for _, fout in shapes]

    def frozen():  # forward and input gradient: a frozen base layer's GEMMs
        for (fin, _), w, g in zip(shapes, ws, gs):
            torch.mm(xs[fin], w.t())
            torch.mm(g, w)

    def full():  # and the weight gradient
        for (fin, _), w, g in zip(shapes, ws, gs):
            torch.mm(xs[fin], w.t())
            torch.mm(g, w)
            torch.mm(g.t(), xs[fin])

    flops = sum(2 * tokens * fin * fout for fin, fout in shapes)
    iters = max(3, min(50, int(4e13 / (3 * flops))))
    frozen_s = seconds_per_step(frozen, iters)
    full_s = seconds_per_step(full, iters)
    return {"frozen_s": frozen_s, "frozen_flops": 2 * flops, "full_s": full_s, "full_flops": 3 * flops}


def main() -> None:
    from finetune.registry.detect import peak_bf16_tflops

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    name = torch.cuda.get_device_name()
    peak = peak_bf16_tflops(name) * 1e12
    cases = []
    for label, *widths in WIDTHS:
        for tokens in TOKENS:
            m = measure(tuple(widths), tokens, device=device)
            cases.append(
                {
                    "model": label,
                    "tokens": tokens,
                    **m,
                    "frozen_share_of_peak": m["frozen_flops"] / m["frozen_s"] / peak,
                    "full_share_of_peak": m["full_flops"] / m["full_s"] / peak,
                }
            )
            print(
                f"{label:>14} {tokens:>6}: frozen {cases[-1]['frozen_share_of_peak']:.3f} "
                f"full {cases[-1]['full_share_of_peak']:.3f}",
                flush=True,
            )
    report = {"card": name, "torch": torch.__version__, "host": platform.node(), "peak_tflops": peak / 1e12}
    with open(args.out, "w") as f:
        json.dump({**report, "cases": cases}, f, indent=1)


if __name__ == "__main__":
    main()
