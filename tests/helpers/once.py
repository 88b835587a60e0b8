"""Build a session fixture's runs once per test session, also when pytest-xdist splits the session among
workers (scripts/test.sh runs two): each worker has a session of its own, so a plain session fixture would
train the same run on each. The first worker to ask builds under the directory the workers' temporary
directories share (pytest-xdist's documented recipe, with a file lock); the others wait for it and read the
result. Every reader only reads what was built, or copies it to change it."""

from __future__ import annotations

import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from filelock import FileLock

T = TypeVar("T")


def once_per_session(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], T]) -> T:
    """build(root) in an empty `root` the first time any worker of this session asks for `name`; the
    value it returns (picklable: paths, dataclasses of them) for every later ask."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # popen-gw0, popen-gw1, ... are folders of this session's base
    root = base / f"once-{name}"
    with FileLock(f"{root}.lock"):
        result = root / "result.pickle"
        if result.is_file():
            return pickle.loads(result.read_bytes())
        if root.exists():  # a build that failed in another worker: build again, to fail here with its output
            shutil.rmtree(root)
        root.mkdir()
        value = build(root)
        result.write_bytes(pickle.dumps(value))
        return value
