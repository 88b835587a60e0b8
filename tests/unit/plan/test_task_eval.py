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


def test_what_would_fit_leaves_out_what_the_task_eval_would_not_fit():
    """70B LoRA pinned to ddp on two 24 GB cards fits nowhere it could be suggested but eight 178-192 GB cards; with
    a task eval those are not suggested either (its 131 GiB copy beside the replicated trainer does not fit them),
    so every suggestion, applied, plans without the task eval's refusal."""
    from tests.helpers.recipes import shape_recipe

    def suggested(**kw) -> list[str]:
        recipe = shape_recipe(
            "meta-llama/Llama-3.1-70B", "lora", "workstation-2x4090", global_batch=8, train__liger="off", **kw
        )
        p = plan(recipe)
        assert not p.fits
        hardware = [s.split()[1] for s in p.suggestions if s.startswith("hardware: ")]
        for name in hardware:
            assert plan(recipe, hardware=name).fits
        return hardware

    assert suggested(distributed__strategy="ddp") == ["server-8xb200", "server-8xmi300x"]
    assert suggested(distributed__strategy="ddp", data__task_eval=TASK_EVAL) == []


def test_a_pinned_strategys_alternatives_leave_out_what_the_task_eval_would_not_fit():
    """Qwen3-32B LoRA pinned to fsdp2 does not fit one 32 GB card; the offload tiers would hold the training, but
    not the task eval's 61 GiB copy of the model beside it, so with a task eval none is offered."""
    from tests.helpers.recipes import shape_recipe

    def offered(**kw) -> list[str]:
        recipe = shape_recipe(
            "Qwen/Qwen3-32B", "lora", "workstation-1x5090", seq=512, global_batch=8, train__liger="off", **kw
        )
        p = plan(recipe, hardware=None)
        assert not p.fits
        return [s.split()[1] for s in p.suggestions if s.startswith("distributed.strategy: ")]

    assert offered(distributed__strategy="fsdp2") == ["fsdp2-offload", "zero3-offload"]
    assert offered(distributed__strategy="fsdp2", data__task_eval=TASK_EVAL) == []
