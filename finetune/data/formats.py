"""Convert one row of every supported data format to TRL's forms.

    messages / alpaca / sharegpt  -> {"messages": [{"role", "content"}, ...]}   (conversational)
    prompt_completion             -> {"prompt": str, "completion": str}          (standard prompt-completion)
    text                          -> {"text": str}                                (language modeling)
    preference                    -> {"prompt", "chosen", "rejected"}             (str or message lists)
    unpaired                      -> {"prompt", "completion", "label"}            (KTO; see preference.py)

Every problem raises DataError naming the file and the 1-based row, with a fix.
"""

from __future__ import annotations

from typing import Any

from finetune.errors import DataError
from finetune.recipe.schema import FORMAT_COLUMNS, OPTIONAL_COLUMNS

ROLES = ("system", "user", "assistant", "tool")
# the keys a message keeps its speaker and its text under: a messages row's, and a sharegpt row's (whose files
# sometimes carry the former instead)
MESSAGE_KEYS = ("role", "content")
SHAREGPT_KEYS = ("from", "value")
# sharegpt speakers -> chat roles (the common spellings seen in public sharegpt dumps)
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}


def columns_hint(canonical: str) -> str:
    """How to point a format's column at the file's own name for it, for any source: the shorthand's data.columns,
    a listed source's data.sources[i].columns, data.eval_sources[i].columns or data.task_eval.columns."""
    return f"map it with that source's columns: {{{canonical}: <your column>}}"


def row_error(message: str, *, file: str, row: int, hint: str | None = None) -> DataError:
    """The error for one row (numbered from 1) of `file`, with a fix."""
    return DataError(f"row {row}: {message}", file=file, hint=hint or "fix or delete that row")


def column_map(fmt: str, columns: dict[str, str]) -> dict[str, str]:
    """canonical column -> the file's column name."""
    return {name: columns.get(name, name) for name in FORMAT_COLUMNS[fmt]}


def check_columns(present: list[str], *, fmt: str, columns: dict[str, str], file: str, row: int) -> None:
    """Missing required columns, named with the recipe key that maps them."""
    optional = OPTIONAL_COLUMNS.get(fmt, ())
    for canonical, actual in column_map(fmt, columns).items():
        if actual not in present and canonical not in optional:
            shown = ", ".join(present) or "none"
            raise row_error(
                f"column {actual!r} (needed by format {fmt!r}) is missing; the row has: {shown}",
                file=file,
                row=row,
                hint=f"{columns_hint(canonical)}, or pick that source's format",
            )


def _text(value: Any, *, what: str, file: str, row: int, allow_empty: bool = False) -> str:
    if value is None and allow_empty:
        return ""
    if not isinstance(value, str):
        raise row_error(f"{what} must be a string, got {type(value).__name__}", file=file, row=row)
    if not value.strip() and not allow_empty:
        raise row_error(f"{what} is empty", file=file, row=row, hint="remove the row or fill it in")
    return value


def _messages(
    value: Any,
    *,
    what: str,
    file: str,
    row: int,
    roles: dict[str, str] | None = None,
    role_key: str = MESSAGE_KEYS[0],
    content_key: str = MESSAGE_KEYS[1],
    need_assistant: bool = True,
) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise row_error(f"{what} must be a non-empty list of messages", file=file, row=row)
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise row_error(f"{what}[{i}] must be a mapping with {role_key!r} and {content_key!r}", file=file, row=row)
        # sharegpt files sometimes carry role/content instead of from/value
        raw_role = msg.get(role_key, msg.get(MESSAGE_KEYS[0]))
        content = msg.get(content_key, msg.get(MESSAGE_KEYS[1]))
        role = (roles or {r: r for r in ROLES}).get(str(raw_role).lower() if raw_role is not None else "")
        if role is None:
            valid = ", ".join(sorted(roles or ROLES))
            raise row_error(
                f"{what}[{i}] has role {raw_role!r}; valid roles: {valid}",
                file=file,
                row=row,
                hint="rename the role, or use data.format: sharegpt for from/value (human/gpt) data",
            )
        out.append(
            {
                "role": role,
                "content": _text(
                    content, what=f"{what}[{i}].{content_key}", file=file, row=row, allow_empty=(role != "assistant")
                ),
            }
        )
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise row_error(
            f"{what} has no assistant message, so there is nothing to learn",
            file=file,
            row=row,
            hint="every conversation needs at least one assistant turn",
        )
    return out


def convert_row(raw: dict, *, fmt: str, columns: dict[str, str], file: str, row: int) -> dict:
    """One raw row (already parsed) -> TRL form. Raises DataError naming file:row."""
    if not isinstance(raw, dict):
        raise row_error(f"expected a JSON object, got {type(raw).__name__}", file=file, row=row)
    check_columns(list(raw), fmt=fmt, columns=columns, file=file, row=row)
    col = column_map(fmt, columns)
    get = {canonical: raw.get(actual) for canonical, actual in col.items()}
    kw: dict[str, Any] = dict(file=file, row=row)
    if fmt == "messages":
        return {"messages": _messages(get["messages"], what=col["messages"], **kw)}
    if fmt == "sharegpt":
        return {
            "messages": _messages(
                get["conversations"],
                what=col["conversations"],
                roles=SHAREGPT_ROLES,
                role_key=SHAREGPT_KEYS[0],
                content_key=SHAREGPT_KEYS[1],
                **kw,
            )
        }
    if fmt == "alpaca":
        instruction = _text(get["instruction"], what=col["instruction"], **kw)
        extra = _text(get.get("input"), what=col["input"], allow_empty=True, **kw)
        prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        return {
            "messages": [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": _text(get["output"], what=col["output"], **kw)},
            ]
        }
    if fmt == "text":
        return {"text": _text(get["text"], what=col["text"], **kw)}
    if fmt == "prompt_completion":
        return {
            "prompt": _text(get["prompt"], what=col["prompt"], **kw),
            "completion": _text(get["completion"], what=col["completion"], **kw),
        }
    if fmt in ("preference", "unpaired"):
        from finetune.data.preference import convert_preference, convert_unpaired

        return (convert_preference if fmt == "preference" else convert_unpaired)(raw, col, **kw)
    raise row_error(f"unknown format {fmt!r}", **kw)


def split_last_turn(messages: list[dict]) -> tuple[list[dict], str]:
    """Conversation -> (prompt messages before the last assistant turn, that turn's text)."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last], messages[last]["content"]
