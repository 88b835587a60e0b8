"""Recipes, resolved recipes and hardware presets for tests, built the way users and `finetune compile` build
them: tiny recipes on the shipped tiny model, resolved by the real planner and compiler, presets validated by
the registry's schema."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from tests.helpers.paths import QUICKSTART_DATA, TINY_MODEL, TRAIN


def tiny_recipe(**sections) -> dict:
    """A small fast recipe on the shipped tiny model; keyword sections are merged over it."""
    from finetune.recipe.load import deep_merge

    base = {
        "model": {"name": str(TINY_MODEL), "dtype": "float32"},
        "adapter": {"type": "lora", "r": 8, "alpha": 16},
        "data": {
            "sources": [{"path": str(QUICKSTART_DATA / "train.jsonl"), "max_samples": 64}],
            "eval_sources": [{"path": str(QUICKSTART_DATA / "eval.jsonl"), "max_samples": 16}],
            "max_length": 32,
        },
        "train": {
            "max_steps": 6,
            "lr": 3e-3,
            "global_batch_size": 8,
            "micro_batch_size": 8,
            "precision": "fp32",
            "warmup_ratio": 0.0,
            "scheduler": "constant",
        },
        "hardware": "cpu",
    }
    return deep_merge(base, sections)


def resolve_recipe(recipe: dict | str | Path, *, run_dir: Path, hardware: str | None = None) -> Path:
    """What `finetune compile` writes for the ranks, through the real planner and compiler: write
    RUN_DIR/recipe.resolved.yaml (only that file) and return its path.

    A dict is taken as written (trackers default to none); a path is loaded like `finetune compile PATH`,
    its relative paths anchored at its folder."""
    from finetune.compile.compiler import prepare_recipe
    from finetune.recipe.load import load_recipe
    from finetune.rundir import RESOLVED_RECIPE

    if isinstance(recipe, dict):
        recipe = copy.deepcopy(recipe)
        recipe.setdefault("logging", {}).setdefault("report_to", ["none"])
    compiled = prepare_recipe(load_recipe(recipe), run_dir=run_dir, hardware=hardware)
    out = Path(compiled.spec.run_dir) / RESOLVED_RECIPE
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(compiled.texts[RESOLVED_RECIPE])
    return out


def tiny_trainer(raw: dict, *, run_dir: Path, has_eval: bool, callbacks=(), resolved: dict | None = None):
    """(recipe, trainer): `raw` resolved into `run_dir` and built into the real trainer a rank builds, on the
    CPU in this process (the data prepared as one process prepares it). `resolved`: planner decisions to pin
    over compile's (e.g. a GPU's row_multiple)."""
    from accelerate import PartialState

    from finetune.recipe.load import load_recipe
    from finetune.train.model import load_model, load_tokenizer
    from finetune.train.preflight import prepare_data
    from finetune.train.trainers import build_trainer, training_args

    recipe = load_recipe(resolve_recipe(raw, run_dir=run_dir), allow_resolved=True)
    if resolved:
        recipe = recipe.model_copy(update={"resolved": recipe.resolved.model_copy(update=resolved)})
    tokenizer = load_tokenizer(recipe)
    trainer = build_trainer(
        recipe,
        args=training_args(recipe, run_dir=run_dir, has_eval=has_eval),
        model=load_model(recipe),
        tokenizer=tokenizer,
        data=prepare_data(recipe, tokenizer, state=PartialState(cpu=True)),
        callbacks=list(callbacks),
    )
    return recipe, trainer


def write_recipe(path: Path, **sections) -> Path:
    """A recipe file for CLI runs: 32 examples, batch 8 -> 4 optimizer steps per epoch; LoRA on the tiny
    Llama; no eval. Keyword sections are merged one level deep."""
    recipe = {
        "model": {"name": str(TINY_MODEL), "dtype": "float32"},
        "adapter": {"type": "lora", "r": 8, "alpha": 16},
        "data": {"sources": [{"path": str(TRAIN), "max_samples": 32}], "max_length": 32},
        "train": {
            "epochs": 3,
            "lr": 3e-3,
            "global_batch_size": 8,
            "micro_batch_size": 8,
            "precision": "fp32",
            "warmup_ratio": 0.0,
            "scheduler": "linear",
            "seed": 7,
        },
        "output": {"save_every": 3, "keep": 2},
        "hardware": "cpu",
        "logging": {"report_to": ["none"]},
    }
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value} if isinstance(value, dict) else value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe))
    return path


def write_preset(path: Path, *, like: str | None = "cpu", **fields) -> Path:
    """A hardware preset file: the shipped preset `like` (or nothing: `fields` alone) with `fields` over it,
    validated by the registry's schema before it is written."""
    from finetune.registry import get_preset
    from finetune.registry.schema import HardwarePreset

    base = get_preset(like).model_dump(exclude_defaults=True) if like else {}
    preset = HardwarePreset.model_validate({**base, **fields})
    path.write_text(yaml.safe_dump(preset.model_dump(exclude_defaults=True)))
    return path


def cpu_preset(path: Path, *, procs: int = 1, nodes: int = 1, **fields) -> Path:
    """`procs` CPU processes (gloo) on each of `nodes` hosts."""
    return write_preset(
        path,
        name=f"cpu-{nodes}x{procs}",
        description="test: CPU processes on gloo",
        gpus_per_node=procs,
        nodes=nodes,
        **fields,
    )


def shape_recipe(
    model: str, adapter: str, hardware: str = "server-8xh100", *, seq: int = 2048, global_batch: int = 64, **sections
):
    """A loaded recipe of a registry model shape for planner arithmetic (nothing is read or trained);
    `section__key=value` keywords set single keys, e.g. train__optimizer="adamw_8bit"."""
    from finetune.recipe import load_recipe

    raw = {
        "model": {"name": model},
        "adapter": {"type": adapter},
        "data": {"path": "train.jsonl", "max_length": seq},
        "train": {"global_batch_size": global_batch},
        "hardware": hardware,
    }
    for dotted, value in sections.items():
        section, key = dotted.split("__")
        raw.setdefault(section, {})[key] = value
    return load_recipe(raw)


def shape_job(model_key: str, adapter: str, hardware="server-8xh100", **kw):
    """The planner's Job for shape_recipe(model_key, ...) on `hardware`: a registry preset's name, or a
    HardwarePreset object (e.g. one synthesize_preset detected; the recipe then says hardware: auto)."""
    from finetune.plan import job_from_recipe
    from finetune.registry import get_model, get_preset

    name = hardware if isinstance(hardware, str) else "auto"
    preset = get_preset(hardware) if isinstance(hardware, str) else hardware
    r = shape_recipe(model_key, adapter, name, model__arch=model_key, **kw)
    return job_from_recipe(r, arch=get_model(model_key), preset=preset)
