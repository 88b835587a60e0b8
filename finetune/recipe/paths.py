"""Paths a recipe names: where they are anchored, and where a recipe may read data from.

A relative path in a recipe (model.name, data paths, a chat template file, a hardware preset file) is
read from the recipe's folder: `anchored(value, base)` is the one place that says so. `model_path` says
whether model.name is a local directory or a Hub id.

A data path (data.sources[].path, data.eval_sources[].path, data.task_eval.path, a data.chat_template
file) must, after `..` and every symlink are resolved, lie inside one of: the recipe's directory,
its project root (the nearest directory above it holding .git or pyproject.toml), the current
directory (unless that is `/`), or a directory listed in data.allow_paths. data.allow_outside: true turns the check off.
This stops a recipe from someone else from reading ~/.ssh/id_rsa or /etc/shadow into a training set
(and from there into a pushed model). Hub dataset ids are not paths and are not affected.

Pure: no heavy imports.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from finetune.errors import DataError
from finetune.recipe.load import recipe_dir

PROJECT_MARKERS = (".git", "pyproject.toml")
JINJA_DELIMITERS = ("{{", "{%", "{#")


def anchored(value: str | Path, base: str | Path) -> Path:
    """`value` with ~ expanded; a relative path is taken relative to `base` (the recipe's folder).
    Nothing is checked or resolved: callers decide whether it must exist."""
    path = Path(os.path.expanduser(str(value)))
    return path if path.is_absolute() else Path(base) / path


def is_inline_template(value: str) -> bool:
    """data.chat_template is jinja text when it holds a jinja delimiter or a line break; anything
    else is the path of a template file."""
    return "\n" in value or any(d in value for d in JINJA_DELIMITERS)


def model_path(recipe) -> str:
    """model.name as a Hub id, or a local directory (relative ones are read from the recipe's dir)."""
    name = recipe.model.name
    local = anchored(name, recipe_dir(recipe))
    if local.is_dir():
        return str(local.resolve())
    if Path(name).expanduser().is_dir() or name.startswith((".", "/", "~")):
        return str(Path(name).expanduser().resolve())
    return name


def project_root(start: Path) -> Path | None:
    for parent in (start, *start.parents):
        if any((parent / m).exists() for m in PROJECT_MARKERS):
            return parent
    return None


def allowed_roots(base_dir: Path, allow_paths: Sequence[str] = (), *, cwd: Path | None = None) -> list[Path]:
    base = Path(base_dir).resolve()
    here = Path(cwd or os.getcwd()).resolve()
    # the current directory counts, unless it is the filesystem root (from `/` it would allow everything)
    roots = [base] + ([here] if here != Path(here.anchor) else [])
    project = project_root(base)
    if project is not None:
        roots.append(project)
    for extra in allow_paths:
        roots.append(anchored(extra, base).resolve())
    return roots


def check_data_path(
    path: Path,
    *,
    key: str,
    base_dir: Path,
    allow_paths: Sequence[str] = (),
    allow_outside: bool = False,
    cwd: Path | None = None,
) -> Path:
    """The resolved path, or DataError when it leaves every allowed root."""
    raw = Path(path)
    real = raw.resolve()  # follows every symlink, collapses ..
    if allow_outside:
        return real
    roots = allowed_roots(base_dir, allow_paths, cwd=cwd)
    if any(real == root or real.is_relative_to(root) for root in roots):
        return real
    via = " through a symlink" if raw.is_symlink() or any(p.is_symlink() for p in raw.parents) else ""
    raise DataError(
        f"reads {real}{via}, outside the recipe's directory, its project and the current directory",
        file=str(raw),
        key=key,
        hint="move the data next to the recipe, list its directory in data.allow_paths, or set "
        "data.allow_outside: true if you trust this recipe",
    )
