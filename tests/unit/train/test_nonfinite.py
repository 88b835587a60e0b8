"""NaN/Inf: a non-finite loss or gradient stops the run by default (step and rank named); with
train.on_nonfinite: skip, up to train.max_bad_steps such steps are skipped without touching the
weights, and the run stops at the next one. The NaN comes from real data: the tiny model's embedding
row of one character is NaN, so exactly the batches holding that character go bad."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import TrainerCallback

from finetune.errors import TrainingFailed
from tests.helpers.paths import TINY_MODEL
from tests.helpers.recipes import resolve_recipe, tiny_recipe

pytestmark = pytest.mark.slow
BAD = "~"


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory):
    """A copy of the tiny model whose embedding of BAD is NaN, and 16 examples, 4 of them with BAD."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("nan")
    model_dir = root / "model"
    shutil.copytree(TINY_MODEL, model_dir)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    bad_id = AutoTokenizer.from_pretrained(TINY_MODEL).convert_tokens_to_ids(BAD)
    # untie the output head first (the tiny model ties it to the embedding), so that only inputs
    # holding BAD go non-finite, not every logit
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with torch.no_grad():
        model.get_input_embeddings().weight[bad_id] = float("nan")
    model.save_pretrained(model_dir)
    words = [
        "abc",
        "dog",
        "sun",
        "map",
        "kit",
        "fox",
        "owl",
        "bee",
        "cat",
        "elk",
        "gnu",
        "yak",
        "ram",
        "hen",
        "ant",
        "eel",
    ]
    rows = [
        {
            "messages": [
                {"role": "user", "content": w + (BAD if i % 4 == 1 else "")},
                {"role": "assistant", "content": w.upper()},
            ]
        }
        for i, w in enumerate(words)
    ]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data


def _recipe(model_dir, data, **train):
    return tiny_recipe(
        model={"name": str(model_dir)},
        data={"sources": [{"path": str(data)}], "eval_sources": [], "max_length": 32},
        train={"max_steps": 8, "global_batch_size": 2, "micro_batch_size": 2, "weight_decay": 0.1, **train},
    )


class WeightProbe(TrainerCallback):
    """Records, per optimizer step, whether any trainable weight changed."""

    def __init__(self):
        self.changed: dict[int, bool] = {}
        self._before = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self._before = [p.detach().clone() for p in model.parameters() if p.requires_grad]

    def on_step_end(self, args, state, control, model=None, **kwargs):
        after = [p.detach() for p in model.parameters() if p.requires_grad]
        self.changed[state.global_step] = any(not torch.equal(a, b) for a, b in zip(self._before, after))
        assert all(torch.isfinite(p).all() for p in after), f"non-finite weights after step {state.global_step}"


def test_skip_leaves_weights_untouched_on_bad_steps_only(poisoned, tmp_path):
    from accelerate import PartialState

    from finetune.recipe.load import load_recipe
    from finetune.train.callbacks import NonFiniteCallback
    from finetune.train.model import load_model, load_tokenizer
    from finetune.train.preflight import prepare_data
    from finetune.train.trainers import build_trainer, training_args

    recipe = load_recipe(
        resolve_recipe(_recipe(*poisoned, on_nonfinite="skip", max_bad_steps=8), run_dir=tmp_path / "run"),
        allow_resolved=True,
    )
    tokenizer = load_tokenizer(recipe)
    data = prepare_data(recipe, tokenizer, state=PartialState(cpu=True))
    nonfinite, probe = NonFiniteCallback(policy="skip", max_bad_steps=8), WeightProbe()
    trainer = build_trainer(
        recipe,
        args=training_args(recipe, run_dir=tmp_path / "run", has_eval=False),
        model=load_model(recipe),
        tokenizer=tokenizer,
        data=data,
        callbacks=[nonfinite, probe],
    )
    trainer.train()
    assert trainer.state.global_step == 8
    skipped = set(nonfinite.skipped)
    assert skipped and len(skipped) < 8, skipped  # some batches hold BAD, some do not (seeded order)
    for step, changed in probe.changed.items():
        assert changed == (step not in skipped), (step, changed, sorted(skipped))


def test_skip_stops_after_max_bad_steps(poisoned, tmp_path):
    from finetune.train.run import run_rank

    with pytest.raises(TrainingFailed) as info:
        run_rank(
            resolve_recipe(_recipe(*poisoned, on_nonfinite="skip", max_bad_steps=1), run_dir=tmp_path / "run"),
            resume="never",
        )
    text = info.value.render()
    assert "2 bad step(s)" in text and "max_bad_steps=1" in text and "(rank 0 of 1)" in text, text
    assert "non-finite loss=nan" in text


def test_stop_is_the_default_and_names_the_step(poisoned, tmp_path):
    from finetune.train.run import run_rank

    with pytest.raises(TrainingFailed) as info:
        run_rank(resolve_recipe(_recipe(*poisoned), run_dir=tmp_path / "run"), resume="never")
    text = info.value.render()
    assert "1 bad step(s), policy train.on_nonfinite=stop" in text and "(rank 0 of 1)" in text, text
    assert info.value.exit_code == 4
    # nothing was saved after the bad step: the run stops before the save of that step
    assert not list((tmp_path / "run").glob("checkpoints/checkpoint-*"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_bad_element_anywhere_is_found(bad, dtype):
    from finetune.train.callbacks import all_finite

    grads = [torch.randn(1000, dtype=dtype), torch.randn(64, 64, dtype=dtype)]
    assert all_finite(grads)
    grads[1][17, 5] = bad
    assert not all_finite(grads)


def test_finite_values_whose_sum_overflows_are_finite():
    from finetune.train.callbacks import all_finite

    # the fast path's per-tensor sum overflows to inf; the elements are tested then, and all are finite
    assert all_finite([torch.full((1000,), 3e38), torch.full((8,), 3e38, dtype=torch.bfloat16)])
    assert all_finite([])
