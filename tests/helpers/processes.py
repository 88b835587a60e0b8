"""Tiny recipes run through the real CLI in a subprocess, killing
a whole process tree (the CLI, accelerate, torchrun and every rank, which live in sessions of their
own) the way a crashed node does, and reading metrics back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from finetune.rundir import read_metrics
from tests.helpers.paths import ROOT


def cli_argv(recipe: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "finetune.cli", "run", str(recipe), "--output", str(run_dir), *extra]


def env(cache: Path | None = None) -> dict:
    out = dict(os.environ)
    # the repository first, then what the caller's Python already reads (the GPU machine's carried wheels live on
    # PYTHONPATH: replacing it hid them from the child)
    path = os.pathsep.join([str(ROOT), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])])
    out.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=path)
    if cache is not None:
        out["FINETUNE_CACHE_DIR"] = str(cache)
    return out


def start(argv: list[str], *, cache: Path | None = None, extra_env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        argv,
        cwd=ROOT,
        env={**env(cache), **(extra_env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def run(argv: list[str], *, cache: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, env=env(cache), capture_output=True, text=True, timeout=timeout)


def tree(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the CLI and every descendant at once (no handler runs anywhere: a node crash)."""
    procs = tree(proc)
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)
    proc.communicate(timeout=30)


def wait_for(predicate, *, proc: subprocess.Popen, timeout: float = 180, poll: float = 0.002) -> bool:
    """Poll until predicate() is true; False if the process ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return predicate()
        time.sleep(poll)
    raise TimeoutError("the condition never became true")


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r.get("loss") is not None}


def checkpoints(run_dir: Path) -> dict[str, bool]:
    """checkpoint name -> has its commit marker."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return {}
    return {
        p.name: (p / "finetune_complete.json").is_file()
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith("checkpoint-")
    }


HEAVY = ("torch", "transformers", "accelerate", "trl", "peft", "deepspeed")


def heavy_imports(code: str, *, timeout: float = 60) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run `code` in a fresh interpreter at the repository root; return the process and which of HEAVY it
    had imported when the code finished (the parent-process paths must import none of them)."""
    probe = (
        f"{code}\nimport json as _json, sys as _sys\n"
        f"print('heavy:', _json.dumps(sorted(m for m in {HEAVY!r} if m in _sys.modules)), file=_sys.stderr)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout
    )
    reported = [line for line in proc.stderr.splitlines() if line.startswith("heavy: ")]
    assert proc.returncode == 0 and reported, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc, json.loads(reported[-1].removeprefix("heavy: "))
