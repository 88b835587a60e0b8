"""Throughput of finetune's compiled launch against a plain TRL run, same GPU, same call.

Baselines: `trl` is what a user writes from TRL's documentation: SFTTrainer + a PEFT LoraConfig
(r16, all linear layers), TRL's defaults otherwise (activation checkpointing on, no packing), the
same model shape, sequence length, global batch and data; `trl-no-ckpt` the same with checkpointing
turned off by hand; `trl-expert` TRL tuned by hand for speed (packing bfd / padding-free pairs, Liger,
no checkpointing, micro-batch 4, flex attention): the strongest a user configures without finetune.
Ratios are printed against both `trl` and `trl-expert`. finetune's side runs `finetune run` on the
same data.

Reported: tokens/s of real (non-pad) tokens and MFU: finetune's one FLOPs formula
(finetune/plan/timing.py model_flops_per_token; for LoRA 4N + 12*L*a*s + 6T) against the card's dense
bf16 peak as `--hardware auto` plans with it, i.e. the quantity `finetune plan` predicts.

    python scripts/bench.py --arch llama-3.1-8b --out $OUT/bench.json

The benchmark is one GPU: on a machine with several it runs every variant on the first visible one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_validate import WORK, base_recipe, data_format, ensure_model, finetune_cmd, run_recipe, write_data  # noqa: E402

from finetune import rundir  # noqa: E402
from finetune.measurement import WARMUP_STEPS, steady_rate, steady_tokens_per_second  # noqa: E402
from finetune.plan import mfu, recipe_flops_per_token  # noqa: E402
from finetune.registry.detect import peak_bf16_tflops  # noqa: E402

# Throughput is reported twice: over the whole train() call (what TRL's train_runtime gives; it includes
# the first steps' kernel compilation, allocator growth and dataloader start) and past WARMUP_STEPS
# optimizer steps, which is what a run of thousands of steps sees. Both sides are timed the same way.


def _step_clock():
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """(step, seconds, tokens seen) at the end of every optimizer step."""

        def __init__(self):
            self.points: list[tuple[int, float, float]] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.points.append((state.global_step, time.perf_counter(), state.num_input_tokens_seen or 0))

        def steady(self, warmup: int) -> float | None:
            return steady_rate(self.points, warmup)

    return StepClock()


def baseline(
    model_dir: str,
    data: str,
    *,
    seq: int,
    batch: int,
    steps: int,
    ckpt: bool,
    method: str = "sft",
    expert: bool = False,
) -> dict:
    """Plain TRL, as the documentation shows it; `expert`: TRL as a user who knows its speed options
    configures it by hand (SFT: packing with the bfd strategy, which is padding-free; DPO: padding-free
    pairs; both with Liger's kernels, no checkpointing, micro-batch 4, flex attention, which runs packed
    rows without a dense mask)."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    attention = {"attn_implementation": "flex_attention"} if expert else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, **attention).cuda()
    ds = load_dataset("json", data_files=data, split="train")
    mb = 4 if not ckpt else 8  # 8: TRL's default; without checkpointing 8 does not fit an 80 GB card
    common = dict(
        output_dir="/tmp/bench-trl",
        max_length=seq,
        per_device_train_batch_size=mb,
        gradient_accumulation_steps=max(1, batch // mb),
        max_steps=steps,
        bf16=True,
        gradient_checkpointing=ckpt,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        include_num_input_tokens_seen="non_padding",
    )
    if expert:
        common["use_liger_kernel"] = True
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    if method == "dpo":
        tuned = {"padding_free": True} if expert else {}
        trainer = DPOTrainer(
            model=model,
            args=DPOConfig(**common, **tuned, learning_rate=5e-6, beta=0.1),
            train_dataset=ds,
            processing_class=tok,
            peft_config=lora,
        )
    else:
        tuned = {"packing": True, "packing_strategy": "bfd"} if expert else {}
        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(**common, **tuned, learning_rate=2e-4),
            train_dataset=ds,
            processing_class=tok,
            peft_config=lora,
        )
    clock = _step_clock()
    trainer.add_callback(clock)
    torch.cuda.reset_peak_memory_stats()
    result = trainer.train()
    runtime = result.metrics["train_runtime"]
    return {
        "tokens_per_second": trainer.state.num_input_tokens_seen / runtime,
        "steady_tokens_per_second": clock.steady(WARMUP_STEPS),
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "micro_batch": mb,
        "activation_checkpointing": ckpt,
        "runtime_s": runtime,
        "expert": expert,
    }


