"""Messages that lead somewhere: a peer's key name is pointed at ours (never at a look-alike with
another meaning), and applying every suggested rename gives a recipe that validates."""

from __future__ import annotations

import copy

import pytest

from finetune.errors import RecipeError
from finetune.recipe.aliases import ALIASES
from finetune.recipe.load import load_recipe
from tests.helpers.recipes import tiny_recipe

# a value of the peer's kind for each of our keys, and any context the key needs to be valid
SAMPLE = {
    "train.lr": 1e-4,
    "train.epochs": 2,
    "train.max_steps": 5,
    "train.warmup_steps": 3,
    "train.warmup_ratio": 0.1,
    "train.evals_per_epoch": 2,
    "train.eval_steps": 5,
    "output.saves_per_epoch": 2,
    "output.save_every": 5,
    "output.keep": 3,
    "output.dir": "out",
    "train.micro_batch_size": 2,
    "train.scheduler": "linear",
    "train.weight_decay": 0.01,
    "train.max_grad_norm": 0.5,
    "train.optimizer": "adafactor",
    "train.adam_beta1": 0.8,
    "train.adam_beta2": 0.95,
    "train.adam_epsilon": 1e-6,
    "train.seed": 1,
    "train.logging_steps": 2,
    "train.neftune_noise_alpha": 5,
    "train.early_stopping_patience": 2,
    "train.load_best_model_at_end": True,
    "train.min_lr_ratio": 0.1,
    "train.activation_checkpointing": True,
    "train.precision": True,
    "adapter.r": 8,
    "adapter.alpha": 16,
    "adapter.dropout": 0.05,
    "adapter.target_modules": ["q_proj"],
    "adapter.modules_to_save": ["lm_head"],
    "adapter.loraplus_lr_ratio": 16,
    "adapter.dora": True,
    "adapter.rslora": True,
    "adapter.load_in_8bit": True,
    "adapter.type": True,
    "model.name": "some/model",
    "model.trust_remote_code": True,
    "model.rope_scaling": {"type": "linear", "factor": 2.0},
    "data.max_length": 64,
    "data.packing": True,
    "data.chat_template": "chatml",
    "data.assistant_only_loss": False,
    "data.eval_fraction": 0.1,
    "tokenizer.added_tokens": ["<x>"],
    "hub.repo": "me/model",
    "logging.project": "p",
    "logging.report_to": ["none"],
    "method.beta": 0.2,
    "method.simpo_gamma": 1.0,
    "method.cpo_alpha": 0.5,
    "train.global_batch_size": 8,
    "model.dtype": "float32",
}
CONTEXT = {
    "train.early_stopping_patience": {"train": {"eval_steps": 2}},
    "train.load_best_model_at_end": {"train": {"eval_steps": 2}},
    "train.min_lr_ratio": {"train": {"scheduler": "cosine_with_min_lr"}},
    "adapter.type": {"adapter": {"compute_dtype": "float32", "storage_dtype": "float32"}},
    "tokenizer.added_tokens": {"adapter": {"modules_to_save": ["embed_tokens", "lm_head"]}},
    "train.precision": {"model": {"dtype": "bfloat16"}},
    "data.eval_fraction": {"data": {"eval_sources": []}},
}


def _base(our_key: str) -> dict:
    raw = tiny_recipe(**CONTEXT.get(our_key, {}))
    raw["train"].pop("warmup_ratio")  # so that warmup_steps is not a second setting of the same thing
    if our_key == "train.epochs":
        raw["train"].pop("max_steps")
    return raw


