"""model.attn_implementation flash_attention_2/3 without its package is refused in the launching process, naming
the key, before anything loads (transformers imports flash-attn only inside from_pretrained, in every rank)."""

from __future__ import annotations

import importlib.util

import pytest

from finetune.errors import RecipeError
from finetune.prelaunch import ATTENTION_PACKAGES, check_attention_package
from finetune.recipe import load_recipe


def _resolved(implementation: str):
    return load_recipe(
        {
            "model": {"name": "m", "arch": "llama-3.1-8b", "attn_implementation": implementation},
            "data": {"path": "t.jsonl"},
        }
    )


@pytest.mark.parametrize("implementation", sorted(ATTENTION_PACKAGES))
def test_a_flash_implementation_without_its_package_is_refused(implementation):
    if importlib.util.find_spec(ATTENTION_PACKAGES[implementation]) is not None:
        pytest.skip(f"{ATTENTION_PACKAGES[implementation]} is installed here")
    with pytest.raises(RecipeError) as caught:
        check_attention_package(_resolved(implementation))
    assert caught.value.key == "model.attn_implementation" and "model.attn_implementation: auto" in caught.value.hint


@pytest.mark.parametrize("implementation", ["auto", "varlen", "sdpa", "eager"])
def test_torchs_own_kernels_need_no_package(implementation):
    check_attention_package(_resolved(implementation))
