"""Recipes: the strict schema and the loader (YAML, extends, --set overrides)."""

from finetune.recipe.load import dump_recipe, load_recipe, recipe_dir, recipe_name
from finetune.recipe.schema import Recipe

__all__ = ["Recipe", "load_recipe", "dump_recipe", "recipe_dir", "recipe_name"]
