"""data.example_tokens measured before launch: how long the packed examples are, in the model's tokens.

The planner's attention cost for packed rows depends on the examples' lengths, not the row's: a causal
kernel that runs each packed example on its own computes l^2/2 scores for an example of l tokens
(finetune.plan.workload.packed_length). Torch-free: the local training records (as finetune.data
reads them), each rendered with the chat template the ranks will use (finetune.prelaunch.chat_renderer,
as transformers renders it) and counted with the local model's tokenizer.json through the `tokenizers`
library. An evenly spread sample of SAMPLE records is enough for the mean (a few %). None when
the data or the tokenizer is not local, a record is neither a conversation nor text, or the recipe does
not pack (then the planner keeps its assumption: examples as long as max_length).
"""

from __future__ import annotations

import json
from pathlib import Path

from finetune.recipe.schema import packs_examples

SAMPLE = 1000  # records measured per run, evenly spread over the training data
PLAN_READ_BYTES = 256 * 2**20  # `finetune plan` reads local data up to this size to measure it


def spread(records: list[dict], n: int = SAMPLE) -> list[dict]:
    """At most `n` records evenly spread over `records`."""
    if len(records) <= n:
        return list(records)
    step = len(records) / n
    return [records[int(i * step)] for i in range(n)]


def _special_tokens(model_dir: Path) -> dict[str, str]:
    """The template's bos/eos/pad/unk strings, from tokenizer_config.json (strings or AddedToken dicts)."""
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    out = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = config.get(name) if isinstance(config, dict) else None
        value = value.get("content") if isinstance(value, dict) else value
        out[name] = value if isinstance(value, str) else ""
    return out


def _texts(records: list[dict], render, special: dict[str, str]) -> list[str] | None:
    texts = []
    for record in records:
        if "messages" in record and render is not None:
            texts.append(render(record["messages"], add_generation_prompt=False, **special))
        elif isinstance(record.get("text"), str):
            texts.append(record["text"])
        elif isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
            texts.append(record["prompt"] + record["completion"])
        else:
            return None  # a layout this estimate does not render: leave the planner's assumption
    return texts


def measure_example_tokens(recipe, records: list[dict]) -> float | None:
    """The token-weighted mean length sum(l^2)/sum(l) of `records` (training records as finetune.data
    reads them, each cut at data.max_length), or None when it cannot be measured here."""
    from finetune.plan.workload import packed_length
    from finetune.prelaunch import chat_renderer, local_model_dir, template_text

    model_dir = local_model_dir(recipe)
    if not packs_examples(recipe) or not records or model_dir is None or not (model_dir / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    template = template_text(recipe)
    try:
        texts = _texts(spread(records), chat_renderer(template) if template else None, _special_tokens(model_dir))
    except Exception:  # a template that fails on a row is check_chat_template's to report
        return None
    if not texts:
        return None
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    lengths = [len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    return packed_length(lengths, max_length=recipe.data.max_length)


def with_example_tokens(recipe, records: list[dict]):
    """`recipe` with data.example_tokens measured from `records` where it is unset and measurable."""
    if recipe.data.example_tokens is not None:
        return recipe
    measured = measure_example_tokens(recipe, records)
    if measured is None:
        return recipe
    return recipe.model_copy(update={"data": recipe.data.model_copy(update={"example_tokens": round(measured, 1)})})


def local_sample(recipe, *, max_bytes: int = PLAN_READ_BYTES) -> list[dict]:
    """Training records spread over the recipe's local data for `finetune plan` and `compile`, which
    check no data: [] when a source is on the Hub, missing, unreadable, or the files are larger than
    `max_bytes` together (planning stays fast; `finetune run` reads every row anyway and measures
    there). With [] the plan keeps its assumption."""
    from finetune.data.sources import load_source, resolve_path
    from finetune.errors import FinetuneError
    from finetune.recipe.load import recipe_dir

    if not packs_examples(recipe) or recipe.data.example_tokens is not None:
        return []
    base, records, size = recipe_dir(recipe), [], 0
    for source in recipe.data.sources:
        try:
            path = resolve_path(source.path, base)
            if path is None or not path.is_file():
                return []
            size += path.stat().st_size
            if size > max_bytes:
                return []
            records += spread(load_source(source, base_dir=base).records)
        except (FinetuneError, OSError, ValueError):
            return []
    return records