def _put(raw: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _pop(raw: dict, path: str):
    *parents, last = path.split(".")
    node = raw
    for part in parents:
        node = node[part]
    return node.pop(last)


@pytest.mark.parametrize("peer", sorted(ALIASES))
def test_every_peer_name_points_at_ours_and_the_fix_validates(peer):
    alias = ALIASES[peer]
    raw = _base(alias.key)
    _put(raw, peer, copy.deepcopy(SAMPLE[alias.key]))
    with pytest.raises(RecipeError) as info:
        load_recipe(raw)
    err = info.value
    assert alias.key in err.render(), err.render()
    old, new, convert = err.rename
    assert (old, new) == (peer, alias.key)
    value = _pop(raw, old)
    _put(raw, new, convert(value) if convert else value)
    load_recipe(raw)  # the hint fixed it, and nothing else broke


@pytest.mark.parametrize(
    "typo,suggested",
    [
        ("train.warmup_step", "train.warmup_steps"),
        ("data.max_len", "data.max_length"),
        ("adapter.dropuot", "adapter.dropout"),
        ("train.eval_step", "train.eval_steps"),
    ],
)
def test_typos_are_corrected_and_the_fix_validates(typo, suggested):
    raw = _base(suggested)
    _put(raw, typo, SAMPLE[suggested])
    with pytest.raises(RecipeError) as info:
        load_recipe(raw)
    assert f"did you mean {suggested}?" in info.value.render()
    value = _pop(raw, typo)
    _put(raw, suggested, value)
    load_recipe(raw)


@pytest.mark.parametrize("key", ["train.warmup", "train.evals", "adapter.rank_pattern", "train.steps"])
def test_no_look_alike_with_another_meaning_is_proposed(key):
    raw = tiny_recipe()
    _put(raw, key, 1)
    with pytest.raises(RecipeError) as info:
        load_recipe(raw)
    assert "did you mean" not in info.value.render() and "valid keys here" in info.value.render()


@pytest.mark.parametrize(
    "sections",
    [
        {"train": {"early_stopping_patience": 2}, "data": {"eval_sources": []}},
        {"train": {"load_best_model_at_end": True}},
        {"train": {"min_lr": 1e-5}},
    ],
)
def test_conflict_fixes_lead_to_a_valid_recipe(sections):
    """Each cadence conflict's fix, applied as written, validates (no second error)."""
    fixes = {
        "train.early_stopping_patience": {"data": {"eval_fraction": 0.1}, "train": {"evals_per_epoch": 1}},
        "train.load_best_model_at_end": {"train": {"evals_per_epoch": 1}},
        "train.scheduler": {"train": {"scheduler": "cosine_with_min_lr"}},
    }
    from finetune.recipe.load import deep_merge

    raw = tiny_recipe(**sections)
    with pytest.raises(RecipeError) as info:
        load_recipe(raw)
    key = info.value.key
    for path in ("data.eval_fraction: 0.1", "train.evals_per_epoch: 1", "cosine_with_min_lr"):
        if path.split(":")[0].split(".")[-1] in str(fixes[key]):
            assert path in info.value.render(), info.value.render()
    load_recipe(deep_merge(raw, fixes[key]))


@pytest.mark.parametrize("value, ours", [(True, "on"), ("offload", "on"), ("unsloth", "on"), (False, "off")])
def test_every_axolotl_checkpointing_value_keeps_its_meaning(value, ours):
    """axolotl's gradient_checkpointing: offload (or unsloth) checkpoints; the suggested value says so."""
    raw = tiny_recipe()
    raw["gradient_checkpointing"] = value
    with pytest.raises(RecipeError) as info:
        load_recipe(raw)
    _, new, convert = info.value.rename
    assert new == "train.activation_checkpointing" and convert(value) == ours


@pytest.mark.parametrize("size, ours", [(0.05, "data.eval_fraction"), (100, "data.eval_rows")])
def test_a_held_out_size_is_pointed_at_the_key_its_value_means(size, ours):
    """axolotl's val_set_size as datasets' train_test_split reads it: a share below 1, whole rows from 1."""
    raw = tiny_recipe()
    raw["data"]["eval_sources"] = []
    raw["val_set_size"] = size
    with pytest.raises(RecipeError) as info:
        load_recipe(raw)
    assert info.value.rename[1] == ours and ours in info.value.render(), info.value.render()
    _put(raw, ours, _pop(raw, "val_set_size"))
    assert load_recipe(raw).data.eval_rows == (size if ours == "data.eval_rows" else None)
