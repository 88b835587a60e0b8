"""Read a recipe: YAML, `extends:` chains, `--set key=value` overrides, strict validation.

Every failure becomes a RecipeError naming the file and the full key path, with a
did-you-mean suggestion for unknown keys.
"""

from __future__ import annotations

import copy
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from finetune.errors import RecipeError
from finetune.recipe.schema import Recipe

MAX_EXTENDS_DEPTH = 8
MAX_INT = 2**63 - 1  # larger numbers are typos (1e30 steps), and overflow every library below
# The names peer tools use for our keys: `did you mean` maps them to ours.
ALIASES = {
    "learning_rate": "train.lr", "lr_scheduler_type": "train.scheduler", "lr_scheduler": "train.scheduler",
    "num_train_epochs": "train.epochs", "num_epochs": "train.epochs",
    "per_device_train_batch_size": "train.micro_batch_size", "micro_batch": "train.micro_batch_size",
    "batch_size": "train.global_batch_size", "total_batch_size": "train.global_batch_size",
    "gradient_checkpointing": "train.activation_checkpointing", "optim": "train.optimizer",
    "bf16": "train.precision", "fp16": "train.precision", "max_grad_norm_clip": "train.max_grad_norm",
    "rank": "adapter.r", "lora_r": "adapter.r", "lora_rank": "adapter.r", "lora_alpha": "adapter.alpha",
    "lora_dropout": "adapter.dropout", "lora_target_modules": "adapter.target_modules",
    "use_dora": "adapter.dora", "use_rslora": "adapter.rslora",
    "max_seq_length": "data.max_length", "max_seq_len": "data.max_length", "sequence_len": "data.max_length",
    "max_len": "data.max_length", "dataset": "data.sources", "datasets": "data.sources",
    "output_dir": "output.dir", "save_steps": "output.save_every", "save_total_limit": "output.keep",
    "model_name_or_path": "model.name", "base_model": "model.name", "torch_dtype": "model.dtype",
    "hub_model_id": "hub.repo", "report_to": "logging.report_to",
}


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, made strict: a repeated key is an error (PyYAML keeps the last one, so a
    second `train:` silently replaces the first), and only plain decimal integers are integers
    (YAML 1.1 reads 0x10 as 16, 0o17 and 1:30 as numbers); `2e-4` is a float, as in YAML 1.2."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key] + 1}; a repeated key would "
                                f"silently replace the first)", key_node.start_mark)
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:int"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.copy().items()}
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?([0-9][0-9_]*)?\.?[0-9]*[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def safe_load(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)


def read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError("file not found", file=str(path),
                          hint="check the path; recipes ship in recipes/") from None
    except IsADirectoryError:
        raise RecipeError("is a directory, not a recipe file", file=str(path),
                          hint="pass the recipe's YAML file, e.g. recipes/quickstart.yaml") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"cannot read: {exc}", file=str(path),
                          hint="check the file is a readable UTF-8 YAML recipe") from None
    try:
        return safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(f"not valid YAML{where}: {problem}", file=str(path),
                          hint="fix the YAML syntax (indentation, quotes, colons)") from None


