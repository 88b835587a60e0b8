"""A multimodal checkpoint trained on text (Gemma-3 with its SigLIP vision tower): the towers load frozen and
without adapters, the text decoder trains, and the planner counts the towers' weights (frozen) as the run holds
them. Real transformers/peft/TRL on a tiny Gemma3ForConditionalGeneration built here."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from finetune.rundir import read_metrics
from finetune.train.run import run_rank
from tests.helpers.paths import TINY_MODEL
from tests.helpers.recipes import resolve_recipe, tiny_recipe

VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14
)


@pytest.fixture(scope="module")
def gemma3_multimodal(tmp_path_factory) -> Path:
    """A tiny Gemma3ForConditionalGeneration saved with the shipped tiny tokenizer (its image tokens are the
    vocabulary's last ids, which text never uses)."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3Config

    text = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=384,
        sliding_window=16,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=dict(VISION, vision_use_head=False),
        mm_tokens_per_image=4,
        image_token_index=383,
        boi_token_index=381,
        eoi_token_index=382,
    )
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("gemma3-multimodal")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY_MODEL / name, out / name)
    return out


def _tower_names(model) -> set[str]:
    return {n for n, _ in model.named_parameters() if ".vision_tower." in n or ".multi_modal_projector." in n}


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_text_training_freezes_the_towers_and_keeps_adapters_off_them(gemma3_multimodal, tmp_path, adapter):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    recipe = tiny_recipe(model={"name": str(gemma3_multimodal)}, adapter=adapter, data={"eval_sources": []})
    summary = run_rank(resolve_recipe(recipe, run_dir=run_dir), resume="never")
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    assert summary["steps"] == 6 and losses[-1] < losses[0]

    base = AutoModelForCausalLM.from_pretrained(gemma3_multimodal)
    towers = _tower_names(base)
    assert towers  # the tiny checkpoint has a vision tower and a projector
    if adapter == "lora":
        with safe_open(run_dir / "adapter_model.safetensors", "pt") as saved:
            keys = list(saved.keys())
        assert keys and all(".language_model." in k for k in keys), keys[:4]
        return
    # the model the ranks train holds the towers frozen (no gradients, no optimizer state for them) ...
    from finetune.recipe.load import load_recipe
    from finetune.train.model import load_model

    loaded = load_model(load_recipe(run_dir / "recipe.resolved.yaml", allow_resolved=True))
    assert {n for n, p in loaded.named_parameters() if not p.requires_grad} == towers
    # ... and the full fine-tune changed the text decoder and left the towers as they were loaded
    trained = AutoModelForCausalLM.from_pretrained(run_dir)
    before, after = dict(base.named_parameters()), dict(trained.named_parameters())
    assert all(before[n].equal(after[n]) for n in towers)
    assert any(not before[n].equal(after[n]) for n in after if n not in towers)


def test_the_plan_counts_the_towers_as_frozen_weights(gemma3_multimodal):
    from transformers import AutoModelForCausalLM

    from finetune.plan import plan
    from finetune.recipe import load_recipe

    model = AutoModelForCausalLM.from_pretrained(gemma3_multimodal)
    towers = sum(p.numel() for n, p in model.named_parameters() if n in _tower_names(model))
    total = sum(p.numel() for p in model.parameters())
    for adapter in ("lora", "full"):
        p = plan(load_recipe(tiny_recipe(model={"name": str(gemma3_multimodal)}, adapter=adapter)))
        assert (p.total_params, p.frozen_tower_params) == (total, towers)
        if adapter == "full":  # what the full fine-tune trains: the text model only
            assert p.trainable_params == total - towers