def finetune_side(
    model_dir: Path,
    data: Path,
    *,
    seq: int,
    batch: int,
    steps: int,
    name: str,
    overrides: list[str],
    method: str = "sft",
    out: Path | None = None,
) -> dict:
    import yaml

    work = WORK / f"bench-{name}"
    work.mkdir(parents=True, exist_ok=True)
    dpo = {"method": {"type": "dpo", "beta": 0.1}} if method == "dpo" else {}
    recipe = run_recipe(model_dir, data, dpo, steps=steps, seq=seq, batch=batch)
    recipe["output"] = {"keep": 1}  # no mid-run checkpoints in a benchmark
    recipe["data"]["allow_outside"] = True  # the shared data file sits beside the run folders
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    cmd = finetune_cmd(
        "run",
        str(work / "recipe.yaml"),
        "--output",
        str(work / "run"),
        "--resume",
        "never",
        *sum((["--set", s] for s in overrides), []),
    )
    subprocess.run(cmd, cwd=ROOT, check=True)
    run = work / "run"
    summary = rundir.read_summary(run)
    plan = json.loads((run / rundir.PLAN_JSON).read_text())
    mem = json.loads((run / rundir.memory_file(0)).read_text())
    resolved = yaml.safe_load((run / rundir.RESOLVED_RECIPE).read_text())
    metrics = rundir.read_metrics(run)
    row = {
        "tokens_per_second": summary[rundir.SUMMARY_TOKENS_PER_S],
        "steady_tokens_per_second": steady_tokens_per_second(metrics),
        "peak_reserved_gib": mem.get("gpu_max_reserved_gib"),
        "micro_batch": plan["micro_batch_size"],
        "activation_checkpointing": plan["activation_checkpointing"],
        "runtime_s": summary["train_runtime_s"],
        "overrides": overrides,
        "attn_implementation": resolved["model"]["attn_implementation"],
        "liger": resolved["train"]["liger"],
        "predicted_peak_gib": plan.get("per_gpu_memory_gib"),
    }
    stem = str(run / rundir.profile_stem(0))
    if Path(stem + ".json").exists():
        row["profile"] = json.loads(Path(stem + ".json").read_text())
        if out is not None:  # the operator tables travel back with the results
            shutil.copy(stem + ".txt", out.parent / f"profile-{name}.txt")
    return row


PRESET_VARIANTS = {"finetune": [], "finetune-nopack": ["data.packing=false"]}
# TRL's defaults (checkpointing on), the same without checkpointing, and TRL tuned by hand for speed
BASELINES = ["trl", "trl-no-ckpt", "trl-expert"]


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """'name' (trl, trl-no-ckpt, finetune, finetune-nopack) or 'name:key=value;key=value' (finetune
    with those --set overrides)."""
    name, _, rest = spec.partition(":")
    if rest:
        return name, [x for x in rest.split(";") if x]
    return name, list(PRESET_VARIANTS.get(name, []))


def ratios(rows: dict, key: str, *, base: str = "trl") -> dict | None:
    reference = rows.get(base, {}).get(key)
    if not reference:
        return None
    return {k: v[key] / reference for k, v in rows.items() if v.get(key)}


def write_report(path: Path, rows: dict, meta: dict) -> None:
    report = {
        **meta,
        "warmup_steps": WARMUP_STEPS,
        "rows": rows,
        "ratio_to_trl_default": ratios(rows, "tokens_per_second"),
        "steady_ratio_to_trl_default": ratios(rows, "steady_tokens_per_second"),
        "ratio_to_trl_expert": ratios(rows, "tokens_per_second", base="trl-expert"),
        "steady_ratio_to_trl_expert": ratios(rows, "steady_tokens_per_second", base="trl-expert"),
    }
    path.write_text(json.dumps(report, indent=2) + "\n")


