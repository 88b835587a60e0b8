"""`finetune convert`: a peer's training config (axolotl, LLaMA-Factory, TRL) -> a finetune recipe.

    convert_file(path, source=..., output=...) -> Conversion     (also writes the recipe YAML)

(The package is `peers`, not `convert`, so that `finetune.convert`, the API function, stays a function.)

Each peer module maps what it knows onto our keys; keys left over are mapped through the shared alias
table (finetune/recipe/aliases.py) and whatever remains is written into the recipe as a comment saying
why it was not mapped. A dropped key is "material" when it changes what is trained (a loss setting, a
dataset, a method), and then the CLI exits non-zero. The DeepSpeed and accelerate files a config names
are read for the strategy they ask for. Pure: no heavy imports; the result is validated by load_recipe.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from finetune.compile.files import write_atomic
from finetune.errors import FinetuneError, RecipeError

SOURCES = ("axolotl", "llamafactory", "trl")


@dataclass
class Dropped:
    key: str
    value: Any
    reason: str
    material: bool


@dataclass
class Conversion:
    source: str
    raw: dict
    config_dir: Path
    out_dir: Path
    gpus: int | None = None  # the GPU count the peer config ran on (convert --gpus): None when not said
    gpus_from: str = "--gpus"  # where that count was said: --gpus, or the --hardware preset's
    recipe: dict = field(default_factory=dict)
    used: set[str] = field(default_factory=set)
    dropped: list[Dropped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # where notes holds the one-GPU global batch's (common.global_batch without --gpus), which a model-parallel
    # config's shared batch rewrites (distributed.parallel_sizes)
    one_gpu_batch_note: int | None = None
    error: str | None = None  # the converted recipe's validation error, if any

    # -- helpers for the peer modules --------------------------------------------------------
    def take(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def set(self, path: str, value: Any) -> None:
        *parents, last = path.split(".")
        node = self.recipe
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value

    def get(self, path: str, default: Any = None) -> Any:
        node: Any = self.recipe
        for part in path.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def drop(self, key: str, value: Any, reason: str, *, material: bool = True) -> None:
        self.used.add(key)
        self.dropped.append(Dropped(key, value, reason, material))

    def local_path(self, path: str) -> str:
        """A data/file path as the written recipe must say it (relative to the recipe's directory)."""
        candidate = Path(os.path.expanduser(path))
        for base in (self.config_dir, Path.cwd()):
            full = candidate if candidate.is_absolute() else base / candidate
            if full.exists():
                return os.path.relpath(full.resolve(), self.out_dir.resolve())
        return path  # a Hub id, or a file that is not here yet

    @property
    def material(self) -> list[Dropped]:
        return [d for d in self.dropped if d.material]


def read_mapping(path: Path, *, what: str) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecipeError(f"cannot read the {what}: {exc}", file=str(path)) from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise RecipeError(
            f"the {what} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}", file=str(path)
        ) from None
    if not isinstance(data, dict):
        raise RecipeError(f"the {what} must be a mapping", file=str(path))
    return data


def convert_mapping(
    raw: dict,
    *,
    source: str,
    config_dir: Path,
    out_dir: Path,
    method: str | None = None,
    gpus: int | None = None,
    hardware: str | None = None,
) -> Conversion:
    from finetune.peers import axolotl, llamafactory, trl
    from finetune.peers.common import (
        coerce_numbers,
        drop_packing,
        dtype_for_precision,
        map_aliases,
        micro_batch_minimum,
        owner_less_hub_ids,
        qlora_dtypes,
        reward_head,
        sharded_optimizer,
        shared_keys,
    )

    if source not in SOURCES:
        raise RecipeError(f"unknown source {source!r}", hint=f"use --from {' | '.join(SOURCES)}")
    _refuse_launch_file(raw, source=source)
    if gpus is not None and gpus < 1:
        raise RecipeError(f"--gpus {gpus}: the GPU count must be 1 or more", hint="pass the GPUs the config ran on")
    if hardware is not None:
        gpus = _hardware_gpus(hardware, gpus=gpus)
    conv = Conversion(
        source=source,
        raw=coerce_numbers(raw),
        config_dir=config_dir,
        out_dir=out_dir,
        gpus=gpus,
        gpus_from=f"--hardware {hardware}" if hardware is not None else "--gpus",
    )
    module = {"axolotl": axolotl, "llamafactory": llamafactory, "trl": trl}[source]
    if source == "trl":
        module.convert(conv, method=method)
    else:
        module.convert(conv)
    if hardware is not None:
        conv.set("hardware", _recipe_hardware(hardware, out_dir=out_dir))
    shared_keys(conv)
    map_aliases(conv, ignore=module.IGNORED)
    reward_head(conv)  # after modules_to_save is mapped
    dtype_for_precision(conv)  # after every peer's dtype and precision keys are mapped
    qlora_dtypes(conv)  # after dtype_for_precision has settled model.dtype
    sharded_optimizer(conv)  # after the optimizer and the strategy are mapped
    owner_less_hub_ids(conv)
    drop_packing(conv)
    micro_batch_minimum(conv)
    _validate(conv)
    return conv


def _hardware_gpus(hardware: str, *, gpus: int | None) -> int:
    """The GPU count of `hardware` (convert --hardware: a preset name, a preset file or auto), which --gpus, when
    given too, must agree with."""
    from finetune.registry import get_preset

    count = get_preset(hardware).world_size
    if gpus is not None and gpus != count:
        raise RecipeError(
            f"--gpus {gpus} and --hardware {hardware} ({count} GPUs) disagree",
            hint="pass one of them: --hardware sets the GPU count the config's per-GPU batch multiplies",
        )
    return count


def _recipe_hardware(hardware: str, *, out_dir: Path) -> str:
    """`hardware` as the written recipe reads it: a preset name as it is, a preset file relative to the recipe."""
    from finetune.registry import list_presets

    if hardware == "auto" or hardware in {p.name for p in list_presets()}:
        return hardware
    return os.path.relpath(Path(hardware).resolve(), out_dir.resolve())


# top-level keys only a launch file has: DeepSpeed's JSON and accelerate's YAML (no peer's training config has them)
DEEPSPEED_KEYS = ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size")
ACCELERATE_KEYS = ("distributed_type", "compute_environment")


def _refuse_launch_file(raw: dict, *, source: str) -> None:
    """A DeepSpeed or accelerate file passed in place of the training config that names it."""
    if any(k in raw for k in DEEPSPEED_KEYS):
        raise RecipeError(
            "this is a DeepSpeed config (zero_optimization, ...), not a training config",
            hint=f"convert the {source} training config and reference this file from it (deepspeed: FILE); its "
            "strategy is read from there",
        )
    if any(k in raw for k in ACCELERATE_KEYS):
        where = (
            "reference this file from it (accelerate_config: FILE); its strategy is read from there"
            if source == "trl"
            else f"{source} takes this file on `accelerate launch --config_file`, which finetune replaces: set "
            "distributed.strategy in the recipe, or leave it auto for the planner"
        )
        raise RecipeError(
            "this is an accelerate config (distributed_type, ...), not a training config",
            hint=f"convert the {source} training config instead and {where}",
        )


def _validate(conv: Conversion) -> None:
    from finetune.recipe.load import load_recipe

    try:
        load_recipe(conv.recipe)
    except FinetuneError as err:
        conv.error = err.render()


def render(conv: Conversion) -> str:
    """The recipe YAML, with the unmapped keys as comments at the end (each with its reason)."""
    head = [f"# converted by `finetune convert --from {conv.source}`; check every commented line below"]
    head += [f"# note: {n}" for n in conv.notes]
    if conv.error:
        head += ["# this recipe does not validate yet:"] + [f"#   {line}" for line in conv.error.splitlines()]
    body = yaml.safe_dump(conv.recipe, sort_keys=False) if conv.recipe else ""
    tail = []
    if conv.dropped:
        tail.append(f"# --- not mapped from the {conv.source} config ---")
        for d in conv.dropped:
            shown = yaml.safe_dump({d.key: d.value}, default_flow_style=True, width=10_000).strip()[1:-1]
            tail.append(f"# {shown}   # {'NOT MAPPED' if d.material else 'ignored'}: {d.reason}")
    return "\n".join(head) + "\n" + body + ("\n".join(tail) + "\n" if tail else "")


def convert_file(
    path: str | Path,
    *,
    source: str,
    output: str | Path | None = None,
    method: str | None = None,
    gpus: int | None = None,
    hardware: str | None = None,
) -> Conversion:
    """Convert the peer config at `path`; write the recipe to `output` (when given). `gpus`: the GPU count it ran
    on, which its per-GPU batch sizes multiply into the recipe's global batch; `hardware`: the preset it ran on,
    whose GPU count that is and which the recipe names."""
    path = Path(path)
    out = Path(output) if output else None
    raw = read_mapping(path, what=f"{source} config")
    conv = convert_mapping(
        raw,
        source=source,
        config_dir=path.resolve().parent,
        out_dir=(out.resolve().parent if out else Path.cwd()),
        method=method,
        gpus=gpus,
        hardware=hardware,
    )
    if out is not None:
        write_recipe_text(out, render(conv))
    return conv


def writes_through(out: Path) -> bool:
    """The output is a stream or a link (/dev/stdout, a pipe, a symlink): written through, never replaced."""
    return out.is_symlink() or (out.exists() and not out.is_file() and not out.is_dir())


def write_recipe_text(out: Path, text: str) -> None:
    """A regular file is replaced whole (never half-written); a stream or a link is written through (an atomic
    replace would swap /dev/stdout or the user's link for a file); a directory is refused."""
    if out.is_dir():
        raise FinetuneError(
            "-o names a directory", file=str(out), hint=f"name the recipe file, e.g. {out / 'recipe.yaml'}"
        )
    if writes_through(out):
        with out.open("w", encoding="utf-8") as fh:
            fh.write(text)
        return
    write_atomic(out, text)
