"""Tokenized-data cache: a second run of the same recipe does not tokenize again.

The key covers everything that changes the tokens: the tokenizer (its full serialized
vocabulary/merges, special tokens and chat template), the data (file content hashes, or
Hub id + split + datasets fingerprint), format, column mapping, max_samples, max_length,
method, packing and the loss mask setting. Another tokenizer therefore never reuses an
entry (axolotl #1265). Entries are written to a temporary directory and renamed into
place, so concurrent writers (several nodes on a shared disk) never see half an entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path

# Bump when the tokenization code changes what it writes.
CACHE_FORMAT = 1
STALE_TMP_S = 6 * 3600  # a temporary entry this old belongs to a writer that was killed


def cache_root(cache_dir: str | None) -> Path:
    if cache_dir:
        return Path(os.path.expanduser(cache_dir))
    env = os.environ.get("FINETUNE_CACHE_DIR")
    if env:
        return Path(os.path.expanduser(env))
    return Path.home() / ".cache" / "finetune" / "tokenized"


def tokenizer_fingerprint(tokenizer) -> str:
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:  # slow tokenizers: the vocabulary is what we can see
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(type(tokenizer).__name__.encode())
    digest.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    digest.update(json.dumps(tokenizer.chat_template, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def cache_key(*, tokenizer_fp: str, parts: dict) -> str:
    blob = json.dumps({"format": CACHE_FORMAT, "tokenizer": tokenizer_fp, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def load_entry(root: Path, key: str):
    """The cached DatasetDict for key, or None."""
    entry = root / key
    if not (entry / "finetune_cache.json").exists():
        return None
    import datasets

    try:
        return datasets.load_from_disk(str(entry / "data"))
    except Exception:  # a damaged entry is re-created, not fatal
        return None


def remove_stale_temps(root: Path, *, older_than_s: float = STALE_TMP_S) -> list[Path]:
    """Temporary entries left by a writer that was killed (a live writer renames its own in seconds)."""
    cutoff = time.time() - older_than_s
    stale = []
    for tmp in root.glob(".tmp-*"):
        try:
            if tmp.stat().st_mtime < cutoff:
                shutil.rmtree(tmp, ignore_errors=True)
                stale.append(tmp)
        except OSError:
            continue
    return stale


def save_entry(root: Path, key: str, dataset_dict, meta: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(root)
    if (root / key).exists() and not (root / key / "finetune_cache.json").exists():
        shutil.rmtree(root / key, ignore_errors=True)  # a damaged entry from a killed run
    tmp = root / f".tmp-{key}-{uuid.uuid4().hex[:8]}"
    try:
        dataset_dict.save_to_disk(str(tmp / "data"))
        (tmp / "finetune_cache.json").write_text(json.dumps(meta, indent=2, default=str))
    except BaseException:  # interrupted or out of space: leave no half-written entry behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.rename(tmp, root / key)
    except OSError:  # another process won the race; its entry is identical
        shutil.rmtree(tmp, ignore_errors=True)
