"""Data checks that run in the `finetune` process before anything is written or launched.

Every local data file is path-checked (finetune/recipe/paths.py) and read row by row through the
same reader the ranks use (bad JSON, missing columns, wrong roles, empty files name file and row),
so bad input fails with exit 2 and one message, and leaves no run directory behind. Checks that
need the tokenizer (chat template, lengths) stay in the ranks' preflight. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from finetune.data.chat_template import read_chat_template
from finetune.data.lengths import LengthSample
from finetune.data.sources import load_source, resolve_path
from finetune.errors import DataError
from finetune.recipe.load import recipe_dir
from finetune.recipe.paths import anchored, check_data_path, is_inline_template
from finetune.recipe.schema import Recipe


@dataclass
class DataCheck:
    """What the pre-launch read of the local data found (Hub sources are read by the ranks)."""

    train: list[str | None] = field(default_factory=list)  # content fingerprints, per source (None: Hub)
    eval: list[str | None] = field(default_factory=list)
    rows: int | None = None  # local training rows, None when a training source is on the Hub
    first: dict | None = None  # the first converted training record (for a chat-template render check)
    sample: LengthSample = field(default_factory=LengthSample)  # local training records to measure (lengths)


def named_sources(recipe: Recipe) -> list[tuple[str, Any, str | None]]:
    """(recipe key, source, "train" / "eval" / None for the task eval) for every data source of the recipe."""
    d = recipe.data
    named: list[tuple[str, Any, str | None]] = [(f"data.sources[{i}]", s, "train") for i, s in enumerate(d.sources)]
    named += [(f"data.eval_sources[{i}]", s, "eval") for i, s in enumerate(d.eval_sources)]
    if d.task_eval is not None:
        named.append(("data.task_eval", d.task_eval, None))
    return named


def unreadable_sources(recipe: Recipe) -> list[str]:
    """'KEY (PATH): why' for each local data file of the recipe that `finetune run` would refuse to read (missing, a
    directory...): `finetune plan` plans without reading data, and says so."""
    out, base = [], recipe_dir(recipe)
    for key, source, _ in named_sources(recipe):
        try:
            resolve_path(source.path, base)
        except DataError as err:
            out.append(f"{key} ({err.file}): {err.message}")
    return out


def check_data(recipe: Recipe) -> DataCheck:
    d, base = recipe.data, recipe_dir(recipe)
    guard: dict[str, Any] = dict(base_dir=base, allow_paths=d.allow_paths, allow_outside=d.allow_outside)
    out = DataCheck(rows=0)
    for section, source, split in named_sources(recipe):
        key = f"{section}.path"
        if resolve_path(source.path, base) is None:  # a Hub dataset id (a missing local file raises)
            if split == "train":
                out.rows = None
            if split:
                getattr(out, split).append(None)
            continue
        check_data_path(anchored(source.path, base), key=key, **guard)
        loaded = load_source(source, base_dir=base)
        if split:
            getattr(out, split).append(loaded.fingerprint)
        if split == "train":
            out.first = out.first or (loaded.records[0] if loaded.records else None)
            out.sample.add(loaded.records)
            if out.rows is not None:
                out.rows += len(loaded.records)
    template = d.chat_template
    if template and not is_inline_template(template) and anchored(template, base).exists():
        check_data_path(anchored(template, base), key="data.chat_template", **guard)
    read_chat_template(recipe)  # jinja text, a file or a shipped template's name; RecipeError otherwise
    _check_batch(recipe, out.rows)
    if out.rows is not None and not any(s.streaming for s in d.sources):  # a stream's rows are a preview
        check_eval_split(recipe, out.rows, file=d.sources[0].path)
    return out


def eval_split(recipe: Recipe) -> tuple[str, float | int] | None:
    """(recipe key, datasets' train_test_split test_size: a share or a count of rows) of the eval set split off the
    training rows, or None when the recipe splits none (no data.eval_fraction / eval_rows, or data.eval_sources)."""
    d = recipe.data
    if d.eval_sources:
        return None
    if d.eval_fraction:
        return "data.eval_fraction", d.eval_fraction
    return ("data.eval_rows", d.eval_rows) if d.eval_rows else None


def check_eval_split(recipe: Recipe, rows: int, *, file: str | None) -> None:
    """data.eval_fraction / data.eval_rows split off the training rows (datasets' train_test_split: a share, or a
    count): refused where `rows` cannot give one eval row and keep one to train on. Checked before launch on the
    local rows read, and by the rank on the rows tokenized (long ones dropped)."""
    split = eval_split(recipe)
    if split is None:
        return
    key, size = split
    if rows < 2 or (isinstance(size, int) and size >= rows):
        raise DataError(
            f"too few examples to split off an eval set: {rows} training rows"
            + (f", {size} asked for the eval set" if isinstance(size, int) else ""),
            file=file,
            key=key,
            hint=f"add examples or lower (or remove) {key}",
        )


def _check_batch(recipe: Recipe, rows: int | None) -> None:
    gbs = recipe.train.global_batch_size
    if rows and gbs > rows:
        raise DataError(
            f"one optimizer step takes {gbs} examples, and the training data has {rows}: every "
            f"step would repeat the whole data set ({gbs / rows:.1f}x)",
            key="train.global_batch_size",
            hint=f"set train.global_batch_size to at most {rows} (or add data)",
        )
