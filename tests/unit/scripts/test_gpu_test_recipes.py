"""The GPU tests build their recipe with scripts/gpu_validate.py's helpers, which CPU CI never runs: here the same
builder makes the recipe with the shipped tiny-llama, and it must load as a recipe (a changed helper signature
had broken the OOM re-plan and `plan --measure` GPU tests unseen)."""

from __future__ import annotations

from finetune.recipe import load_recipe
from tests.gpu.test_gpu import lora_recipe


def test_the_gpu_tests_lora_recipe_builds_and_loads(tmp_path):
    recipe = load_recipe(lora_recipe(tmp_path, steps=3, arch="tiny-llama"))
    assert recipe.adapter.type == "lora" and recipe.train.max_steps == 3 and recipe.train.global_batch_size == 32
    assert (tmp_path / "data.jsonl").stat().st_size > 0
