"""Measure one MoE layer's routed experts, forward + backward, on this GPU, per implementation.

transformers 5 runs a model's routed experts through its experts interface (grouped_mm on GPUs, the planner's
plan/moe_time.py). For some model types (Mixtral, Qwen3-MoE, DeepSeek-V2/V3) Liger's SwiGLU patch replaces the
whole experts module with its own Triton fused MoE (liger_kernel.transformers.swiglu.LigerExperts), which
autotunes its GEMMs on the first call. This script builds one decoder layer of each config given, routes T
random tokens top-k, and times the experts module as transformers builds it and as Liger replaces it: the
first call (compilation and autotuning included) and the steady forward + backward, with the expert weights
frozen (LoRA: only the input gradient) and trainable (full fine-tune: the weight gradients too).

    python3 scripts/moe_experts_rates.py tests/data/hub_configs/mixtral-8x7b/config.json --out moe.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch


def experts_module(config_path: str, device):
    """The routed-experts module of a one-layer model built from the config (random bf16 weights on the GPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_path)
    config = getattr(config, "text_config", None) or config
    config.num_hidden_layers = 1
    for dense_first in ("first_k_dense_replace", "first_dense_layers"):
        if getattr(config, dense_first, None):
            setattr(config, dense_first, 0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    found = [m for name, m in model.named_modules() if type(m).__name__.endswith("Experts")]
    if not found:
        raise SystemExit(f"{config_path}: no module named *Experts in the built layer")
    return config, found[0]


def routing(config_path: str, tokens: int, device):
    """Random top-k routing of `tokens` over the experts, their count and k read as the planner reads them."""
    from pathlib import Path

    from finetune.registry.derive import arch_from_config

    arch = arch_from_config(Path(config_path), key=Path(config_path).parent.name)
    experts, top_k = arch.num_experts, arch.experts_per_token
    logits = torch.randn(tokens, experts, device=device)
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return experts, top_k, index, (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)


def liger_copy(config, module):
    from liger_kernel.transformers.swiglu import LigerExperts

    liger = LigerExperts(config).to(device=module.gate_up_proj.device, dtype=torch.bfloat16)
    with torch.no_grad():
        liger.gate_up_proj.copy_(module.gate_up_proj)
        liger.down_proj.copy_(module.down_proj)
    return liger


def measure(module, x, index, weights, *, trainable: bool, iters: int) -> dict:
    for p in module.parameters():
        p.requires_grad_(trainable)
    grad = torch.randn_like(x)

    def step():
        out = module(x, index, weights)
        out.backward(grad)
        x.grad = None
        for p in module.parameters():
            p.grad = None

    def sync():
        if x.is_cuda:
            torch.cuda.synchronize()

    sync()
    t0 = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t0
    for _ in range(2):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    return {"first_call_s": round(first, 3), "seconds": (time.perf_counter() - t0) / iters}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+", help="config.json paths of MoE models")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens routed per call (micro-batch x seq)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", help="write the cases as JSON here")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script on a small config")
    args = ap.parse_args()
    device = torch.device(args.device)
    cases = []
    for path in args.configs:
        config, module = experts_module(path, device)
        experts, top_k, index, weights = routing(path, args.tokens, device)
        hidden = config.hidden_size
        inter = module.down_proj.shape[-1] if module.down_proj.shape[-2] == hidden else module.down_proj.shape[-2]
        routed = args.tokens * top_k
        impls = {"transformers": module}
        try:
            impls["liger"] = liger_copy(config, module)
        except ImportError:
            print("liger-kernel is not installed: transformers' experts only")
        for impl, mod in impls.items():
            for trainable in (False, True):
                x = torch.randn(args.tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
                r = measure(mod, x, index, weights, trainable=trainable, iters=args.iters)
                # 3 GEMMs of the SwiGLU expert (gate, up, down) per routed token: 2 FLOPs a multiply-add; the
                # backward's input gradients as many again, the weight gradients (trained experts) as many more
                forward = 2 * routed * 3 * hidden * inter
                flops = forward * (3 if trainable else 2)
                case = {
                    "config": path,
                    "impl": impl,
                    "experts_implementation": getattr(config, "_experts_implementation", None),
                    "experts": experts,
                    "top_k": top_k,
                    "tokens": args.tokens,
                    "weights_trainable": trainable,
                    **r,
                    "tflops": round(flops / r["seconds"] / 1e12, 1),
                }
                cases.append(case)
                print(
                    f"{path.split('/')[-2]:24s} {impl:12s} trainable={trainable!s:5s} "
                    f"first call {r['first_call_s']:7.2f} s  steady {r['seconds'] * 1e3:8.2f} ms  "
                    f"{case['tflops']:6.1f} TFLOP/s"
                )
        del module, impls
        torch.cuda.empty_cache()
    if args.out:
        meta = {
            "card": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "host": platform.node(),
        }
        import transformers

        meta["transformers"] = transformers.__version__
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "cases": cases}, f, indent=1)


if __name__ == "__main__":
    main()
