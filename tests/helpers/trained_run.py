"""One tiny LoRA run trained for real (a subprocess of the per-rank entry point, in its own working
directory), shared by the after-training tests: trackers, cards, loss.png, generate, eval.
Built once per test session (the `trained_run` fixture in tests/conftest.py); tests that change the
run dir copy it first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import QUICKSTART_DATA, ROOT
from tests.helpers.recipes import resolve_recipe, tiny_recipe


def train_tiny_run(root: Path) -> Path:
    """RUN_DIR of an 8-step LoRA SFT on the tiny model, with tensorboard, an eval set, task eval and a
    checkpoint every 4 steps; `root/cwd` is the directory it ran in."""
    run_dir, cwd = root / "run", root / "cwd"
    cwd.mkdir(parents=True)
    recipe = tiny_recipe(
        train={"max_steps": 8, "logging_steps": 1, "eval_steps": 4},
        output={"save_every": 4, "keep": 1},
        logging={"report_to": ["tensorboard"], "run_name": "tiny-after", "loss_log_scale": True},
        data={"task_eval": {"path": str(QUICKSTART_DATA / "eval.jsonl"), "n": 4, "max_new_tokens": 8}})
    resolved = resolve_recipe(recipe, run_dir=run_dir)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
           "FINETUNE_CACHE_DIR": str(root / "cache")}
    env.pop("TENSORBOARD_LOGGING_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "finetune.train", str(resolved), "--resume", "never"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return run_dir
