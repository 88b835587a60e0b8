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
from finetune.recipe.schema import CONFLICT_ERROR, Recipe
from finetune.rundir import RESOLVED_RECIPE

MAX_EXTENDS_DEPTH = 8
MAX_INT = 2**63 - 1  # larger numbers are typos (1e30 steps), and overflow every library below


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
                    None,
                    None,
                    f"duplicate key {key!r} (first at line {seen[key] + 1}; a repeated key would "
                    f"silently replace the first)",
                    key_node.start_mark,
                )
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:int"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.copy().items()
}
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?([0-9][0-9_]*)?\.?[0-9]*[eE][-+]?[0-9]+$"), list("-+0123456789.")
)


def safe_load(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)


def read_yaml(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError("file not found", file=str(path), hint="check the path; recipes ship in recipes/") from None
    except IsADirectoryError:
        raise RecipeError(
            "is a directory, not a recipe file",
            file=str(path),
            hint="pass the recipe's YAML file, e.g. recipes/quickstart.yaml",
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(
            f"cannot read: {exc}", file=str(path), hint="check the file is a readable UTF-8 YAML recipe"
        ) from None
    try:
        return safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(
            f"not valid YAML{where}: {problem}",
            file=str(path),
            hint="fix the YAML syntax (indentation, quotes, colons)",
        ) from None


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
        raise RecipeError(
            f"extends forms a cycle: {chain}",
            file=str(path),
            key="extends",
            hint="remove the extends: that points back into the chain",
        )
    if depth > MAX_EXTENDS_DEPTH:
        raise RecipeError(
            f"extends chain deeper than {MAX_EXTENDS_DEPTH}",
            file=str(path),
            key="extends",
            hint="merge some of the recipes in the chain",
        )
    raw = read_yaml(path)
    if raw is None:
        raise RecipeError(
            "the recipe is empty", file=str(path), hint="start from a recipe in recipes/, e.g. recipes/quickstart.yaml"
        )
    if not isinstance(raw, dict):
        raise RecipeError(
            f"a recipe is a mapping of sections, got a {type(raw).__name__}",
            file=str(path),
            hint="the top level needs keys like model:, data:, train:",
        )
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise RecipeError(
            "must be a path to another recipe",
            file=str(path),
            key="extends",
            hint="write extends: other-recipe.yaml (relative to this file)",
        )
    parent_path = path.parent / parent
    base = _load_raw(parent_path, depth + 1, seen + (path,))
    return deep_merge(base, raw)


_KEY_PART = re.compile(r"^([^\[\]]+)((?:\[\d+\])*)$")


def _key_parts(text: str, key: str) -> list[str | int]:
    """`data.sources[0].path` -> ["data", "sources", 0, "path"]."""
    parts: list[str | int] = []
    for part in key.split("."):
        m = _KEY_PART.match(part.strip())
        if not m:
            raise RecipeError(f"--set {text!r}: {part!r} is not a key", hint="e.g. --set data.sources[0].format=alpaca")
        parts.append(m.group(1))
        parts += [int(i) for i in re.findall(r"\[(\d+)\]", m.group(2))]
    return parts


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """`train.lr=2e-4` -> (["train", "lr"], 2e-4); `data.sources[0].format=alpaca` -> (["data", "sources", 0,
    "format"], "alpaca"). The value is parsed as YAML."""
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
    return _key_parts(text, key), parsed


def _shown(path: list[str | int]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else ("." if i else "") + p for i, p in enumerate(path))


def _step(node: Any, part: str | int, *, text: str, path: list, at: int, create: bool) -> Any:
    where = _shown(path[:at]) or "the recipe"
    if isinstance(part, int):
        if not isinstance(node, list):
            raise RecipeError(
                f"--set {text}: {where} is not a list", key=_shown(path), hint=f"address it without [{part}]"
            )
        if part >= len(node):
            raise RecipeError(
                f"--set {text}: {where} has {len(node)} item(s), so [{part}] does not exist",
                key=_shown(path),
                hint=f"use an index below {len(node)}, or add the item in the recipe",
            )
        return node[part]
    if not isinstance(node, dict):
        raise RecipeError(f"--set {text}: {where} is not a section", key=_shown(path))
    nxt = node.get(part)
    if nxt is None and create:
        nxt = node[part] = {}
    return nxt


def _has_type_shorthand(section: str) -> bool:
    """Whether a bare string stands for the recipe section `{type: value}` (method, adapter: their models'
    `_shorthand` validators)."""
    field = Recipe.model_fields.get(section)
    model = _model_in(field.annotation) if field else None
    return model is not None and "type" in model.model_fields and hasattr(model, "_shorthand")


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node: Any = raw
        for i, part in enumerate(path[:-1]):
            into_list = isinstance(path[i + 1], int)
            if into_list and isinstance(node, dict) and node.get(part) is None:
                shorthand = part == "sources" and "path" in node  # `data: {path: ...}` is one source
                raise RecipeError(
                    f"--set {text}: {_shown(path[: i + 1])} is not set in the recipe, so it has no items",
                    key=_shown(path),
                    hint=(
                        f"this recipe uses the one-source shorthand (data.path); address data.{path[-1]} instead"
                        if shorthand
                        else f"write {_shown(path[: i + 1])} out in the recipe first"
                    ),
                )
            nxt = _step(node, part, text=text, path=path, at=i, create=True)
            if i == 0 and isinstance(nxt, str) and _has_type_shorthand(str(part)):
                nxt = node[part] = {"type": nxt}  # `adapter: lora` is `adapter: {type: lora}`
            if not isinstance(nxt, (dict, list)):
                raise RecipeError(
                    f"--set {text}: {_shown(path[: i + 1])} is not a section",
                    key=_shown(path),
                    hint=f"set {_shown(path[: i + 1])}=VALUE itself",
                )
            node = nxt
        last = path[-1]
        if isinstance(last, int):
            _step(node, last, text=text, path=path, at=len(path) - 1, create=False)
        elif not isinstance(node, dict):
            raise RecipeError(
                f"--set {text}: {_shown(path[:-1])} is a list; pick an item with [N]",
                key=_shown(path),
                hint=f"e.g. {_shown(path[:-1])}[0].{last}",
            )
        node[last] = value
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
            raise RecipeError(
                problem, key=key, file=file, hint="write a plain decimal number (e.g. 60, 0.0002), without quotes"
            )
        for sub in (m for m in members if isinstance(m, type) and issubclass(m, BaseModel)):
            check_types(value, sub, prefix=f"{key}.", file=file)
        for m in members:
            item = typing.get_args(m)[0] if typing.get_origin(m) is list and typing.get_args(m) else None
            if isinstance(item, type) and issubclass(item, BaseModel) and isinstance(value, list):
                for i, entry in enumerate(value):
                    check_types(entry, item, prefix=f"{key}[{i}].", file=file)


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


def _alias_for(schema: type[BaseModel], loc: tuple):
    from finetune.recipe.aliases import lookup

    if schema is not Recipe:
        return None
    section = ".".join(str(p) for p in loc[:-1] if not isinstance(p, int))
    alias = lookup(section, str(loc[-1]))
    if alias is None or _key_path(loc) == alias.key:
        return None
    return alias


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


def validation_error_to_recipe_error(
    exc: ValidationError, *, file: str | None, schema: type[BaseModel] = Recipe
) -> RecipeError:
    err = exc.errors()[0]
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or "function" in p)))
    key = _key_path(loc)
    etype = err["type"]
    if etype == "extra_forbidden":
        valid = _fields_at(schema, loc[:-1])
        prefix = _key_path(loc[:-1])
        alias = _alias_for(schema, loc)
        if alias is not None:
            ours = alias.target(err.get("input"))
            renamed = RecipeError(
                f"unknown key; {key} is a peer's name for {ours} here" + (f" ({alias.note})" if alias.note else ""),
                key=key,
                file=file,
                hint=f"{'rename' if ours.rsplit('.', 1)[0] == prefix else 'move'} it to "
                f"{ours}" + (" and convert its value" if alias.value else ""),
            )
            renamed.rename = (key, ours, alias.value)  # machine-applicable (finetune convert, tests)
            return renamed
        # a typo of a key in this section; a close spelling of another key (warmup_steps -> warmup_ratio)
        # is not proposed, since that key means something else
        close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.8)
        if close:
            suggestion = f"{prefix}.{close[0]}" if prefix else close[0]
            typo = RecipeError(
                f"unknown key; did you mean {suggestion}?", key=key, file=file, hint=f"rename it to {suggestion}"
            )
            typo.rename = (key, suggestion, None)
            return typo
        listed = ", ".join(valid) if valid else "none"
        return RecipeError("unknown key", key=key, file=file, hint=f"valid keys here: {listed}")
    if etype == "missing":
        return RecipeError(
            "required key is missing", key=key, file=file, hint=f"add {key}: ... (see recipes/quickstart.yaml)"
        )
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    fix = "change it as the message says; `finetune validate RECIPE` checks the result"
    if etype == CONFLICT_ERROR:  # a cross-field conflict names its own key path
        return RecipeError(err["ctx"]["message"], key=err["ctx"]["key"], file=file, hint=fix)
    if etype == "value_error":
        return RecipeError(msg, key=key or None, file=file, hint=fix)
    got = err.get("input")
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return RecipeError(f"{msg} (got {shown})", key=key or None, file=file, hint=_type_hint(etype, err))


BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _type_hint(etype: str, err) -> str | None:
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


def load_recipe(
    source: str | Path | dict, *, overrides: list[str] | None = None, allow_resolved: bool = False
) -> Recipe:
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
        raise RecipeError(
            "is written by the planner, not by hand",
            key="resolved",
            file=file,
            hint=f"remove the resolved: section (it appears only in {RESOLVED_RECIPE})",
        )
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


def load_resolved_recipe(path: str | Path) -> Recipe:
    """The resolved recipe a rank trains (RUN_DIR/recipe.resolved.yaml); RecipeError for one `finetune compile`
    did not write."""
    recipe = load_recipe(path, allow_resolved=True)
    if recipe.resolved is None:
        raise RecipeError(
            "not a resolved recipe (it has no resolved: section)",
            file=str(path),
            hint="run it with `finetune run RECIPE`, which plans and compiles it first",
        )
    return recipe


def recipe_dir(recipe: Recipe) -> Path:
    return Path(recipe._source_dir or ".").resolve()


def recipe_name(recipe: Recipe) -> str:
    return recipe._source_name or "recipe"


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
