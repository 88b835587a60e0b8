"""Named chat templates shipped as data, special-token overrides and added tokens (embeddings grow,
the planner counts the new rows)."""

from __future__ import annotations

import json

import pytest

from finetune.errors import RecipeError
from finetune.recipe.load import load_recipe
from finetune.registry.chat_templates import template_names
from tests.helpers.paths import TINY_MODEL
from tests.helpers.recipes import resolve_recipe, tiny_recipe

CONV = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "abc"},
    {"role": "assistant", "content": "ABC"},
    {"role": "user", "content": "de"},
    {"role": "assistant", "content": "DE"},
]


def _tokenizer(recipe_sections: dict):
    from finetune.train.model import load_tokenizer

    return load_tokenizer(load_recipe(tiny_recipe(**recipe_sections)))


def test_the_promised_templates_ship():
    assert set(template_names()) >= {"chatml", "llama3", "qwen2.5", "qwen3", "mistral", "gemma", "phi-3"}


@pytest.mark.parametrize("name", template_names())
def test_each_template_renders_and_masks_only_the_answers(name):
    from finetune.train.tokenize import sft_features

    tok = _tokenizer({"data": {"chat_template": name}})
    text = tok.apply_chat_template(CONV, tokenize=False)
    assert "abc" in text and "ABC" in text and "Be terse." in text
    prompt = tok.apply_chat_template(CONV[:2], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt)  # a prefix of the conversation renders as a prefix (masking relies on it)
    feats = sft_features({"messages": CONV}, tok, assistant_only_loss=True)
    learned = tok.decode([t for t in feats["labels"] if t != -100])
    assert "ABC" in learned and "DE" in learned and "abc" not in learned and "Be terse" not in learned


def test_the_tokenizer_template_stays_the_default_and_a_file_wins(tmp_path):
    own = (TINY_MODEL / "chat_template.jinja").read_text()
    assert _tokenizer({}).chat_template == own
    (tmp_path / "chatml").write_text("{{ messages[0]['content'] }}")
    recipe = load_recipe(tiny_recipe(data={"chat_template": str(tmp_path / "chatml")}))
    from finetune.data.chat_template import read_chat_template

    assert read_chat_template(recipe) == "{{ messages[0]['content'] }}"


def test_an_unknown_name_is_refused_before_launch_with_a_suggestion():
    from finetune.data.check import check_data

    with pytest.raises(RecipeError) as info:
        check_data(load_recipe(tiny_recipe(data={"chat_template": "chatm1"})))
    assert "data.chat_template" in info.value.render() and "did you mean chatml" in info.value.render()


def test_special_tokens_and_added_tokens():
    tok = _tokenizer(
        {
            "tokenizer": {"pad_token": "<|mypad|>", "added_tokens": ["<|im_start|>", "<|im_end|>"]},
            "adapter": {"modules_to_save": ["embed_tokens", "lm_head"]},
        }
    )
    assert tok.pad_token == "<|mypad|>"
    assert tok.tokenize("<|im_start|>ab") == ["<|im_start|>", "a", "b"]


def test_added_tokens_with_lora_need_modules_to_save():
    with pytest.raises(RecipeError, match="adapter.modules_to_save"):
        load_recipe(tiny_recipe(tokenizer={"added_tokens": ["<|x|>"]}))
    assert load_recipe(tiny_recipe(tokenizer={"added_tokens": ["<|x|>"]}, adapter={"type": "full"}))


def test_planner_counts_the_added_rows():
    from finetune.plan import job_from_recipe
    from finetune.registry import get_model, get_preset

    arch, preset = get_model("llama-3.1-8b"), get_preset("server-8xh100")
    base = load_recipe(tiny_recipe())
    grown = load_recipe(
        tiny_recipe(
            tokenizer={"added_tokens": ["<a>", "<b>"], "pad_token": "<p>"},
            adapter={"modules_to_save": ["embed_tokens", "lm_head"]},
        )
    )
    assert (
        job_from_recipe(grown, arch=arch, preset=preset).arch.vocab_size
        == job_from_recipe(base, arch=arch, preset=preset).arch.vocab_size + 3
    )


@pytest.mark.slow
def test_training_with_a_named_template_and_new_tokens(tmp_path):
    from finetune.train.run import run_rank

    raw = tiny_recipe(
        data={"chat_template": "chatml", "max_length": 48},
        train={"max_steps": 4},
        tokenizer={"added_tokens": ["<|im_start|>", "<|im_end|>"]},
        adapter={"modules_to_save": ["embed_tokens", "lm_head"]},
    )
    summary = run_rank(resolve_recipe(raw, run_dir=tmp_path / "run"), resume="never")
    assert summary["steps"] == 4
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(tmp_path / "run")
    assert len(saved) == 362 and "<|im_start|>" in saved.get_vocab()
    assert "im_start" in saved.chat_template
    config = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert set(config["modules_to_save"]) >= {"embed_tokens", "lm_head"}
    from finetune.merging import merge

    merged = merge(tmp_path / "run", tmp_path / "merged")
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(merged).get_input_embeddings().weight.shape[0] >= 362
