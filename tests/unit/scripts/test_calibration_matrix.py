"""Every run of scripts/calibration_matrix.yaml is a recipe that validates, before a GPU session spends its
time finding a typo: the recipe scripts/gpu_validate.py builds for it (run_recipe), on the tiny model."""

from __future__ import annotations

import sys

import pytest

from finetune.recipe import load_recipe
from tests.helpers.paths import QUICKSTART_DATA, ROOT, TINY_MODEL

sys.path.insert(0, str(ROOT / "scripts"))
from gpu_validate import load_matrix, run_recipe  # noqa: E402

MATRIX = load_matrix(ROOT / "scripts" / "calibration_matrix.yaml")


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_matrix_run_is_a_valid_recipe(name):
    entry = MATRIX[name]
    data = QUICKSTART_DATA / "train.jsonl"
    steps, seq, batch = entry["steps"], entry["seq"], entry["batch"]
    raw = run_recipe(TINY_MODEL, data, entry.get("recipe", {}), steps=steps, seq=seq, batch=batch)
    recipe = load_recipe(raw)
    assert recipe.train.max_steps == entry["steps"] and recipe.data.max_length == entry["seq"]
    assert isinstance(entry["gpus"], int) and entry["est_s"] > 0 and isinstance(entry.get("exclusive", False), bool)
