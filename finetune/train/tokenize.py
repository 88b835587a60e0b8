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

Many records at once (`sft_features_batch`, what preflight uses): conversations are rendered
once and tokenized in batches, so the fast tokenizer encodes a batch on all cores, and with
generation markers the assistant tokens are found from the rendered spans by a lookup per span
instead of transformers' Python pass over every token's offsets. The output is identical to
`sft_features` record by record (tests/unit/train/test_data.py checks it).
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
            _warn_once(
                "prefix",
                "the chat template does not render a conversation's beginning as a prefix of "
                "the whole; assistant-only loss masks from the first differing token",
            )
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
            out = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
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


def _labels_from_spans(encoding, ids: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """Labels = ids on every token overlapping a generation span (transformers' rule), -100 elsewhere."""
    n = len(ids)
    labels = [-100] * n
    for start, end in spans:
        first = encoding.char_to_token(start) if end > start else None
        last = encoding.char_to_token(end - 1) if end > start else None
        if first is None or last is None:  # a span edge on a character no token covers: the exact pass
            return _labels_by_offsets(encoding.offsets, ids, spans)
        # several tokens can share a character (byte-level BPE splits a multi-byte one); char_to_token
        # gives the first of them, so the span's last character may continue into the next tokens
        while last + 1 < n and (encoding.token_to_chars(last + 1) or (end, end))[0] < end:
            last += 1
        labels[first : last + 1] = ids[first : last + 1]
    return labels


def _labels_by_offsets(offsets, ids: list[int], spans: list[tuple[int, int]]) -> list[int]:
    # transformers' apply_chat_template rule, token by token
    labels, span = [-100] * len(ids), 0
    for i, (tok_start, tok_end) in enumerate(offsets):
        while span < len(spans) and tok_start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if tok_end > spans[span][0]:
            labels[i] = ids[i]
    return labels


def _render_with_spans(tokenizer):
    """transformers' renderer behind apply_chat_template (text + generation spans), or None where
    this transformers lacks it or the tokenizer is not a fast one (offsets need the Rust encoder)."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    try:
        from transformers.utils.chat_template_utils import render_jinja_template

        template = tokenizer.get_chat_template()
    except (ImportError, ValueError):
        return None
    if not has_generation_markers(template):
        return None

    def render(conversations):
        return render_jinja_template(
            conversations=conversations,
            chat_template=template,
            return_assistant_tokens_mask=True,
            **tokenizer.special_tokens_map,
        )

    return render


def sft_features_batch(records: list[dict], tokenizer, *, assistant_only_loss: bool, chunk: int = 512) -> list[dict]:
    """`sft_features` for every record, in order; conversations in batches (see the module doc)."""
    out: list[dict | None] = [None] * len(records)
    chats = [i for i, r in enumerate(records) if "messages" in r]
    render = _render_with_spans(tokenizer) if assistant_only_loss else None
    if render is not None or not assistant_only_loss:
        for lo in range(0, len(chats), chunk):
            idx = chats[lo : lo + chunk]
            convs = [records[i]["messages"] for i in idx]
            if render is None:  # full loss: ids only
                for i, ids in zip(
                    idx, tokenizer.apply_chat_template(convs, tokenize=True, return_dict=True)["input_ids"]
                ):
                    out[i] = {"input_ids": list(ids), "labels": list(ids)}
                continue
            texts, spans = render(convs)
            enc = tokenizer(texts, add_special_tokens=False)
            for j, i in enumerate(idx):
                ids = enc["input_ids"][j]
                out[i] = {"input_ids": ids, "labels": _labels_from_spans(enc.encodings[j], ids, spans[j])}
    return [
        o if o is not None else sft_features(r, tokenizer, assistant_only_loss=assistant_only_loss)
        for o, r in zip(out, records)
    ]


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
