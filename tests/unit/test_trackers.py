"""Trackers: every tracker's files inside RUN_DIR, the recipe's names reaching each one, a missing
tracker package refused before anything loads; no stray library cards; loss.png."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from finetune.recipe import load_recipe
from finetune.trackers import tracker_env, training_arguments
from tests.helpers.paths import ROOT
from tests.helpers.recipes import tiny_recipe


def _recipe(**logging):
    return load_recipe(tiny_recipe(logging=logging))


def test_each_tracker_gets_the_recipes_names_and_writes_inside_the_run_dir(tmp_path):
    recipe = _recipe(
        report_to=["tensorboard", "wandb", "mlflow", "trackio"],
        project="proj",
        run_name="r1",
        entity="team",
        offline=True,
    )
    env = tracker_env(recipe, tmp_path, {"MLFLOW_TRACKING_URI": "http://mlflow.example"})
    assert env == {
        "TENSORBOARD_LOGGING_DIR": str(tmp_path / "tensorboard"),
        "WANDB_PROJECT": "proj",
        "WANDB_DIR": str(tmp_path),
        "WANDB_ENTITY": "team",
        "WANDB_MODE": "offline",
        "MLFLOW_EXPERIMENT_NAME": "proj",
        "MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(),  # offline wins over the server
        "TRACKIO_DIR": str(tmp_path / "trackio"),
    }
    args = training_arguments(recipe, tmp_path)
    assert args == {
        "report_to": ["tensorboard", "wandb", "mlflow", "trackio"],
        "run_name": "r1",
        "project": "proj",
        "trackio_space_id": None,
    }
    online = _recipe(report_to=["mlflow", "wandb"])
    env = tracker_env(online, tmp_path / "run-7", {"MLFLOW_TRACKING_URI": "http://mlflow.example"})
    assert "MLFLOW_TRACKING_URI" not in env and "WANDB_MODE" not in env  # the user's server is kept
    assert training_arguments(online, tmp_path / "run-7")["run_name"] == "run-7"
    assert training_arguments(_recipe(report_to=["none"]), tmp_path)["report_to"] == "none"


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_missing_tracker_package_is_refused_before_anything_loads(tmp_path):
    recipe = tiny_recipe(logging={"report_to": ["tensorboard", "wandb"]}, data={"allow_paths": [str(ROOT / "data")]})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "finetune.cli", "run", str(path), "-o", str(tmp_path / "run")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "logging.report_to: wandb is not installed" in proc.stderr and "pip install wandb" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was written, nothing was launched


@pytest.fixture(scope="module")
def run_dir(trained_run):
    return trained_run


@pytest.mark.slow
def test_tensorboard_events_in_the_run_dir_and_nothing_in_the_working_dir(run_dir):
    events = list((run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert events, sorted(p.name for p in run_dir.iterdir())
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = set()
    for event_file in events:  # the evaluation before training and the training itself
        acc = EventAccumulator(str(event_file))
        acc.Reload()
        scalars |= set(acc.Tags()["scalars"])
    assert {"train/loss", "eval/loss"} <= scalars
    assert list((run_dir.parent / "cwd").iterdir()) == []  # no ./runs where it was started
    assert not (run_dir / "checkpoints" / "runs").exists()


@pytest.mark.slow
def test_no_stray_library_cards(run_dir):
    assert (run_dir / "adapter_config.json").exists()
    assert not (run_dir / "README.md").exists()  # peft's template card
    assert (run_dir / "checkpoints").is_dir() and not (run_dir / "checkpoints" / "README.md").exists()  # TRL's


@pytest.mark.slow
def test_loss_png_has_title_smoothing_and_log_scale(run_dir, tmp_path):
    from finetune.train.callbacks import ema, loss_figure, plot_loss

    assert (run_dir / "loss.png").stat().st_size > 5000
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"]["transformers"]
    assert ema([4.0, 2.0], 0.5) == [4.0, pytest.approx((0.5 * 2 + 0.25 * 4) / 0.75)]  # bias-corrected
    rows = [{"step": i, "loss": 5.0 / i + (0.5 if i % 2 else -0.5) / i} for i in range(1, 200)]
    import matplotlib.pyplot as plt

    fig = loss_figure(rows, title="tiny · sft lora · r1", log_scale=True, smoothing=0.9)
    ax = fig.axes[0]
    assert ax.get_title() == "tiny · sft lora · r1" and ax.get_yscale() == "log"
    assert [(ln.get_label(), ln.get_alpha()) for ln in ax.get_lines()] == [
        ("train loss (raw)", 0.3),
        ("train loss (EMA 0.9)", None),
    ]
    plt.close(fig)
    plot_loss(rows, tmp_path / "loss.png", smoothing=0)  # no smoothed line, linear axis
    assert Path(tmp_path / "loss.png").stat().st_size > 5000
