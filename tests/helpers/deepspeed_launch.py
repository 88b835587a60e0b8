"""Launch one DeepSpeed rank of a test module the way `finetune run` launches its ranks: the recipe compiled for a
GPU preset (so the strategy is DeepSpeed's) on this machine, the module run through the compiled launch argv and
environment (DeepSpeed's CPU accelerator on a machine without CUDA: finetune/train/notices.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.helpers.paths import ROOT

# a one-GPU preset: DeepSpeed's strategies compile for it; the rank runs where the test runs
DEEPSPEED_PRESET = "workstation-1x4090"


def launch_rank(
    raw: dict, run_dir: Path, *, module: str | None = None, extra=()
) -> tuple[subprocess.CompletedProcess, str]:
    """Compile `raw` (a recipe dict) into `run_dir` and run its entry point (`module`, default finetune's rank
    entry) with `extra` arguments; the finished process and the tail of its output."""
    from finetune.compile.compiler import ENTRY_MODULE, prepare_recipe
    from finetune.launch import executable_argv, launch_env
    from finetune.recipe.load import load_recipe

    compiled = prepare_recipe(
        load_recipe(raw), run_dir=run_dir, hardware=DEEPSPEED_PRESET, module=module or ENTRY_MODULE
    )
    spec = compiled.write()
    done = subprocess.run(
        executable_argv(spec.argv(extra_args=list(extra))),
        env={**launch_env(spec), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done, done.stdout[-4000:] + done.stderr[-4000:]
