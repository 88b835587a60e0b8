"""Experiment trackers: what the recipe's `logging:` section means for each one. Torch-free.

transformers' integration callbacks do the logging; this module only configures them, through
TrainingArguments (report_to, run_name, project) and the environment variables each tracker documents
(set in the training rank, never in the launching process):

    tensorboard  TENSORBOARD_LOGGING_DIR = RUN_DIR/tensorboard (without it the first writer, created by
                 the evaluation before training, lands in ./runs of the current directory)
    wandb        WANDB_PROJECT, WANDB_ENTITY, WANDB_DIR = RUN_DIR, WANDB_MODE=offline when logging.offline
    mlflow       MLFLOW_EXPERIMENT_NAME; MLFLOW_TRACKING_URI = RUN_DIR/mlruns unless the user set a
                 tracking server (and always when logging.offline)
    trackio      TRACKIO_DIR = RUN_DIR/trackio; project and run name through TrainingArguments; a local
                 store only (no Space) when logging.offline

`check_trackers` runs before anything is loaded: a tracker whose package is missing is a RecipeError
(exit 2) naming the key and the pip command, instead of a traceback after the model has loaded.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from finetune import rundir
from finetune.errors import RecipeError

# report_to name -> (module to import, pip package)
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}
DEFAULT_PROJECT = "finetune"


def enabled(recipe) -> list[str]:
    return [name for name in recipe.logging.report_to if name != "none"]


def run_name(recipe, run_dir: Path) -> str:
    return recipe.logging.run_name or Path(run_dir).name


def check_trackers(recipe) -> None:
    """Every tracker in logging.report_to is importable; RecipeError (exit 2) otherwise."""
    missing = [name for name in enabled(recipe) if importlib.util.find_spec(PACKAGES[name][0]) is None]
    if missing:
        pkgs = " ".join(PACKAGES[name][1] for name in missing)
        raise RecipeError(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed",
            key="logging.report_to",
            hint=f"pip install {pkgs}, or remove {', '.join(missing)} from logging.report_to "
            "(tensorboard comes with the train extra; [none] logs nowhere)",
        )


def tracker_env(recipe, run_dir: Path, environ: dict[str, str]) -> dict[str, str]:
    """The environment variables to set in the rank for the recipe's trackers (given the current
    `environ`, so a user's own tracking server is kept unless logging.offline)."""
    log, run_dir, on = recipe.logging, Path(run_dir), set(enabled(recipe))
    project = log.project or DEFAULT_PROJECT
    env: dict[str, str] = {}
    if "tensorboard" in on:
        env["TENSORBOARD_LOGGING_DIR"] = str(run_dir / rundir.TENSORBOARD_DIR)
    if "wandb" in on:
        env.update(WANDB_PROJECT=project, WANDB_DIR=str(run_dir))
        if log.entity:
            env["WANDB_ENTITY"] = log.entity
        if log.offline:
            env["WANDB_MODE"] = "offline"
    if "mlflow" in on:
        env["MLFLOW_EXPERIMENT_NAME"] = project
        if log.offline or not environ.get("MLFLOW_TRACKING_URI"):
            env["MLFLOW_TRACKING_URI"] = (run_dir / rundir.MLFLOW_DIR).as_uri()
    if "trackio" in on:
        env["TRACKIO_DIR"] = str(run_dir / rundir.TRACKIO_DIR)
    return env


def training_arguments(recipe, run_dir: Path) -> dict:
    """report_to, run_name, project (and the trackio Space) for TrainingArguments."""
    args = {
        "report_to": enabled(recipe) or "none",
        "run_name": run_name(recipe, run_dir),
        "project": recipe.logging.project or DEFAULT_PROJECT,
    }
    if recipe.logging.offline and "trackio" in enabled(recipe):
        args["trackio_space_id"] = None  # local store only
    return args


def apply_tracker_env(recipe, run_dir: Path) -> dict[str, str]:
    """Set tracker_env in this process (a training rank); returns what was set."""
    import os

    env = tracker_env(recipe, run_dir, dict(os.environ))
    os.environ.update(env)
    return env
