"""data.task_eval: exact match of greedy generation on held-out prompts, before and after training.

Runs on rank 0 only, on an unsharded model: before training on the freshly loaded model (or a
separate copy on multi-rank runs, where the training copy may already be partitioned), after
training on the artifacts just written to RUN_DIR (so it also proves they load).
"""

from __future__ import annotations

import logging
from pathlib import Path

from finetune.data.formats import split_last_turn
from finetune.data.sources import load_source
from finetune.recipe.load import recipe_dir
from finetune.recipe.paths import model_path
from finetune.recipe.schema import Recipe

log = logging.getLogger("finetune.train")


def load_cases(recipe: Recipe) -> list[tuple[object, str]]:
    """(prompt: messages or text, expected answer) for the first n examples."""
    spec = recipe.data.task_eval
    records = load_source(spec, base_dir=recipe_dir(recipe)).records[: spec.n]
    cases = []
    for rec in records:
        if "messages" in rec:
            cases.append(split_last_turn(rec["messages"]))
        elif "completion" in rec:
            cases.append((rec["prompt"], rec["completion"]))
    return cases


def exact_match(model, tokenizer, cases, *, max_new_tokens: int) -> dict:
    import torch

    model.eval()
    device = next(model.parameters()).device
    hits, shown = 0, []
    with torch.no_grad():
        for prompt, expected in cases:
            if isinstance(prompt, list):
                enc = tokenizer.apply_chat_template(
                    prompt, add_generation_prompt=True, return_dict=True, return_tensors="pt"
                )
            else:
                enc = tokenizer(prompt, return_tensors="pt")
            enc = {k: v.to(device) for k, v in enc.items()}
            out = model.generate(
                **enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            text = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()
            ok = text == expected.strip()
            hits += ok
            if len(shown) < 3:
                shown.append(
                    {
                        "prompt": prompt[-1]["content"] if isinstance(prompt, list) else prompt,
                        "expected": expected,
                        "got": text,
                    }
                )
    return {"exact_match": hits / max(len(cases), 1), "n": len(cases), "examples": shown}


def load_trained(recipe: Recipe, run_dir: Path):
    """The model as written to RUN_DIR: full weights, or the base plus the adapter."""
    from transformers import AutoModelForCausalLM

    from finetune.train.model import model_kwargs

    kwargs = model_kwargs(recipe)
    if recipe.adapter.type == "full":
        kwargs.pop("revision", None)
        kwargs.pop("quantization_config", None)
        return _to_device(AutoModelForCausalLM.from_pretrained(run_dir, **kwargs), recipe)
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(model_path(recipe), **kwargs)
    return _to_device(PeftModel.from_pretrained(base, run_dir), recipe)


def load_base(recipe: Recipe):
    from transformers import AutoModelForCausalLM

    from finetune.train.model import model_kwargs

    return _to_device(AutoModelForCausalLM.from_pretrained(model_path(recipe), **model_kwargs(recipe)), recipe)


def _to_device(model, recipe: Recipe):
    if recipe.resolved.device == "cuda" and recipe.adapter.type != "qlora":  # 4-bit is placed by device_map
        from accelerate import PartialState

        model = model.to(f"cuda:{PartialState().local_process_index}")
    return model
