"""One tiny LoRA run trained for real through `finetune run` (the CLI, plan, compile, accelerate launch and
TRL, started in a working directory of its own), shared by the tests that only read a finished run: the
CLI end-to-end LoRA case, trackers, cards, loss.png, generate, eval. Built once per test session (the
`trained_cli_run` / `trained_run` fixtures in tests/conftest.py); tests that change the run dir copy it.
Also a finished 2-step run that kept no checkpoint, for the rerun checks (the `two_step_run` fixture)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.helpers.paths import QUICKSTART_DATA, ROOT
from tests.helpers.processes import cli_argv, env, run
from tests.helpers.recipes import tiny_recipe, write_recipe


@dataclass(frozen=True)
class TrainedRun:
    run_dir: Path
    output: str  # what `finetune run` printed (stdout + stderr)


def train_tiny_run(root: Path) -> TrainedRun:
    """An 8-step LoRA SFT on the tiny model with tensorboard, an eval set, task eval and a checkpoint every
    4 steps (keep 1), run from `root/cwd` into `root/run`."""
    run_dir, cwd = root / "run", root / "cwd"
    cwd.mkdir(parents=True)
    recipe = tiny_recipe(
        train={"max_steps": 8, "logging_steps": 1, "eval_steps": 4},
        output={"save_every": 4, "keep": 1},
        logging={"report_to": ["tensorboard"], "run_name": "tiny-after", "loss_log_scale": True},
        data={
            "task_eval": {"path": str(QUICKSTART_DATA / "eval.jsonl"), "n": 4, "max_new_tokens": 8},
            "allow_paths": [str(ROOT / "data")],
        },
    )
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    launch_env = env(root / "cache")
    launch_env.pop("TENSORBOARD_LOGGING_DIR", None)
    proc = subprocess.run(cli_argv(path, run_dir), cwd=cwd, env=launch_env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return TrainedRun(run_dir=run_dir, output=output)


# write_recipe's sections of a 2-step run that keeps no checkpoint: a finished run that cannot be extended
TWO_STEPS_NO_CHECKPOINT = {"train": {"epochs": None, "max_steps": 2}, "output": {"save_every": None}}


def finished_two_step_run(root: Path) -> Path:
    """RUN_DIR of a `finetune run` of write_recipe(**TWO_STEPS_NO_CHECKPOINT) that finished: built once per
    session for the rerun checks, which copy it (shutil.copytree) beside their own copy of the same recipe."""
    recipe = write_recipe(root / "recipe.yaml", **TWO_STEPS_NO_CHECKPOINT)
    done = run(cli_argv(recipe, root / "run"), cache=root / "cache")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root / "run"
