"""What the planner and compile resolve for speed: the attention kernel, Liger, YAML on/off switches."""

from __future__ import annotations

import pytest

from finetune.errors import RecipeError
from finetune.plan import attention_implementation, attention_kind, liger_enabled
from finetune.recipe import load_recipe
from finetune.registry import get_preset


def _recipe(**over):
    raw = {"model": {"name": "llama-3.1-8b", "arch": "llama-3.1-8b"}, "data": {"path": "train.jsonl", "packing": True}}
    for section, values in over.items():
        raw[section] = {**raw.get(section, {}), **values}
    return load_recipe(raw)


def test_auto_attention_is_varlen_only_for_packed_sft_on_nvidia():
    gpu, cpu = get_preset("server-8xh100"), get_preset("cpu")
    assert attention_implementation(_recipe(), gpu) == "varlen"
    assert attention_implementation(_recipe(), cpu) == "sdpa"
    assert attention_implementation(_recipe(data={"packing": False}), gpu) == "sdpa"
    dpo = _recipe(method={"type": "dpo"}, data={"packing": False, "format": "preference"})
    assert attention_implementation(dpo, gpu) == "sdpa"
    assert attention_implementation(_recipe(model={"attn_implementation": "eager"}), gpu) == "eager"


def test_varlen_without_packing_is_planned_as_sdpa():
    assert attention_kind("varlen", packed=True) == "varlen"
    assert attention_kind("varlen", packed=False) == "sdpa"
    assert attention_kind("flash_attention_2", packed=False) == "flash"


def test_liger_switch():
    gpu, cpu = get_preset("server-8xh100"), get_preset("cpu")
    assert liger_enabled(_recipe(train={"liger": "on"}), gpu) is True
    assert liger_enabled(_recipe(train={"liger": "off"}), gpu) is False
    assert liger_enabled(_recipe(), cpu) is False
    with pytest.raises(RecipeError) as err:
        liger_enabled(_recipe(train={"liger": "on"}), cpu)
    assert err.value.key == "train.liger"


def test_yaml_bare_on_off_mean_the_words(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        "model: {name: llama-3.1-8b}\ndata: {path: t.jsonl}\ntrain: {activation_checkpointing: off, liger: on}\n"
    )
    recipe = load_recipe(path)
    assert (recipe.train.activation_checkpointing, recipe.train.liger) == ("off", "on")
