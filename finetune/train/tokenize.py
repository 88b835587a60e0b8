"""Tokenize converted records into the columns TRL accepts as already processed.

SFT -> `input_ids` + `labels` (-100 on tokens without loss). With a `labels` column the
SFTTrainer uses it as is and skips its own tokenization (trl/trainer/sft_trainer.py,
`_prepare_dataset`: `is_processed = "input_ids" in column_names`).
DPO -> `prompt_ids` / `chosen_ids` / `rejected_ids`, exactly as DPOTrainer's own tokenize_fn.

Assistant-only loss: a chat template with `{% generation %}` markers gives the mask
directly. A template without them is handled by rendering the conversation turn by turn:
the tokens that appear when an assistant turn is appended (after the generation prompt)
are that turn's tokens. That works for any template that renders a prefix of the
conversation as a prefix of the whole (nearly all do); where one does not, the mask
starts at the first differing token and a warning says so once.
"""

from __future__ import annotations

import logging

from trl.chat_template_utils import has_generation_markers
from trl.data_utils import common_prefix_length

log = logging.getLogger("finetune.train")
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


def _chat_ids(tokenizer, messages, **kw) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)["input_ids"])


def _assistant_mask_by_prefix(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    ids = _chat_ids(tokenizer, messages)
    mask = [0] * len(ids)
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        start_ids = _chat_ids(tokenizer, messages[:i], add_generation_prompt=True) if i else []
        end_ids = _chat_ids(tokenizer, messages[: i + 1])
        start = common_prefix_length(start_ids, ids)
        end = common_prefix_length(end_ids, ids)
        if start < len(start_ids) or end < len(end_ids):
            _warn_once("prefix", "the chat template does not render a conversation's beginning as a prefix of "
                                 "the whole; assistant-only loss masks from the first differing token")
        for j in range(start, max(start, end)):
            mask[j] = 1
    return ids, mask


def sft_features(record: dict, tokenizer, *, assistant_only_loss: bool) -> dict:
    """One converted SFT record -> {"input_ids", "labels"}."""
    eos = tokenizer.eos_token or ""
    if "messages" in record:
        messages = record["messages"]
        if not assistant_only_loss:
            ids = _chat_ids(tokenizer, messages)
            return {"input_ids": ids, "labels": list(ids)}
        if has_generation_markers(tokenizer.chat_template):
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        else:
            ids, mask = _assistant_mask_by_prefix(tokenizer, messages)
        return {"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask)]}
    if "prompt" in record:  # standard prompt-completion: plain text, EOS closes the completion
        completion = record["completion"]
        if eos and not completion.endswith(eos):
            completion += eos
        prompt_ids = list(tokenizer(text=record["prompt"])["input_ids"])
        ids = list(tokenizer(text=record["prompt"] + completion)["input_ids"])
        start = common_prefix_length(prompt_ids, ids) if assistant_only_loss else 0
        return {"input_ids": ids, "labels": [-100] * start + ids[start:]}
    text = record["text"]
    if eos and not text.endswith(eos):
        text += eos
    ids = list(tokenizer(text=text)["input_ids"])
    return {"input_ids": ids, "labels": list(ids)}


def dpo_features(record: dict, tokenizer) -> dict:
    """One preference record -> {"prompt_ids", "chosen_ids", "rejected_ids"} (as DPOTrainer builds them)."""
    prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
    if isinstance(prompt, list):
        prompt_ids = _chat_ids(tokenizer, prompt, add_generation_prompt=True)
        chosen_full = _chat_ids(tokenizer, prompt + chosen)
        rejected_full = _chat_ids(tokenizer, prompt + rejected)
    else:
        eos = tokenizer.eos_token or ""
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        prompt_ids = list(tokenizer(text=prompt)["input_ids"])
        chosen_full = list(tokenizer(text=prompt + chosen)["input_ids"])
        rejected_full = list(tokenizer(text=prompt + rejected)["input_ids"])
    cut = min(common_prefix_length(prompt_ids, chosen_full), common_prefix_length(prompt_ids, rejected_full))
    return {"prompt_ids": prompt_ids[:cut], "chosen_ids": chosen_full[cut:], "rejected_ids": rejected_full[cut:]}


def features_length(features: dict) -> int:
    if "input_ids" in features:
        return len(features["input_ids"])
    return len(features["prompt_ids"]) + max(len(features["chosen_ids"]), len(features["rejected_ids"]))


def has_loss_tokens(features: dict) -> bool:
    if "labels" in features:
        return any(t != -100 for t in features["labels"])
    return bool(features["chosen_ids"]) and bool(features["rejected_ids"])
