"""Which runs' final save under FSDP2 gathers the trained parameters alone (finetune/train/adapter_save.py);
the gather and the written adapter themselves are checked on two CPU ranks in test_sharded_load.py."""

from __future__ import annotations

import pytest

from finetune.recipe import load_recipe
from finetune.recipe.schema import final_save_gathers_trained_only as gathers_trained_only
from finetune.train.subclass import trainer_class
from tests.helpers.recipes import tiny_recipe


@pytest.mark.parametrize(
    ("sections", "trained_only"),
    [
        ({}, True),  # LoRA on the linears: peft writes the adapter alone
        ({"adapter": {"type": "qlora", "compute_dtype": "float32"}}, True),
        ({"adapter": {"type": "lora", "modules_to_save": ["lm_head"]}}, True),  # a trained copy: gathered
        ({"adapter": {"type": "full"}}, False),  # the whole model is the output
        (  # peft writes the grown embeddings whole
            {"tokenizer": {"added_tokens": ["<tool>"]}, "adapter": {"modules_to_save": ["embed_tokens", "lm_head"]}},
            False,
        ),
        ({"tokenizer": {"pad_token": "<pad>"}}, False),
        ({"adapter": {"type": "lora", "target_modules": ["q_proj", "embed_tokens"]}}, False),
    ],
)
def test_runs_whose_adapter_file_holds_no_frozen_weight(sections, trained_only):
    recipe = load_recipe(tiny_recipe(**sections))
    assert gathers_trained_only(recipe) is trained_only
    from trl import SFTTrainer

    assert trainer_class(SFTTrainer, recipe).gathers_trained_only is trained_only
