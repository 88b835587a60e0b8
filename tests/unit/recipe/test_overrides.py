"""--set addresses list items (data.sources[0].format) and says what is wrong when it cannot."""

from __future__ import annotations

import pytest

from finetune.errors import RecipeError
from finetune.recipe.load import load_recipe, parse_override
from tests.helpers.recipes import tiny_recipe


def test_parse_override_reads_list_indices():
    assert parse_override("data.sources[0].format=alpaca") == (["data", "sources", 0, "format"], "alpaca")
    assert parse_override("train.lr=0.0002") == (["train", "lr"], 0.0002)


def test_set_changes_one_list_item():
    recipe = load_recipe(
        tiny_recipe(), overrides=["data.sources[0].max_samples=3", "data.eval_sources[0].split=validation"]
    )
    assert recipe.data.sources[0].max_samples == 3 and recipe.data.eval_sources[0].split == "validation"


@pytest.mark.parametrize(
    "text,words",
    [
        ("data.sources[3].format=text", "data.sources has 1 item(s), so [3] does not exist"),
        ("train[0].lr=1", "train is not a list"),
        ("data.sources.format=text", "data.sources is a list; pick an item with [N]"),
        ("data.sources[x].format=text", "is not a key"),
    ],
)
def test_bad_list_addresses_are_explained(text, words):
    with pytest.raises(RecipeError) as info:
        load_recipe(tiny_recipe(), overrides=[text])
    assert words in info.value.render(), info.value.render()


def test_shorthand_source_points_at_the_plain_key():
    raw = tiny_recipe()
    raw["data"] = {"path": raw["data"]["sources"][0]["path"]}
    with pytest.raises(RecipeError) as info:
        load_recipe(raw, overrides=["data.sources[0].format=text"])
    assert "address data.format instead" in info.value.render()
    assert load_recipe(raw, overrides=["data.format=text"]).data.sources[0].format == "text"


def test_set_reaches_into_a_section_written_as_its_type():
    """`adapter: lora` and `method: dpo` are shorthands for `{type: ...}`; --set adapter.r=64 works on them."""
    raw = tiny_recipe()
    raw["adapter"], raw["method"] = "lora", "sft"
    recipe = load_recipe(raw, overrides=["adapter.r=64", "method.beta=0.2", "adapter.dropout=0.1"])
    assert (recipe.adapter.type, recipe.adapter.r, recipe.adapter.dropout) == ("lora", 64, 0.1)
    assert (recipe.method.type, recipe.method.beta) == ("sft", 0.2)
    raw["train"] = {**raw["train"], "lr": 1e-4}
    with pytest.raises(RecipeError, match="train.lr is not a section"):
        load_recipe(raw, overrides=["train.lr.x=1"])
