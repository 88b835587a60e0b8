"""Throughput of finetune's compiled launch against a plain TRL run, same GPU, same call.

The baseline is what a user writes from TRL's documentation: SFTTrainer + a PEFT LoraConfig
(r16, all linear layers), TRL's defaults otherwise (activation checkpointing on, no packing),
the same model shape, sequence length, global batch and data. `--no-ckpt` runs it again with
checkpointing turned off by hand. finetune's side runs `finetune run` on the same data.

Reported: tokens/s of real (non-pad) tokens, MFU with 4N FLOPs per token for LoRA (the frozen
base gets no weight gradients: forward 2N + input-gradient backward 2N) plus attention
(12 * layers * hidden * seq per token, causal: halved), against the card's dense bf16 peak.

    python scripts/bench.py --arch llama-3.1-8b --out $OUT/bench.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_validate import WORK, base_recipe, ensure_model, write_data  # noqa: E402

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}


def lora_flops_per_token(arch, seq: int) -> float:
    n = (arch.num_layers * (arch.hidden_size * (arch.num_attention_heads + 2 * arch.num_kv_heads)
                            * (arch.head_dim or arch.hidden_size // arch.num_attention_heads)
                            + arch.hidden_size * arch.hidden_size + 3 * arch.hidden_size * arch.intermediate_size)
         + arch.vocab_size * arch.hidden_size)
    attention = 12 * arch.num_layers * arch.hidden_size * seq / 2
    return 4 * n + attention * 2 / 3  # attention: fwd + input-grad bwd, no weight grads


def baseline(model_dir: str, data: str, *, seq: int, batch: int, steps: int, ckpt: bool) -> dict:
    """Plain TRL, as the documentation shows it."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    ds = load_dataset("json", data_files=data, split="train")
    mb = 4 if not ckpt else 8
    cfg = SFTConfig(output_dir="/tmp/bench-trl", max_length=seq, per_device_train_batch_size=mb,
                    gradient_accumulation_steps=max(1, batch // mb), max_steps=steps, bf16=True,
                    gradient_checkpointing=ckpt, logging_steps=5, save_strategy="no", report_to="none",
                    learning_rate=2e-4, include_num_input_tokens_seen="non_padding")
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok,
                         peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                task_type="CAUSAL_LM"))
    torch.cuda.reset_peak_memory_stats()
    result = trainer.train()
    runtime = result.metrics["train_runtime"]
    return {"tokens_per_second": trainer.state.num_input_tokens_seen / runtime,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30, "micro_batch": mb,
            "activation_checkpointing": ckpt, "runtime_s": runtime}


def finetune_side(model_dir: Path, data: Path, *, seq: int, batch: int, steps: int, name: str,
                  overrides: list[str]) -> dict:
    import yaml

    work = WORK / f"bench-{name}"
    work.mkdir(parents=True, exist_ok=True)
    recipe = base_recipe(model_dir, data, steps=steps, seq=seq, batch=batch)
    recipe["output"] = {"keep": 1}  # no mid-run checkpoints in a benchmark
    recipe["data"]["allow_outside"] = True  # the shared data file sits beside the run folders
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    cmd = [sys.executable, "-m", "finetune.cli", "run", str(work / "recipe.yaml"), "--output",
           str(work / "run"), "--resume", "never", *sum((["--set", s] for s in overrides), [])]
    subprocess.run(cmd, cwd=ROOT, check=True)
    summary = json.loads((work / "run" / "summary.json").read_text())
    plan = json.loads((work / "run" / "plan.json").read_text())
    mem = json.loads((work / "run" / "memory" / "rank-0.json").read_text())
    return {"tokens_per_second": summary["tokens_per_second"], "peak_reserved_gib": mem.get("gpu_max_reserved_gib"),
            "micro_batch": plan["micro_batch_size"], "activation_checkpointing": plan["activation_checkpointing"],
            "runtime_s": summary["train_runtime_s"], "overrides": overrides}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="llama-3.1-8b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", default="finetune,finetune-nopack,trl,trl-no-ckpt")
    parser.add_argument("--out", default="bench.json")
    parser.add_argument("--baseline-only", choices=["trl", "trl-no-ckpt"], default=None)
    args = parser.parse_args()

    from finetune.registry import get_model

    model_dir = ensure_model(args.arch)
    WORK.mkdir(parents=True, exist_ok=True)
    data = WORK / "bench-data.jsonl"
    write_data(data, preference=False, seq=args.seq)
    if args.baseline_only:  # run in a child so each variant gets a fresh CUDA context
        res = baseline(str(model_dir), str(data), seq=args.seq, batch=args.batch, steps=args.steps,
                       ckpt=args.baseline_only == "trl")
        print("BENCH_RESULT " + json.dumps(res))
        return
    import torch

    card = torch.cuda.get_device_name()
    arch = get_model(args.arch)
    flops = lora_flops_per_token(arch, args.seq)
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in card), 989.0) * 1e12
    rows = {}
    for variant in args.variants.split(","):
        start = time.perf_counter()
        if variant.startswith("trl"):
            proc = subprocess.run([sys.executable, __file__, "--arch", args.arch, "--seq", str(args.seq),
                                   "--batch", str(args.batch), "--steps", str(args.steps),
                                   "--baseline-only", variant], cwd=ROOT, capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("BENCH_RESULT ")]
            if not line:
                print(proc.stdout[-3000:], proc.stderr[-3000:])
                continue
            res = json.loads(line[-1].split(" ", 1)[1])
        else:
            overrides = ["data.packing=false"] if variant == "finetune-nopack" else []
            res = finetune_side(model_dir, data, seq=args.seq, batch=args.batch, steps=args.steps,
                                name=variant, overrides=overrides)
        res["mfu"] = res["tokens_per_second"] * flops / peak
        res["wall_s"] = round(time.perf_counter() - start, 1)
        rows[variant] = res
        print(variant, json.dumps(res), flush=True)
    base = rows.get("trl", {}).get("tokens_per_second")
    report = {"card": card, "arch": args.arch, "seq": args.seq, "global_batch": args.batch, "steps": args.steps,
              "date": time.strftime("%Y-%m-%d"), "flops_per_token": flops, "rows": rows,
              "ratio_to_trl_default": {k: v["tokens_per_second"] / base for k, v in rows.items()} if base else None}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\ncard {card}, {args.arch}, seq {args.seq}, global batch {args.batch}")
    print(f"{'variant':18} {'tokens/s':>9} {'MFU':>6} {'peak GiB':>9} {'mb':>3} {'ckpt':>5} {'x TRL':>6}")
    for k, v in rows.items():
        ratio = v["tokens_per_second"] / base if base else float("nan")
        print(f"{k:18} {v['tokens_per_second']:9.0f} {v['mfu']:6.1%} {v['peak_reserved_gib'] or 0:9.1f} "
              f"{v['micro_batch']:>3} {v['activation_checkpointing']!s:>5} {ratio:6.2f}")


if __name__ == "__main__":
    main()
