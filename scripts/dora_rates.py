"""Measure one LoRA / DoRA linear module's forward + backward on this GPU, as peft builds it.

The planner adds DoRA's work beyond LoRA as bytes moved at the streaming bandwidth (plan/dora_time.py) and its
activations (plan/memory.py). This script builds one frozen bf16 nn.Linear per shape (the q/k/gate/down
projections of the configs' widths), wraps it with peft (LoRA, DoRA, DoRA with lora dropout) as a training run
does, and times forward + backward under bf16 autocast for T tokens whose input carries a gradient (a mid-network
module), with the adapters in fp32 and the input cast to fp32 (peft's default, DDP LoRA) and in bf16 (the sharded
strategies and QLoRA). Each case records the seconds of one forward + backward, the bytes the forward leaves
saved for the backward (allocated after the forward less before it, the output excluded), the peak allocated
during the step above what was allocated before it, and the number of CUDA kernels one step launches.

With lora dropout, peft's DoRA (tuners/lora/variants.py DoraLinearVariant.forward) cannot reuse the base
layer's output: it computes `F.linear(dropout(x), W)` again, a second matmul of the frozen weight forward and
another in the backward, and under fp32 casts that matmul's weight is a fresh autocast copy kept for the
backward. The cases with dropout measure what that costs.

    python3 scripts/dora_rates.py --out dora.json
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
from attention_rates import seconds_per_step  # scripts/ is the import path of a script run

# (label, in_features, out_features): the q, k, gate and down projections of these models' widths
SHAPES = [
    ("qwen2.5-1.5b q", 1536, 1536),
    ("qwen2.5-1.5b k", 1536, 256),
    ("qwen2.5-1.5b gate", 1536, 8960),
    ("qwen2.5-1.5b down", 8960, 1536),
    ("llama-3.2-3b q", 3072, 3072),
    ("llama-3.2-3b gate", 3072, 8192),
    ("llama-3.1-8b q", 4096, 4096),
    ("llama-3.1-8b k", 4096, 1024),
    ("llama-3.1-8b gate", 4096, 14336),
    ("llama-3.1-8b down", 14336, 4096),
    ("qwen2.5-14b gate", 5120, 13824),
    ("llama-3.3-70b q", 8192, 8192),
    ("llama-3.3-70b gate", 8192, 28672),
]
TOKENS = [4096, 16384]
VARIANTS = {"lora": (False, 0.0), "dora": (True, 0.0), "dora-dropout": (True, 0.05)}
RANK = 16


class OneLinear(torch.nn.Module):
    def __init__(self, fin: int, fout: int, device):
        super().__init__()
        self.proj = torch.nn.Linear(fin, fout, bias=False, device=device, dtype=torch.bfloat16)

    def forward(self, x):
        return self.proj(x)


def adapted(fin: int, fout: int, *, dora: bool, dropout: float, fp32_adapters: bool, device):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=dropout, target_modules=["proj"], use_dora=dora)
    model = get_peft_model(OneLinear(fin, fout, device), config, autocast_adapter_dtype=fp32_adapters)
    model.train()
    return model


def measure(*, fin, fout, tokens, dora, dropout, fp32_adapters, iters, device) -> dict:
    torch.manual_seed(0)
    model = adapted(fin, fout, dora=dora, dropout=dropout, fp32_adapters=fp32_adapters, device=device)
    x = torch.randn(tokens, fin, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, fout, device=device, dtype=torch.bfloat16)

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(x)

    def step():
        out = forward()
        out.backward(grad.to(out.dtype))
        x.grad = None
        for p in model.parameters():
            p.grad = None

    seconds = seconds_per_step(step, iters)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = forward()
    saved = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
    out.backward(grad.to(out.dtype))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    x.grad = None
    del out
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sum(e.count for e in prof.key_averages() if e.device_time_total > 0)
    return {"seconds": seconds, "saved_bytes": saved, "peak_bytes": peak, "kernels": kernels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda")
    import peft

    results = {
        "card": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "peft": peft.__version__,
        "host": platform.node(),
        "rank": RANK,
        "cases": [],
    }
    for label, fin, fout in SHAPES:
        for tokens in TOKENS:
            for fp32_adapters in (True, False):
                for variant, (dora, dropout) in VARIANTS.items():
                    case = measure(
                        fin=fin,
                        fout=fout,
                        tokens=tokens,
                        dora=dora,
                        dropout=dropout,
                        fp32_adapters=fp32_adapters,
                        iters=args.iters,
                        device=device,
                    )
                    torch.cuda.empty_cache()  # the case's tensors went with its frame
                    case.update(
                        label=label, in_features=fin, out_features=fout, tokens=tokens, variant=variant,
                        adapters="fp32" if fp32_adapters else "bf16",
                    )  # fmt: skip
                    results["cases"].append(case)
                    print(
                        f"{label:20s} T={tokens:6d} {case['adapters']} {variant:13s} {case['seconds'] * 1e3:8.3f} ms  "
                        f"saved {case['saved_bytes'] / 2**20:9.1f} MiB  peak {case['peak_bytes'] / 2**20:9.1f} MiB  "
                        f"{case['kernels']} kernels",
                        flush=True,
                    )
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