def deep_merge(base: dict, override: dict) -> dict:
    """Mappings merge key by key; anything else in `override` replaces the base value."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _load_raw(path: Path, depth: int = 0, seen: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(p.name for p in seen + (path,))
        raise RecipeError(f"extends forms a cycle: {chain}", file=str(path), key="extends",
                          hint="remove the extends: that points back into the chain")
    if depth > MAX_EXTENDS_DEPTH:
        raise RecipeError(f"extends chain deeper than {MAX_EXTENDS_DEPTH}", file=str(path), key="extends",
                          hint="merge some of the recipes in the chain")
    raw = read_yaml(path)
    if raw is None:
        raise RecipeError("the recipe is empty", file=str(path),
                          hint="start from a recipe in recipes/, e.g. recipes/quickstart.yaml")
    if not isinstance(raw, dict):
        raise RecipeError(f"a recipe is a mapping of sections, got a {type(raw).__name__}",
                          file=str(path), hint="the top level needs keys like model:, data:, train:")
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise RecipeError("must be a path to another recipe", file=str(path), key="extends",
                          hint="write extends: other-recipe.yaml (relative to this file)")
    parent_path = (path.parent / parent)
    base = _load_raw(parent_path, depth + 1, seen + (path,))
    return deep_merge(base, raw)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.lr=2e-4` -> (["train", "lr"], 2e-4); the value is parsed as YAML."""
    if "=" not in text:
        raise RecipeError(f"--set {text!r}: expected KEY=VALUE", hint="e.g. --set train.lr=2e-4")
    key, _, value = text.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"--set {text!r}: empty key", hint="e.g. --set adapter.r=32")
    try:
        parsed = safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key.split("."), parsed


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for i, part in enumerate(path[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            elif not isinstance(nxt, dict):
                raise RecipeError(f"--set {text}: {'.'.join(path[:i + 1])} is not a section",
                                  key=".".join(path), hint=f"set {'.'.join(path[:i + 1])}=VALUE itself")
            node = nxt
        node[path[-1]] = value
    return raw


def _members(annotation) -> list:
    """The types a field accepts: Optional/Union flattened, Annotated unwrapped."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation]


def _number_problem(value, members: list) -> str | None:
    """Why `value` is no honest number for a field that takes numbers (pydantic would coerce it)."""
    literals = [v for m in members if typing.get_origin(m) is typing.Literal for v in typing.get_args(m)]
    takes_int, takes_float = int in members, float in members
    if not (takes_int or takes_float) or value is None or value in literals and not isinstance(value, bool):
        return None
    if isinstance(value, bool):
        return None if bool in members else f"must be a number, not {str(value).lower()}"
    if isinstance(value, str) and str not in members:
        return f"must be a number without quotes, got the text {value!r}"
    if isinstance(value, float) and not takes_float:
        return f"must be a whole number, got {value!r}"
    if isinstance(value, int) and abs(value) > MAX_INT:
        return f"is far too large ({value:.3g})"
    return None


def check_types(raw: Any, model: type[BaseModel], *, prefix: str = "", file: str | None = None) -> None:
    """Refuse what pydantic would quietly coerce into a number: true -> 1, "60" -> 60, 1e30 -> int."""
    if not isinstance(raw, dict):
        return
    for name, value in raw.items():
        field = model.model_fields.get(name) if isinstance(name, str) else None
        if field is None:
            continue
        key = f"{prefix}{name}"
        members = _members(field.annotation)
        problem = _number_problem(value, members)
        if problem:
            raise RecipeError(problem, key=key, file=file,
                              hint="write a plain decimal number (e.g. 60, 0.0002), without quotes")
        for sub in (m for m in members if isinstance(m, type) and issubclass(m, BaseModel)):
            check_types(value, sub, prefix=f"{key}.", file=file)
        for m in members:
            item = typing.get_args(m)[0] if typing.get_origin(m) is list and typing.get_args(m) else None
            if isinstance(item, type) and issubclass(item, BaseModel) and isinstance(value, list):
                for i, entry in enumerate(value):
                    check_types(entry, item, prefix=f"{key}[{i}].", file=file)


def _alias(name: str, valid: list[str], prefix: str) -> str | None:
    """Our key for a peer tool's name (learning_rate -> train.lr), as a full key path."""
    target = ALIASES.get(name.lower())
    if target is None:
        return None
    section, _, field = target.rpartition(".")
    return f"{prefix}.{field}" if field in valid and (not prefix or prefix.endswith(section)) else target


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The valid keys of the schema section that `loc` points into (for did-you-mean)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        current = _model_in(fields[part].annotation)
        if current is None:
            return []
    return list(getattr(current, "model_fields", {}))


def _model_in(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _key_path(loc: tuple) -> str:
    parts = []
    for part in loc:
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif part in ("function-after", "function-before") or "[" in str(part):
            continue  # pydantic's internal union/validator tags are not recipe keys
        else:
            parts.append(("." if parts else "") + str(part))
    return "".join(parts)


def validation_error_to_recipe_error(exc: ValidationError, *, file: str | None,
                                     schema: type[BaseModel] = Recipe) -> RecipeError:
    err = exc.errors()[0]
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or "function" in p)))
    key = _key_path(loc)
    etype = err["type"]
    if etype == "extra_forbidden":
        valid = _fields_at(schema, loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
        prefix = _key_path(loc[:-1])
        alias = _alias(str(loc[-1]), valid, prefix) if schema is Recipe else None
        if alias:
            return RecipeError(f"unknown key; finetune calls it {alias}", key=key, file=file,
                               hint=f"rename it to {alias}")
        if close:
            suggestion = f"{prefix}.{close[0]}" if prefix else close[0]
            return RecipeError(f"unknown key; did you mean {suggestion}?", key=key, file=file,
                               hint=f"rename it to {suggestion}")
        listed = ", ".join(valid) if valid else "none"
        return RecipeError("unknown key", key=key, file=file, hint=f"valid keys here: {listed}")
    if etype == "missing":
        return RecipeError("required key is missing", key=key, file=file,
                           hint=f"add {key}: ... (see recipes/quickstart.yaml)")
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    fix = "change it as the message says; `finetune validate RECIPE` checks the result"
    if msg.startswith("@"):  # cross-field conflict carrying its own key path
        inner_key, _, msg = msg[1:].partition("@ ")
        return RecipeError(msg, key=inner_key, file=file, hint=fix)
    if etype == "value_error":
        return RecipeError(msg, key=key or None, file=file, hint=fix)
    got = err.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return RecipeError(f"{msg} (got {shown})", key=key or None, file=file,
                       hint=_type_hint(etype, err))


BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _type_hint(etype: str, err: dict) -> str | None:
    ctx = err.get("ctx", {})
    if etype == "literal_error":
        expected = ctx.get("expected")
        return f"use one of {expected}" if expected else None
    if etype.endswith("_type") or etype.endswith("_parsing"):
        return "check the value's type (numbers unquoted, lists in [ ], sections as mappings)"
    if etype in BOUNDS:
        limit = next((v for k, v in ctx.items() if k in ("gt", "ge", "lt", "le")), None)
        return f"use a value {BOUNDS[etype]} {limit}" if limit is not None else None
    if etype in ("too_short", "too_long"):
        return "check how many entries the list has"
    if etype == "string_pattern_mismatch":
        return f"write it in the form {ctx.get('pattern', 'shown in recipes/')}"
    return "compare with the shipped recipes in recipes/ (`finetune validate RECIPE` checks a change)"


def load_recipe(source: str | Path | dict, *, overrides: list[str] | None = None,
                allow_resolved: bool = False) -> Recipe:
    """Load and validate a recipe from a YAML path (or an already-parsed mapping)."""
    file = None
    if isinstance(source, dict):
        raw = copy.deepcopy(source)
        raw.pop("extends", None)
    else:
        file = str(source)
        raw = _load_raw(Path(source))
    raw = apply_overrides(raw, list(overrides or []))
    if raw.get("resolved") is not None and not allow_resolved:
        raise RecipeError("is written by the planner, not by hand", key="resolved", file=file,
                          hint="remove the resolved: section (it appears only in recipe.resolved.yaml)")
    check_types(raw, Recipe, file=file)
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as exc:
        raise validation_error_to_recipe_error(exc, file=file) from None
    if file is not None:
        # remember where relative data paths are anchored
        recipe._source_dir = str(Path(file).resolve().parent)
        recipe._source_name = Path(file).stem.removesuffix(".resolved").removesuffix(".recipe")
    return recipe


def recipe_dir(recipe: Recipe) -> Path:
    return Path(recipe._source_dir or ".").resolve()


def recipe_name(recipe: Recipe) -> str:
    return recipe._source_name or "recipe"


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
