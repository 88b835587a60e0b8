"""`split` with slicing, as the datasets library writes it ("train", "train[:80%]", "train[100:200]",
"train[-10%:]"), applied to local files too (a local file is one split; its name is not checked).
Pure: no heavy imports (the schema validates the syntax).
"""

from __future__ import annotations

import re

_SPLIT = re.compile(r"^(?P<name>[\w.-]+)(?:\[(?P<start>-?\d+%?)?:(?P<stop>-?\d+%?)?\])?$")


def parse_split(text: str) -> tuple[str, str | None, str | None]:
    m = _SPLIT.match(text.strip())
    if not m:
        raise ValueError(
            f"{text!r} is not a split; write NAME or NAME[start:stop] with row numbers or "
            f"percentages, e.g. train[:80%] or train[100:]"
        )
    return m.group("name"), m.group("start"), m.group("stop")


def _index(bound: str | None, n: int, default: int) -> int:
    if bound is None:
        return default
    value = round(n * int(bound[:-1]) / 100) if bound.endswith("%") else int(bound)
    return max(0, min(n, value + n if value < 0 else value))


def slice_rows(rows: list, split: str) -> list:
    """The rows `split`'s slice selects (all of them without a slice)."""
    _, start, stop = parse_split(split)
    if start is None and stop is None:
        return rows
    n = len(rows)
    return rows[_index(start, n, 0) : _index(stop, n, n)]


def has_slice(split: str) -> bool:
    return parse_split(split)[1:] != (None, None)
