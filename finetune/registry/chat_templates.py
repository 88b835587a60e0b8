"""Named chat templates shipped as data (registry/templates/NAME.jinja). Pure: no heavy imports.

`data.chat_template` may name one of them; the tokenizer's own template stays the default. Every
shipped template marks assistant turns with {% generation %} so assistant-only loss reads its mask
directly.
"""

from __future__ import annotations

import difflib
from pathlib import Path

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"


def template_names() -> list[str]:
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))


def named_template(name: str) -> str | None:
    """The shipped template called `name` (case-insensitive), or None."""
    wanted = name.strip().lower()
    for known in template_names():
        if known.lower() == wanted:
            return (TEMPLATES_DIR / f"{known}.jinja").read_text(encoding="utf-8")
    return None


def suggest(name: str) -> str:
    close = difflib.get_close_matches(name.lower(), template_names(), n=1, cutoff=0.6)
    names = ", ".join(template_names())
    return f"did you mean {close[0]}? shipped: {names}" if close else f"shipped: {names}"
