"""Draw calibration runs at random from the settings peer configs carry, for an out-of-sample check of the planner.

The calibration rows were chosen one by one to measure a term; a user's recipe is not. This draws recipes the way
users write them (axolotl's and TRL's examples: a pinned micro-batch and accumulation, gradient checkpointing on or
off, LoRA ranks 8-256 with alpha 2r and some dropout, attention-only or all-linear targets, 8-bit optimizers, DoRA,
QLoRA, small full fine-tunes, DPO, DeepSpeed or FSDP on two GPUs) over the families the planner reads, from a seed
fixed before anything is planned or run. Nothing is drawn again because of what the planner predicts, except:
- a recipe the planner says does not fit is counted and replaced (a user is told before any GPU starts; a run of it
  would only show the out-of-memory the plan already names);
- accumulation is halved while the planned step is longer than --max-step-s, so that 12 steps fit a lent machine's
  minutes (the per-step figures do not depend on the accumulation beyond the optimizer step's share).

    python scripts/draw_blind_runs.py --seed 2026113001 --count 10 [--two-gpu-count 4] --out drawn.yaml

Writes matrix entries (YAML lines for scripts/calibration_matrix.yaml's runs) with the plan of each in a comment,
planned as scripts/plan_matrix.py plans them.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import plan_matrix  # noqa: E402

from finetune.plan.workload import count_params  # noqa: E402
from finetune.recipe.schema import ModelSection  # noqa: E402
from finetune.registry import get_model, resolve_model  # noqa: E402

CONFIGS = "tests/data/hub_configs/{}/config.json"
# what fits one H200's RAM disk beside its run and is read by the planner
MODELS = [
    "llama-3.2-1b",
    "llama-3.2-3b",
    "llama-3.1-8b",
    "mistral-7b-v0.3",
    "qwen2.5-7b",
    "qwen3-8b",
    "qwen2.5-14b",
    "qwen3-14b",
    "gemma-2-9b",
    CONFIGS.format("qwen2.5-1.5b"),
    CONFIGS.format("gemma-3-4b"),
    CONFIGS.format("gemma-3-1b"),
    CONFIGS.format("phi-4-mini"),
    CONFIGS.format("smollm3-3b"),
    CONFIGS.format("olmo-2-7b"),
    CONFIGS.format("granite-3.1-8b"),
    CONFIGS.format("qwen3-30b-a3b"),
    CONFIGS.format("olmoe-1b-7b"),
]
ATTENTION_ONLY = ["q_proj", "k_proj", "v_proj", "o_proj"]
TWO_GPU_STRATEGIES = ["ddp", "fsdp2", "zero2", "zero3"]
# a full fine-tune's billions of parameters on one H200 / on two (16 bytes a parameter before activations)
FULL_MAX_B = {1: 4.0, 2: 8.5}


def pick(rng: random.Random, weighted: dict):
    return rng.choices(list(weighted), weights=list(weighted.values()))[0]


def billions(arch: str) -> float:
    """The model's total parameters, as the planner counts them, in billions."""
    if arch.endswith("config.json"):  # a folder holding the config
        return count_params(resolve_model(ModelSection(name=str((ROOT / arch).parent)))).total / 1e9
    return count_params(get_model(arch)).total / 1e9


def draw(rng: random.Random, *, gpus: int) -> dict:
    arch = rng.choice(MODELS)
    adapter = pick(rng, {"lora": 0.6, "qlora": 0.2, "full": 0.2})
    if adapter == "full" and billions(arch) > FULL_MAX_B[gpus]:
        adapter = "lora"
    method = pick(rng, {"sft": 0.8, "dpo": 0.2})
    seq = pick(rng, {1024: 0.2, 2048: 0.35, 4096: 0.3, 8192: 0.15 if method == "sft" else 0.0})
    recipe: dict = {"adapter": {"type": adapter}, "train": {}}
    if method == "dpo":
        recipe["method"] = {"type": "dpo", "beta": 0.1}
    if adapter == "full":
        recipe["train"]["lr"] = 1.0e-5
    else:
        r = pick(rng, {8: 0.2, 16: 0.3, 32: 0.25, 64: 0.15, 128: 0.07, 256: 0.03})
        recipe["adapter"].update(r=r, alpha=2 * r, dropout=pick(rng, {0.0: 0.4, 0.05: 0.45, 0.1: 0.15}))
        if rng.random() < 0.15:
            recipe["adapter"]["dora"] = True
        if rng.random() < 0.25:
            recipe["adapter"]["target_modules"] = ATTENTION_ONLY
    optimizer = pick(rng, {"adamw": 0.6, "adamw_8bit": 0.2, "paged_adamw_8bit": 0.2})
    if optimizer != "adamw":
        recipe["train"]["optimizer"] = optimizer
    micro = pick(rng, {"auto": 0.2, 1: 0.25, 2: 0.3, 4: 0.2, 8: 0.05})
    accumulation = pick(rng, {1: 0.25, 2: 0.3, 4: 0.3, 8: 0.15})
    recipe["train"]["activation_checkpointing"] = pick(rng, {"on": 0.6, "off": 0.25, "auto": 0.15})
    if micro != "auto":
        recipe["train"]["micro_batch_size"] = micro
    entry: dict = {"arch": arch, "seq": seq, "batch": (micro if micro != "auto" else 4) * accumulation * gpus}
    if gpus > 1:
        entry["gpus"] = gpus
        recipe["distributed"] = {"strategy": rng.choice(TWO_GPU_STRATEGIES)}
    entry["recipe"] = recipe
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--count", type=int, default=10, help="one-GPU runs")
    parser.add_argument("--two-gpu-count", type=int, default=0)
    parser.add_argument("--max-step-s", type=float, default=6.0)
    parser.add_argument("--prefix", default="blind")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    defaults = yaml.safe_load(plan_matrix.DEFAULT_MATRIX.read_text())["defaults"]
    folder = Path(tempfile.mkdtemp(prefix="blind-"))
    drawn, not_fitting = [], 0
    for gpus, count in ((1, args.count), (2, args.two_gpu_count)):
        while sum(1 for _, e, _ in drawn if e.get("gpus", 1) == gpus) < count:
            entry = draw(rng, gpus=gpus)
            name = f"{args.prefix}{args.seed % 1000}-{len(drawn) + 1:02d}"
            while True:
                planned = plan_matrix.plan_entry(name, plan_matrix.merge(defaults, entry), folder=folder)
                if "refused" in planned or not planned["fits"] or planned["step_time_s"] <= args.max_step_s:
                    break
                micro = entry["recipe"]["train"].get("micro_batch_size", 4)
                if entry["batch"] <= micro * gpus:
                    break
                entry["batch"] //= 2
            if "refused" in planned or not planned["fits"]:
                not_fitting += 1
                print(f"# replaced: {plan_matrix.describe(planned)} <- {entry}", file=sys.stderr)
                continue
            drawn.append((name, entry, planned))
    lines = [f"  # drawn by scripts/draw_blind_runs.py --seed {args.seed}; {not_fitting} draws replaced (not fitting)"]
    for name, entry, planned in drawn:
        lines.append(f"  # planned: {plan_matrix.describe(planned)}")
        lines.append(f"  {name}: {yaml.safe_dump(entry, default_flow_style=True, width=10_000).strip()}")
    args.out.write_text("\n".join(lines) + "\n")
    print(f"{len(drawn)} runs written to {args.out}")


if __name__ == "__main__":
    main()
