"""Preference rows in the layouts the peers and the Hub store them, to TRL's explicit-prompt form.

    {"prompt", "chosen", "rejected"}       all strings, or all message lists (prompt ends before the answer)
    {"prompt", "completion", "label"}      unpaired (KTO), the same two forms

Accepted as read from a file (`data.format: preference`):
- explicit prompt: prompt/chosen/rejected as strings or message lists (TRL's own form);
- implicit prompt: only chosen/rejected, the shared prompt inside both (Anthropic hh-rlhf as
  "\\n\\nHuman: ... \\n\\nAssistant: ..." text, or as message lists); split off by TRL's rule
  (`trl.data_utils.extract_prompt`: the longest shared prefix; restated in `extract_prompt` here because
  importing trl pulls in torch, and this runs in the torch-free pre-launch check; a test keeps them
  equal), and for hh-rlhf text the split is moved back to the last "Assistant:" turn marker
  so two answers that start alike ("It is blue" / "It is green") keep their first words;
- prompt string + chosen/rejected message lists that repeat the user turn (UltraFeedback-binarized);
- LLaMA-Factory: sharegpt `conversations` (from/value) as the prompt, chosen/rejected one from/value
  object each;
- chosen/rejected as a single message object instead of a list.
`data.format: unpaired` reads prompt/completion with a boolean `label` (true = desirable), KTO's form.
"""

from __future__ import annotations

from typing import Any

from finetune.data.formats import MESSAGE_KEYS, SHAREGPT_KEYS, columns_hint, row_error
from finetune.data.formats import SHAREGPT_ROLES as SPEAKERS

HH_TURN = "\n\nAssistant:"
# where a prompt sits when the file has no `prompt` column (LLaMA-Factory, chat-style files)
PROMPT_FALLBACKS = ("conversations", "messages")


def _as_messages(value: Any, *, what: str, file: str, row: int) -> list[dict] | str:
    """A string stays a string; a message object or a list of them becomes role/content messages."""
    if isinstance(value, str):
        if not value.strip():
            raise row_error(f"{what} is empty", file=file, row=row, hint="remove the row or fill it in")
        return value
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise row_error(
            f"{what} must be a string, a message, or a non-empty list of messages, got {type(value).__name__}",
            file=file,
            row=row,
        )
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise row_error(f"{what}[{i}] must be a mapping with role/content (or from/value)", file=file, row=row)
        speaker = msg.get(MESSAGE_KEYS[0], msg.get(SHAREGPT_KEYS[0]))
        content = msg.get(MESSAGE_KEYS[1], msg.get(SHAREGPT_KEYS[1]))
        role = SPEAKERS.get(str(speaker).lower()) if speaker is not None else None
        if role is None:
            raise row_error(
                f"{what}[{i}] has role {speaker!r}; valid: {', '.join(sorted(SPEAKERS))}", file=file, row=row
            )
        if not isinstance(content, str):
            raise row_error(f"{what}[{i}] content must be a string, got {type(content).__name__}", file=file, row=row)
        out.append({"role": role, "content": content})
    return out


