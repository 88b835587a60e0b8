"""data.task_eval generates with a whole second copy of the model on one GPU next to the trainer's state: a
recipe where that copy cannot fit is refused by the planner, naming the key, before anything loads."""

from __future__ import annotations

import pytest

from finetune.errors import RecipeError
from finetune.plan import plan
from finetune.recipe import load_recipe
from tests.helpers.paths import ROOT

TASK_EVAL = {"path": "eval.jsonl", "n": 10}


def _recipe(name: str, **data) -> dict:
    raw = load_recipe(ROOT / "recipes" / name).model_dump(mode="json")
    raw["data"].update(data)
    raw["train"]["liger"] = "off"  # liger auto plans differ by whether liger-kernel is installed here
    raw["hardware"] = "server-8xh100"
    return raw


def test_a_70b_copy_for_the_task_eval_is_refused_on_80gb_cards():
    assert plan(load_recipe(_recipe("llama70b-lora.yaml"))).fits  # training alone fits
    with pytest.raises(RecipeError) as caught:
        plan(load_recipe(_recipe("llama70b-lora.yaml", task_eval=TASK_EVAL)))
    err = caught.value
    assert err.key == "data.task_eval" and "whole copy of the model on one GPU (132.2 GiB)" in err.message
    assert "remove data.task_eval" in err.hint


def test_an_8b_copy_for_the_task_eval_fits_beside_the_trainer():
    assert plan(load_recipe(_recipe("llama8b-lora.yaml", task_eval=TASK_EVAL))).fits
