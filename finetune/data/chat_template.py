"""data.chat_template as text: inline jinja, a template file, or a shipped template's name.

Read before launch (the template is rendered on the first conversation, finetune/prelaunch.py) and by
each rank's tokenizer setup (finetune/train/model.py).
"""

from __future__ import annotations

from finetune.errors import RecipeError
from finetune.recipe.load import recipe_dir
from finetune.recipe.paths import anchored, is_inline_template
from finetune.recipe.schema import Recipe


def read_chat_template(recipe: Recipe) -> str | None:
    """data.chat_template is inline jinja, a shipped template's name (chatml, llama3, ...), or a path
    (relative to the recipe) to a template file; a file of that name wins over a shipped name."""
    from finetune.registry.chat_templates import named_template, suggest

    text = recipe.data.chat_template
    if text is None:
        return None
    if is_inline_template(text):
        return text
    path = anchored(text, recipe_dir(recipe))
    if path.is_file():
        return path.read_text(encoding="utf-8")
    shipped = named_template(text)
    if shipped is not None:
        return shipped
    raise RecipeError(
        f"is neither a jinja template, a shipped template name, nor an existing file ({path})",
        key="data.chat_template",
        hint=f"give the template text inline, the path to a .jinja file, or a name ({suggest(text)})",
    )