def extract_prompt(chosen, rejected) -> dict:
    """TRL's extract_prompt: the longest shared prefix (turns or characters) is the prompt."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # the space before the answer stays with it
                idx -= 1
            break
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


def _hh_split(prompt: str, chosen: str, rejected: str) -> tuple[str, str, str]:
    cut = prompt.rfind(HH_TURN)
    if cut < 0:
        return prompt, chosen, rejected
    cut += len(HH_TURN)
    tail = prompt[cut:]
    return prompt[:cut], tail + chosen, tail + rejected


def _strip_repeated_prompt(prompt: list[dict], answer: list[dict]) -> list[dict]:
    n = len(prompt)
    return answer[n:] if answer[:n] == prompt else answer


def convert_preference(raw: dict, col: dict[str, str], *, file: str, row: int) -> dict:
    """One paired row (any layout in the module doc) -> {"prompt", "chosen", "rejected"}."""
    kw: dict[str, Any] = {"file": file, "row": row}
    for key in ("chosen", "rejected"):
        if raw.get(col[key]) is None:
            raise row_error(
                f"column {col[key]!r} (needed by format 'preference') is missing or null; the row has: "
                f"{', '.join(raw) or 'none'}",
                hint=columns_hint(key),
                **kw,
            )
    chosen = _as_messages(raw[col["chosen"]], what=col["chosen"], **kw)
    rejected = _as_messages(raw[col["rejected"]], what=col["rejected"], **kw)
    prompt_key = col["prompt"] if col["prompt"] in raw else next((k for k in PROMPT_FALLBACKS if k in raw), None)
    prompt = _as_messages(raw[prompt_key], what=prompt_key, **kw) if prompt_key else None
    if isinstance(chosen, list) != isinstance(rejected, list):
        raise row_error("chosen and rejected must both be strings or both be messages", **kw)
    if chosen == rejected:
        raise row_error(
            "chosen and rejected are the same, so there is no preference to learn", hint="remove the row", **kw
        )
    if prompt is None or (isinstance(prompt, str) and isinstance(chosen, list)):
        # implicit prompt, or a prompt string that the message lists repeat: TRL splits the shared prefix
        ex = extract_prompt(chosen, rejected)
        prompt_out, chosen, rejected = ex["prompt"], ex["chosen"], ex["rejected"]
        if isinstance(prompt_out, str):
            prompt_out, chosen, rejected = _hh_split(prompt_out, chosen, rejected)
        if not prompt_out and isinstance(prompt, str):  # the lists hold only the answers
            prompt_out = [{"role": "user", "content": prompt}]
        prompt = prompt_out
    elif isinstance(prompt, list) and isinstance(chosen, list) and isinstance(rejected, list):
        chosen, rejected = _strip_repeated_prompt(prompt, chosen), _strip_repeated_prompt(prompt, rejected)
    elif isinstance(prompt, list):  # a conversation prompt with plain-text answers
        chosen = [{"role": "assistant", "content": chosen}]
        rejected = [{"role": "assistant", "content": rejected}]
    elif isinstance(chosen, list):
        raise row_error("the prompt is a string but chosen/rejected are messages", **kw)
    if not prompt:
        raise row_error(
            "no prompt: chosen and rejected share no beginning and there is no prompt column",
            hint=f"add a prompt column, or {columns_hint('prompt')}",
            **kw,
        )
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if not value or (isinstance(value, list) and not any(m["role"] == "assistant" for m in value)):
            raise row_error(
                f"{key} has no answer after the prompt",
                hint="check that chosen and rejected differ only in the answer",
                **kw,
            )
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _label(value: Any, *, what: str, file: str, row: int) -> bool:
    if isinstance(value, bool):
        return value
    if value in (0, 1):  # parquet/csv often store booleans as integers
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise row_error(
        f"{what} must be true or false, got {value!r}",
        file=file,
        row=row,
        hint="label marks a desirable (true) or undesirable (false) completion",
    )


def convert_unpaired(raw: dict, col: dict[str, str], *, file: str, row: int) -> dict:
    """One KTO row -> {"prompt", "completion", "label"}."""
    kw: dict[str, Any] = {"file": file, "row": row}
    prompt = _as_messages(raw.get(col["prompt"]), what=col["prompt"], **kw)
    completion = _as_messages(raw.get(col["completion"]), what=col["completion"], **kw)
    if isinstance(prompt, list) and isinstance(completion, str):
        completion = [{"role": "assistant", "content": completion}]
    if isinstance(prompt, str) and isinstance(completion, list):
        raise row_error("the prompt is a string but the completion is messages", **kw)
    if isinstance(completion, list) and isinstance(prompt, list):
        completion = _strip_repeated_prompt(prompt, completion)
    return {"prompt": prompt, "completion": completion, "label": _label(raw.get(col["label"]), what=col["label"], **kw)}


def unpair(record: dict) -> list[dict]:
    """A paired row as two KTO rows (chosen desirable, rejected not), as TRL's unpair_preference_dataset."""
    return [
        {"prompt": record["prompt"], "completion": record["chosen"], "label": True},
        {"prompt": record["prompt"], "completion": record["rejected"], "label": False},
    ]
