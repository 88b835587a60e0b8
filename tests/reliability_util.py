"""Helpers for the reliability tests: tiny recipes run through the real CLI in a subprocess, killing
a whole process tree (the CLI, accelerate, torchrun and every rank, which live in sessions of their
own) the way a crashed node does, and reading metrics back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

from finetune.rundir import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "data" / "tiny-llama"
TRAIN = ROOT / "data" / "quickstart" / "train.jsonl"


def write_recipe(path: Path, **sections) -> Path:
    """32 examples, batch 8 -> 4 optimizer steps per epoch; LoRA on the tiny Llama; no eval."""
    recipe = {
        "model": {"name": str(TINY), "dtype": "float32"},
        "adapter": {"type": "lora", "r": 8, "alpha": 16},
        "data": {"sources": [{"path": str(TRAIN), "max_samples": 32}], "max_length": 32},
        "train": {"epochs": 3, "lr": 3e-3, "global_batch_size": 8, "micro_batch_size": 8, "precision": "fp32",
                  "warmup_ratio": 0.0, "scheduler": "linear", "seed": 7},
        "output": {"save_every": 3, "keep": 2},
        "hardware": "cpu",
        "logging": {"report_to": ["none"]},
    }
    for key, value in sections.items():
        recipe[key] = {**recipe.get(key, {}), **value} if isinstance(value, dict) else value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe))
    return path


def cpu_preset(path: Path, *, procs: int) -> Path:
    path.write_text(yaml.safe_dump({
        "name": f"cpu-x{procs}", "description": "test: CPU processes on gloo", "gpu_model": "cpu",
        "vendor": "cpu", "gpu_memory_gib": 8, "gpus_per_node": procs, "nodes": 1, "intra_node_link": "none",
        "intra_node_bandwidth_gbps": 10, "inter_node_fabric": "none", "inter_node_bandwidth_gbps": 0,
        "host_ram_gib": 16, "peak_bf16_tflops": 1.0, "host_to_device_bandwidth_gbps": 10}))
    return path


def cli_argv(recipe: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "finetune.cli", "run", str(recipe), "--output", str(run_dir), *extra]


def env(cache: Path | None = None) -> dict:
    out = dict(os.environ)
    out.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT))
    if cache is not None:
        out["FINETUNE_CACHE_DIR"] = str(cache)
    return out


def start(argv: list[str], *, cache: Path | None = None, extra_env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=ROOT, env={**env(cache), **(extra_env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


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
    return {p.name: (p / "finetune_complete.json").is_file() for p in root.iterdir()
            if p.is_dir() and p.name.startswith("checkpoint-")}
