"""Read data sources (local jsonl/json/parquet/csv or a Hub dataset) into converted records.

Each record keeps where it came from (`_file`, `_row`, 1-based) so that every later check
(preflight, length limits) can name the file and row. jsonl is read line by line here, not
by `datasets`, because its loader reports a broken line without its number.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from finetune.data.formats import convert_row
from finetune.data.splits import has_slice, slice_rows
from finetune.errors import DataError
from finetune.recipe.paths import anchored
from finetune.recipe.schema import DataSource

LOCAL_SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
PREVIEW_ROWS = 1000  # rows of a streamed source checked before launch


@dataclass
class LoadedSource:
    name: str  # absolute file path or Hub id, for messages
    records: list[dict]  # converted rows with _file and _row
    fingerprint: str  # content hash (local) or Hub id + split + datasets fingerprint


def resolve_path(path: str, base_dir: Path) -> Path | None:
    """The local file a source names, or None for a Hub dataset id."""
    candidate = anchored(path, base_dir)
    if candidate.is_dir() and candidate.suffix in LOCAL_SUFFIXES:
        raise DataError(
            "is a directory, not a data file",
            file=str(candidate),
            hint="point the data path at the file itself (a .jsonl/.json/.parquet/.csv file)",
        )
    if candidate.exists() and not candidate.is_file() and not candidate.is_dir():
        raise DataError(
            "is not a regular file (a pipe, socket or device would block or never end)",
            file=str(candidate),
            hint="point the data path at a .jsonl/.json/.parquet/.csv file",
        )
    if candidate.exists():
        return candidate.resolve()
    if candidate.suffix in LOCAL_SUFFIXES or path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise DataError(
            "file not found",
            file=str(candidate),
            hint="relative data paths are read from the recipe's directory; check the path",
        )
    return None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _decode(raw: bytes, *, path: Path, row: int, what: str = "row") -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{what} {row}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1})",
            file=str(path),
            hint="re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or delete that row",
        ) from None


def _parse(text: str, *, path: Path, row: int, what: str = "row"):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{what} {exc.lineno if what == 'line' else row}: not valid JSON ({exc.msg} at column {exc.colno})",
            file=str(path),
            hint="fix or delete that line; each line must be one JSON object",
        ) from None
    except RecursionError:
        raise DataError(
            f"{what} {row}: JSON nested too deeply to read",
            file=str(path),
            hint="flatten that row (a training example is a few levels deep), or delete it",
        ) from None


def _read_jsonl(path: Path):
    with path.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            line = _decode(raw, path=path, row=line_no)
            if not line.strip():
                continue
            yield line_no, _parse(line, path=path, row=line_no)


def _read_json(path: Path):
    data = _parse(_decode(path.read_bytes(), path=path, row=1, what="line"), path=path, row=1, what="line")
    if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
        data = next(iter(data.values()))  # {"data": [...]} wrappers
    if not isinstance(data, list):
        raise DataError(
            "a .json data file must hold a list of objects",
            file=str(path),
            hint="or write one object per line as .jsonl",
        )
    yield from enumerate(data, start=1)


def _read_tabular(path: Path, kind: str, *, streaming: bool = False):
    import datasets

    try:
        ds = datasets.load_dataset(kind, data_files=str(path), split="train", streaming=streaming)
    except Exception as exc:  # a corrupt parquet file, a CSV with an unterminated quote: the file's fault
        cause = exc.__cause__ or exc
        detail = " ".join(str(cause).split())[:300] or type(cause).__name__
        raise DataError(
            f"cannot read this {kind} file: {detail}",
            file=str(path),
            hint=f"check the file is complete and valid {kind} (re-export it), or convert it to .jsonl",
        ) from None
    # csv rows are numbered as lines of the file (the header is line 1)
    offset = 2 if kind == "csv" else 1
    for i, row in enumerate(ds):
        yield i + offset, row


def _read_hub(source: DataSource):
    import datasets

    try:
        # a streamed source is only previewed here (load_source stops after PREVIEW_ROWS)
        ds = datasets.load_dataset(source.path, name=source.subset, split=source.split, streaming=source.streaming)
    except Exception as exc:  # network, missing split, gated repo: all user-fixable
        offline = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("HF_DATASETS_OFFLINE")
        hint = (
            "this machine is offline (HF_HUB_OFFLINE); use a local file"
            if offline
            else "check the dataset id, data.sources[].split / subset, and your Hub login"
        )
        raise DataError(f"cannot load Hub dataset: {exc}", file=source.path, hint=hint) from None
    return getattr(ds, "_fingerprint", None), enumerate(ds, start=1)


def load_source(source: DataSource, *, base_dir: Path) -> LoadedSource:
    path = resolve_path(source.path, base_dir)
    if path is None:
        fingerprint, rows = _read_hub(source)
        name, fingerprint = source.path, f"hub:{source.path}:{source.subset}:{source.split}:{fingerprint}"
    else:
        kind = LOCAL_SUFFIXES.get(path.suffix)
        if kind is None:
            raise DataError(
                f"unsupported file type {path.suffix!r}", file=str(path), hint="use .jsonl, .json, .parquet or .csv"
            )
        if path.stat().st_size == 0:
            raise DataError("the file is empty", file=str(path), hint="point data at a file with examples")
        name, fingerprint = str(path), file_sha256(path)
        rows = {"jsonl": _read_jsonl, "json": _read_json}.get(
            kind, lambda p: _read_tabular(p, kind, streaming=source.streaming)
        )(path)
        if has_slice(source.split):  # "train[:80%]": the file is the one split, sliced as datasets would
            rows = slice_rows(list(rows), source.split)
    records = []
    limit = source.max_samples
    if source.streaming:  # the rows checked before launch; training reads the rest lazily
        limit = min(limit or PREVIEW_ROWS, PREVIEW_ROWS)
    for row, raw in rows:
        record = convert_row(raw, fmt=source.format, columns=source.columns, file=name, row=row)
        record["_file"], record["_row"] = name, row
        records.append(record)
        if limit and len(records) >= limit:
            break
    if not records:
        raise DataError("no examples in the file", file=name, hint="point data at a file with examples")
    return LoadedSource(name=name, records=records, fingerprint=fingerprint)
