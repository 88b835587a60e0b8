"""The registries: model architectures and hardware presets, stored as YAML data next to this file.

Public API (pure Python, no torch):
    list_models() -> list[ModelArch]            list_presets() -> list[HardwarePreset]
    get_model(key) -> ModelArch                 get_preset(name_or_path, *, base_dir=None) -> HardwarePreset
    resolve_model(model_section, *, base_dir=None) -> ModelArch
"""

from __future__ import annotations

import difflib
import re
from functools import cache
from pathlib import Path

from pydantic import BaseModel, ValidationError

from finetune.errors import RecipeError
from finetune.recipe.paths import anchored
from finetune.registry.derive import arch_from_config, find_config_json, text_config
from finetune.registry.schema import HardwarePreset, ModelArch

REGISTRY_DIR = Path(__file__).resolve().parent
MODELS_DIR = REGISTRY_DIR / "models"
HARDWARE_DIR = REGISTRY_DIR / "hardware"

__all__ = [
    "ModelArch",
    "HardwarePreset",
    "list_models",
    "list_presets",
    "get_model",
    "get_preset",
    "resolve_model",
    "load_yaml_as",
    "REGISTRY_DIR",
]


def load_yaml_as(path: Path, schema: type[BaseModel]):
    """Read one YAML file and validate it; errors name the file and the key (recipe-style)."""
    from finetune.recipe.load import read_yaml, validation_error_to_recipe_error

    raw = read_yaml(Path(path))
    if not isinstance(raw, dict):
        raise RecipeError(f"expected a mapping of {schema.__name__} fields, got {type(raw).__name__}", file=str(path))
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        raise validation_error_to_recipe_error(exc, file=str(path), schema=schema) from None


@cache
def _models() -> dict[str, ModelArch]:
    out = {}
    for path in sorted(MODELS_DIR.rglob("*.yaml")):
        arch = load_yaml_as(path, ModelArch)
        out[arch.key] = arch
    return out


@cache
def _presets() -> dict[str, HardwarePreset]:
    out = {}
    for path in sorted(HARDWARE_DIR.rglob("*.yaml")):
        preset = load_yaml_as(path, HardwarePreset)
        out[preset.name] = preset
    return out


def list_models() -> list[ModelArch]:
    return list(_models().values())


def list_presets() -> list[HardwarePreset]:
    return list(_presets().values())


# a model name's size ("8b", "1.1b", "270m", "8x7b", "a2.7b") and its family words ("gemma", "llama"), without
# the words every family shares
_SIZE = re.compile(r"(?<![a-z0-9.])(?:\d+x)?[a]?\d+(?:\.\d+)?[bm](?![a-z0-9])")
_GENERIC = {"instruct", "chat", "base", "hf", "it", "pt", "bf16", "fp8", "preview", "model", "models"}


def _model_words(name: str) -> tuple[set[str], set[str]]:
    repo = name.lower().rsplit("/", 1)[-1]
    sizes = set(_SIZE.findall(repo))
    words = {w for w in re.findall(r"[a-z]{3,}", repo) if w not in _GENERIC}
    return sizes, words


def _same_model(name: str, candidate: str) -> bool:
    """A suggestion for a model must be the same family, and the same size where the name gives one: gemma-3-270m
    is not gemma-3-27b, and following a hint that plans another size plans the wrong model."""
    sizes, words = _model_words(name)
    their_sizes, their_words = _model_words(candidate)
    return (not sizes or sizes == their_sizes) and bool(words & their_words)


def _did_you_mean(word: str, choices: list[str], *, models: bool = False) -> str:
    if models:  # only the same family and size (a registry key or a Hub id of one)
        choices = [c for c in choices if _same_model(word, c)]
    close = difflib.get_close_matches(word.lower(), [c.lower() for c in choices], n=1, cutoff=0.5)
    if not close:
        return ""
    original = next(c for c in choices if c.lower() == close[0])
    return f"did you mean {original}? "


def get_model(key: str) -> ModelArch:
    models = _models()
    if key in models:
        return models[key]
    lowered = {k.lower(): v for k, v in models.items()}
    if key.lower() in lowered:
        return lowered[key.lower()]
    raise RecipeError(
        f"unknown model architecture {key!r}",
        key="model.arch",
        hint=f"{_did_you_mean(key, list(models), models=True)}known: {', '.join(models)}",
    )


def _by_hub_id(name: str) -> ModelArch | None:
    wanted = name.strip().lower().rstrip("/")
    for arch in _models().values():
        if any(h.lower() == wanted for h in arch.hub_ids):
            return arch
    return None