def one_gpu() -> None:
    """Every variant on the first visible GPU: `--hardware auto` would otherwise plan data parallelism over
    all of them while TRL's single process uses one, and MFU is computed for one card."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[0] if visible else "0"


def main() -> None:
    one_gpu()
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="llama-3.1-8b")
    parser.add_argument("--method", choices=["sft", "dpo"], default="sft")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--variants",
        default="finetune,finetune-nopack,trl,trl-no-ckpt,trl-expert",
        help="comma-separated; 'name:key=value;key=value' runs finetune with those --set overrides",
    )
    parser.add_argument("--profile", default=None, help="start,stop: logging.profile_steps for finetune variants")
    parser.add_argument("--out", default="bench.json")
    parser.add_argument("--baseline-only", choices=BASELINES, default=None)
    args = parser.parse_args()

    from finetune.recipe import load_recipe
    from finetune.registry import get_model

    model_dir = ensure_model(args.arch)
    WORK.mkdir(parents=True, exist_ok=True)
    data = WORK / f"bench-data-{args.method}.jsonl"
    write_data(data, fmt=data_format(args.method), seq=args.seq)
    if args.baseline_only:  # run in a child so each variant gets a fresh CUDA context
        res = baseline(
            str(model_dir),
            str(data),
            seq=args.seq,
            batch=args.batch,
            steps=args.steps,
            ckpt=args.baseline_only == "trl",
            method=args.method,
            expert=args.baseline_only == "trl-expert",
        )
        print("BENCH_RESULT " + json.dumps(res))
        return
    import torch

    card = torch.cuda.get_device_name()
    arch = get_model(args.arch)
    # the recipe both sides train (TRL's LoRA r16 on all linear layers = finetune's default targets)
    recipe = load_recipe(base_recipe(model_dir, data, steps=args.steps, seq=args.seq, batch=args.batch))
    flops = recipe_flops_per_token(recipe, arch=arch)
    peak = peak_bf16_tflops(card)
    meta = {
        "card": card,
        "arch": args.arch,
        "method": args.method,
        "seq": args.seq,
        "global_batch": args.batch,
        "steps": args.steps,
        "date": time.strftime("%Y-%m-%d"),
        "flops_per_token": flops,
        "peak_bf16_tflops": peak,
        "versions": versions(),
    }
    out = Path(args.out)
    rows = {}
    for spec in args.variants.split(","):
        variant, overrides = parse_variant(spec)
        start = time.perf_counter()
        if variant.startswith("trl"):
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--arch",
                    args.arch,
                    "--seq",
                    str(args.seq),
                    "--batch",
                    str(args.batch),
                    "--steps",
                    str(args.steps),
                    "--method",
                    args.method,
                    "--baseline-only",
                    variant,
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            line = [x for x in proc.stdout.splitlines() if x.startswith("BENCH_RESULT ")]
            if not line:
                print(proc.stdout[-3000:], proc.stderr[-3000:])
                continue
            res = json.loads(line[-1].split(" ", 1)[1])
        else:
            if args.profile:
                overrides = [*overrides, f"logging.profile_steps=[{args.profile}]"]
            try:
                res = finetune_side(
                    model_dir,
                    data,
                    seq=args.seq,
                    batch=args.batch,
                    steps=args.steps,
                    name=variant,
                    overrides=overrides,
                    method=args.method,
                    out=out,
                )
            except subprocess.CalledProcessError as exc:
                print(f"{variant} failed: {exc}", flush=True)
                continue
        res["mfu"] = mfu(tokens_per_second=res["tokens_per_second"], flops_per_token=flops, peak_tflops=peak, gpus=1)
        res["steady_mfu"] = mfu(
            tokens_per_second=res.get("steady_tokens_per_second") or 0, flops_per_token=flops, peak_tflops=peak, gpus=1
        )
        res["wall_s"] = round(time.perf_counter() - start, 1)
        rows[variant] = res
        print(variant, json.dumps(res), flush=True)
        write_report(out, rows, meta)  # after every variant: a timeout keeps what finished
    whole, steady = ratios(rows, "tokens_per_second") or {}, ratios(rows, "steady_tokens_per_second") or {}
    expert = ratios(rows, "steady_tokens_per_second", base="trl-expert") or {}
    print(
        f"\ncard {card}, {args.arch} {args.method}, seq {args.seq}, global batch {args.batch}, "
        f"{args.steps} steps; steady = after step {WARMUP_STEPS}"
    )
    print(
        f"{'variant':22} {'tok/s':>7} {'x TRL':>6} {'MFU':>6} | {'steady':>7} {'x TRL':>6} {'x exp':>6} "
        f"{'MFU':>6} | {'peak GiB':>8} {'pred':>6} {'mb':>3} {'ckpt':>5} {'busy':>5}"
    )
    for k, v in rows.items():
        busy = v.get("profile", {}).get("gpu_busy_share")
        print(
            f"{k:22} {v['tokens_per_second']:7.0f} {whole.get(k, float('nan')):6.2f} {v['mfu']:6.1%} | "
            f"{v.get('steady_tokens_per_second') or 0:7.0f} {steady.get(k, float('nan')):6.2f} "
            f"{expert.get(k, float('nan')):6.2f} "
            f"{v['steady_mfu']:6.1%} | {v['peak_reserved_gib'] or 0:8.1f} {v.get('predicted_peak_gib') or 0:6.1f} "
            f"{v['micro_batch']:>3} {v['activation_checkpointing']!s:>5} {'' if busy is None else f'{busy:.0%}':>5}"
        )


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "trl", "peft", "accelerate", "liger-kernel"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


if __name__ == "__main__":
    main()
