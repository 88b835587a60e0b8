"""Generate docs/recipe-reference.md from the recipe schema (finetune/recipe/schema.py).

Every field's type, default and description come from the pydantic models, so the reference cannot
drift from what `finetune` accepts.

    python scripts/recipe_reference.py          # rewrite docs/recipe-reference.md
    python scripts/recipe_reference.py --check  # exit 1 if it is stale (tests/unit/recipe/test_load.py)
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pydantic import BaseModel  # noqa: E402
from pydantic_core import PydanticUndefined  # noqa: E402

from finetune.recipe.schema import Recipe  # noqa: E402

OUT = ROOT / "docs" / "recipe-reference.md"
HEADER = """# Recipe reference

Generated from `finetune/recipe/schema.py` by `python scripts/recipe_reference.py`; do not edit by hand
(a test fails when this file is stale). Unknown keys are errors. A recipe may start with
`extends: other.yaml` and be changed on the command line with `--set section.key=value`.
"""


def _section(annotation) -> type[BaseModel] | None:
    """The schema section a field holds (directly, in a list, or optionally)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section(arg)
        if found is not None:
            return found
    return None


def type_text(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_text(a) for a in args)
    if origin in (list, tuple, dict):
        inner = ", ".join("..." if a is Ellipsis else type_text(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def default_text(info) -> str:
    if info.default is PydanticUndefined:
        if info.default_factory is None:
            return "required"
        value = info.default_factory()
        return "see below" if isinstance(value, BaseModel) else f"`{value!r}`"
    if info.default is None:
        return "unset"
    return f"`{info.default!r}`" if not isinstance(info.default, str) else f"`{info.default}`"


def render() -> str:
    lines = [HEADER]
    queue: list[tuple[str, type[BaseModel]]] = [("", Recipe)]
    seen: set[str] = set()
    while queue:
        prefix, model = queue.pop(0)
        if prefix in seen:
            continue
        seen.add(prefix)
        title = prefix or "top level"
        doc = (model.__doc__ or "").strip().splitlines()[0] if model is not Recipe and model.__doc__ else ""
        lines += [f"## {title}", ""]
        if doc and not doc.startswith(("Base for", "A base")):
            lines += [doc, ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for name, info in model.model_fields.items():
            key = f"{prefix}.{name}" if prefix else name
            section = _section(info.annotation)
            if section is not None:
                many = typing.get_origin(info.annotation) is list or any(
                    typing.get_origin(a) is list for a in typing.get_args(info.annotation)
                )
                queue.append((f"{key}[]" if many else key, section))
            description = (info.description or "").replace("|", "\\|")
            lines.append(f"| `{key}` | {type_text(info.annotation)} | {default_text(info)} | {description} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python scripts/recipe_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
