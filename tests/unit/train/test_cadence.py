"""Cadence by epoch, warmup in steps, cosine_with_min_lr, early stopping and the best checkpoint."""

from __future__ import annotations

import json

import pytest

from finetune.errors import RecipeError
from finetune.recipe.load import load_recipe
from finetune.train.cadence import cadence_args
from tests.helpers.recipes import resolve_recipe, tiny_recipe


def _args(**sections):
    raw = tiny_recipe(**sections)
    if "warmup_steps" in raw["train"]:
        raw["train"].pop("warmup_ratio")
    return cadence_args(load_recipe(raw), has_eval=True)


def test_warmup_steps_and_min_lr_schedule_reach_the_trainer():
    args = _args(train={"warmup_steps": 7, "scheduler": "cosine_with_min_lr", "min_lr": 1e-5})
    assert args["warmup_steps"] == 7 and args["lr_scheduler_kwargs"] == {"min_lr": 1e-5}
    assert _args(train={"scheduler": "cosine_with_min_lr"})["lr_scheduler_kwargs"] == {"min_lr_rate": 0.1}
    assert _args(train={"warmup_ratio": 0.1})["warmup_steps"] == 0.1


def test_epoch_cadence_and_best_model_arguments():
    args = _args(train={"evals_per_epoch": 4, "load_best_model_at_end": True})
    assert args["eval_strategy"] == "steps" and args["save_strategy"] == "steps"
    assert args["metric_for_best_model"] == "eval_loss" and args["greater_is_better"] is False
    assert _args(output={"saves_per_epoch": 2})["save_strategy"] == "steps"
    assert _args()["eval_strategy"] == "no" and _args()["save_strategy"] == "no"


@pytest.mark.parametrize(
    "sections,key",
    [
        ({"train": {"evals_per_epoch": 2, "eval_steps": 5}}, "train.evals_per_epoch"),
        ({"output": {"saves_per_epoch": 2, "save_every": 5}}, "output.saves_per_epoch"),
        ({"train": {"warmup_steps": 5, "warmup_ratio": 0.1}}, "train.warmup_steps"),
        ({"train": {"min_lr": 1e-5}}, "train.scheduler"),
        ({"train": {"scheduler": "cosine_with_min_lr", "min_lr": 1e-5, "min_lr_ratio": 0.1}}, "train.min_lr"),
        ({"train": {"early_stopping_patience": 2}}, "train.early_stopping_patience"),
        ({"train": {"load_best_model_at_end": True}, "data": {"eval_sources": []}}, "train.load_best_model_at_end"),
    ],
)
def test_cadence_conflicts_name_the_key(sections, key):
    with pytest.raises(RecipeError) as info:
        load_recipe(tiny_recipe(**sections))
    assert info.value.render().startswith(key + ":"), info.value.render()


@pytest.mark.slow
def test_evals_per_epoch_early_stopping_and_best_checkpoint(tmp_path):
    from finetune.train.run import run_rank

    # 64 rows at batch 8 = 8 steps per epoch; 2 evals per epoch = every 4 steps; an improvement must
    # beat the threshold, which none does, so patience 1 stops at the second evaluation
    raw = tiny_recipe(
        train={
            "max_steps": 40,
            "evals_per_epoch": 2,
            "early_stopping_patience": 1,
            "early_stopping_threshold": 10.0,
            "load_best_model_at_end": True,
            "warmup_steps": 2,
        },
        output={"keep": 1},
    )
    raw["train"].pop("warmup_ratio")
    summary = run_rank(resolve_recipe(raw, run_dir=tmp_path / "run"), resume="never")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["step"] for r in rows if r.get("eval_loss") is not None and r["step"] > 0]
    assert evals == [4, 8] and summary["steps"] == 8  # stopped early
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("checkpoint-*/trainer_state.json")).read_text())
    assert state["best_model_checkpoint"] and state["best_metric"] == min(
        r["eval_loss"] for r in rows if r.get("eval_loss") is not None and r["step"] > 0
    )


@pytest.mark.parametrize("train", [{"min_lr_ratio": 0.2}, {"min_lr": 1e-5}, {}])
def test_cosine_with_min_lr_builds_transformers_scheduler_and_ends_at_its_floor(train):
    """The kwargs go to transformers' own get_scheduler as the Trainer passes them (lr_scheduler_kwargs): a name it
    does not take (min_lr_ratio for its min_lr_rate) had failed every cosine_with_min_lr run at its first step."""
    import torch
    from transformers import get_scheduler

    args = _args(train={"scheduler": "cosine_with_min_lr", "lr": 1e-4, **train})
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-4)
    schedule = get_scheduler(
        "cosine_with_min_lr",
        optimizer,
        num_warmup_steps=0,
        num_training_steps=10,
        scheduler_specific_kwargs=args["lr_scheduler_kwargs"],
    )
    for _ in range(10):
        optimizer.step()
        schedule.step()
    floor = train.get("min_lr", 1e-4 * train.get("min_lr_ratio", 0.1))
    assert schedule.get_last_lr()[0] == pytest.approx(floor)