def resolve_model(model_section, *, base_dir: str | Path | None = None) -> ModelArch:
    """The architecture a recipe's `model:` section names, with the section's config overrides applied
    (`model.attention_dropout`: training runs the config with it, finetune.train.model.base_config).

    Order: `model.arch` (a registry key); `model.name` matched case-insensitively against the
    registry's Hub ids; a local directory (relative to base_dir) or a Hugging Face cache snapshot
    with config.json, from which the numbers are derived; for any other Hub id, its config.json from
    the Hub (only that file, cached; from the cache when offline). Otherwise a RecipeError with a hint.
    """
    arch = _named_model(model_section, base_dir=base_dir)
    dropout = getattr(model_section, "attention_dropout", None)
    if dropout is not None:
        arch = arch.model_copy(update={"attention_dropout": dropout})
    return arch


def stand_in_warning(model_section, arch: ModelArch, *, base_dir: str | Path | None = None) -> str:
    """'' unless model.arch names a registry entry while the config.json model.name points at (a local
    directory or the Hugging Face cache; nothing is fetched) is another architecture: the plan then
    describes the stand-in, and training loads the real model."""
    import json

    if not getattr(model_section, "arch", None):
        return ""
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    path = find_config_json(model_section.name, base_dir=base, revision=getattr(model_section, "revision", None))
    if path is None:
        return ""
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    if not isinstance(cfg, dict):
        return ""
    text = text_config(cfg)
    types = {t for t in (cfg.get("model_type"), text.get("model_type")) if t}
    if not types or arch.family in types:
        return ""
    return (
        f"model.arch {arch.key} ({arch.family}) stands in for {model_section.name}, whose config.json says model_type "
        f"{cfg.get('model_type') or text.get('model_type')}: this plan's memory and speed are {arch.key}'s, not the "
        "model's that training loads; check them with `finetune plan --measure` before a long run"
    )


def _named_model(model_section, *, base_dir: str | Path | None) -> ModelArch:
    if getattr(model_section, "arch", None):
        return get_model(model_section.arch)
    name = model_section.name
    found = _by_hub_id(name)
    if found is not None:
        return found
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    config = find_config_json(name, base_dir=base, revision=getattr(model_section, "revision", None))
    if config is not None:
        if "snapshots" in config.parts:  # found in the Hugging Face cache: name is a Hub id
            return arch_from_config(config, key=name.split("/")[-1].lower(), hub_id=name)
        return arch_from_config(config, key=config.parent.name)
    from finetune.registry.hub_config import fetch_config, looks_like_hub_id

    choices = [h for a in _models().values() for h in a.hub_ids] + list(_models())
    registered = _models().get(name.strip().lower())
    if registered is not None:  # a registry key written where a Hub id or a directory belongs
        hub = registered.hub_ids[0] if registered.hub_ids else None
        raise RecipeError(
            f"{name!r} is a key of finetune's model registry (`finetune models`), not a Hub id or a directory",
            key="model.name",
            hint=(f"set model.name: {hub} to load its weights, or " if hub else "")
            + f"keep this name and add model.arch: {registered.key} to plan only",
        )
    if looks_like_hub_id(name) and not (base / name).exists():
        try:
            path = fetch_config(name, revision=getattr(model_section, "revision", None))
        except RecipeError as err:
            err.hint = f"{_did_you_mean(name, choices, models=True)}{err.hint or ''}"
            raise
        return arch_from_config(path, key=name.split("/")[-1].lower(), hub_id=name)
    raise RecipeError(
        f"cannot tell the architecture of {name!r}: not a known Hub id, and no config.json found "
        f"at {base / name} or in the Hugging Face cache",
        key="model.name",
        hint=(
            f"{_did_you_mean(name, choices, models=True)}set model.arch to one of: {', '.join(_models())}; "
            f"or point model.name at a directory with config.json"
        ),
    )


def get_preset(name_or_path: str, *, base_dir: str | Path | None = None) -> HardwarePreset:
    """A preset by name, `auto` (detect the local GPUs), or a path to a user's preset YAML file."""
    presets = _presets()
    if name_or_path == "cpu":  # the host's CPU: its peak follows the cores this process has
        from finetune.registry.detect import on_cores, usable_cores

        return on_cores(presets["cpu"], usable_cores())
    if name_or_path in presets:
        return presets[name_or_path]
    if name_or_path == "auto":
        from finetune.registry.detect import detect_preset

        return detect_preset()
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    path = anchored(name_or_path, base)
    looks_like_file = name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path
    if path.is_file():
        return load_yaml_as(path, HardwarePreset)
    if looks_like_file:
        raise RecipeError(
            "hardware preset file not found",
            file=str(path),
            key="hardware",
            hint="check the path (relative paths start at the recipe's directory)",
        )
    raise RecipeError(
        f"unknown hardware preset {name_or_path!r}",
        key="hardware",
        hint=(f"{_did_you_mean(name_or_path, list(presets))}use auto, a preset file, or one of: {', '.join(presets)}"),
    )
