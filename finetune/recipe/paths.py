"""Where a recipe may read data from.

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
from pathlib import Path

from finetune.errors import DataError

PROJECT_MARKERS = (".git", "pyproject.toml")


def project_root(start: Path) -> Path | None:
    for parent in (start, *start.parents):
        if any((parent / m).exists() for m in PROJECT_MARKERS):
            return parent
    return None


def allowed_roots(base_dir: Path, allow_paths: list[str] = (), *, cwd: Path | None = None) -> list[Path]:
    base = Path(base_dir).resolve()
    here = Path(cwd or os.getcwd()).resolve()
    # the current directory counts, unless it is the filesystem root (from `/` it would allow everything)
    roots = [base] + ([here] if here != Path(here.anchor) else [])
    project = project_root(base)
    if project is not None:
        roots.append(project)
    for extra in allow_paths:
        path = Path(os.path.expanduser(extra))
        roots.append((path if path.is_absolute() else base / path).resolve())
    return roots


def check_data_path(path: Path, *, key: str, base_dir: Path, allow_paths: list[str] = (),
                    allow_outside: bool = False, cwd: Path | None = None) -> Path:
    """The resolved path, or DataError when it leaves every allowed root."""
    raw = Path(path)
    real = raw.resolve()  # follows every symlink, collapses ..
    if allow_outside:
        return real
    roots = allowed_roots(base_dir, allow_paths, cwd=cwd)
    if any(real == root or real.is_relative_to(root) for root in roots):
        return real
    via = " through a symlink" if raw.is_symlink() or any(p.is_symlink() for p in raw.parents) else ""
    raise DataError(f"reads {real}{via}, outside the recipe's directory, its project and the current "
                    f"directory", file=str(raw), key=key,
                    hint="move the data next to the recipe, list its directory in data.allow_paths, or set "
                         "data.allow_outside: true if you trust this recipe")
