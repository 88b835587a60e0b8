"""Plan runs of a calibration matrix on CPU, as the GPU machine's `finetune run --hardware auto` will plan them.

Each named run gets what scripts/gpu_validate.py gives it there (its random model's config and tokenizer, its
synthetic data, its recipe), planned on the preset `--hardware auto` synthesizes for the card and GPU count given
here. The line printed per run is what a matrix comment records before the run: strategy, micro-batch x
accumulation, checkpointed layers, planned GiB per GPU and tokens/s.

    python scripts/plan_matrix.py NAME... [--matrix scripts/calibration_matrix.yaml] [--card "NVIDIA H200"]
        [--host-ram-gib 128] [--host-us 30 40] [--json OUT.json]

A plan inside `finetune run` on a GPU machine times that machine's host (finetune/hostprobe.py); `--host-us` plans
each run at the given host figures (microseconds a kernel) instead of the unprobed floor, one line per figure.

Models (config only) and data are written under FINETUNE_MODELS and FINETUNE_VALIDATION_DIR (defaults under /tmp).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers: the cards' `--hardware auto` preset
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_validate import WORK, data_format, ensure_model, load_matrix, merge, run_recipe, write_data  # noqa: E402

from finetune.api import make_plan  # noqa: E402
from finetune.errors import FinetuneError  # noqa: E402
from finetune.recipe import load_recipe  # noqa: E402
from finetune.registry import resolve_model  # noqa: E402
from finetune.registry.families import LIGER_MODEL_TYPES  # noqa: E402
from tests.helpers.calibration_rows import MEMORY_TOTAL, preset_for  # noqa: E402

DEFAULT_MATRIX = Path(__file__).resolve().parent / "calibration_matrix.yaml"


def preset_file(card: str, *, gpus: int, host_ram_gib: float, folder: Path, host_s_per_kernel: float = 0.0) -> Path:
    """The preset `--hardware auto` synthesizes on a machine with `gpus` of `card` and that much host RAM (its host
    timed at `host_s_per_kernel`, where given)."""
    preset = preset_for(card, gpus_per_node=gpus, ram_gib=host_ram_gib)
    if host_s_per_kernel:
        preset = preset.model_copy(update={"host_s_per_kernel": host_s_per_kernel})
    path = folder / f"auto-{gpus}-{host_s_per_kernel * 1e6:.0f}us.yaml"
    path.write_text(yaml.safe_dump(preset.model_dump(mode="json", exclude_none=True)))
    return path


def as_on_the_gpu_machine(raw: dict):
    """The recipe with train.liger: auto resolved as the GPU machine resolves it (liger-kernel is installed there,
    scripts/gpu_env.sh, and perhaps not here)."""
    recipe = load_recipe(raw)
    if recipe.train.liger == "auto":
        on = resolve_model(recipe.model).family in LIGER_MODEL_TYPES
        recipe = load_recipe(merge(raw, {"train": {"liger": "on" if on else "off"}}))
    return recipe


def plan_entry(
    name: str,
    entry: dict,
    *,
    card: str = "NVIDIA H200",
    host_ram_gib: float = 128.0,
    folder: Path = WORK,
    host_s_per_kernel: float = 0.0,
) -> dict:
    """The plan of one matrix run (its defaults merged in) as a dict; `refused` where the planner refuses it."""
    override = entry.get("recipe", {})
    gpus = entry.get("gpus", 1)
    work = folder / name
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data.jsonl"
    fmt = data_format(override.get("method", {}).get("type", "sft"))
    write_data(
        data, fmt=fmt, seq=entry["seq"], n=entry.get("examples", 4000), long_examples=entry.get("long_examples", False)
    )
    model_dir = ensure_model(entry["arch"], config_only=True)
    recipe = run_recipe(model_dir, data, override, steps=entry["steps"], seq=entry["seq"], batch=entry["batch"])
    preset = preset_file(
        card, gpus=gpus, host_ram_gib=host_ram_gib * gpus, folder=work, host_s_per_kernel=host_s_per_kernel
    )
    try:
        recipe = as_on_the_gpu_machine(recipe)
        _, plan = make_plan(recipe, hardware=str(preset))
    except FinetuneError as exc:
        return {"name": name, "refused": str(exc).splitlines()[0]}
    return {
        "name": name,
        "host_us": round(host_s_per_kernel * 1e6, 1) or None,
        "fits": plan.fits,
        "strategy": plan.strategy,
        "gpus": plan.world_size,
        "micro_batch_size": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "checkpoint_layers": plan.checkpoint_layers,
        "num_layers": plan.num_layers,
        "per_gpu_memory_gib": round(plan.per_gpu_memory_gib, 1),
        "tokens_per_second": round(plan.tokens_per_second),
        "step_time_s": round(plan.step_time_s, 2),
        "why": plan.why,
        "warnings": plan.warnings,
    }


def describe(p: dict) -> str:
    if "refused" in p:
        return f"{p['name']}: refused: {p['refused']}"
    ckpt = "none" if not p["checkpoint_layers"] else f"{p['checkpoint_layers']} of {p['num_layers']} checkpointed"
    fits = "" if p["fits"] else " (DOES NOT FIT)"
    host = f" at {p['host_us']} us a kernel" if p.get("host_us") else ""
    return (
        f"{p['name']}{host}: {p['strategy']} {p['micro_batch_size']} x {p['gradient_accumulation_steps']} "
        f"on {p['gpus']}, "
        f"{ckpt}, {p['per_gpu_memory_gib']} GiB, {p['tokens_per_second']:,} tokens/s, "
        f"{p['step_time_s']} s/step{fits}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--matrix", type=Path, default=DEFAULT_MATRIX)
    parser.add_argument("--card", default="NVIDIA H200", choices=sorted(MEMORY_TOTAL))
    parser.add_argument("--host-ram-gib", type=float, default=128.0, help="host RAM per GPU of the machine")
    parser.add_argument("--host-us", type=float, nargs="*", default=[0.0], help="the host's figures (0: unprobed)")
    parser.add_argument("--json", type=Path, help="also write the plans here")
    args = parser.parse_args()
    matrix = load_matrix(args.matrix)
    unknown = [n for n in args.runs if n not in matrix]
    if unknown:
        parser.error(f"not in {args.matrix}: {unknown}")
    plans = [
        plan_entry(n, matrix[n], card=args.card, host_ram_gib=args.host_ram_gib, host_s_per_kernel=us * 1e-6)
        for n in args.runs
        for us in args.host_us
    ]
    for p in plans:
        print(describe(p), flush=True)
    if args.json:
        args.json.write_text(json.dumps(plans, indent=1) + "\n")


if __name__ == "__main__":
    main()
