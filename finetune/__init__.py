"""finetune: one YAML recipe -> a planned, compiled, real fine-tuning run.

    from finetune import load_recipe, plan, run, push
    recipe = load_recipe("recipes/llama70b-lora.yaml")
    print(plan(recipe, hardware="server-8xh100").strategy)

Heavy libraries (torch, transformers) are imported only by run/merge/push/generate/evaluate.
"""

import importlib

# `plan` and `compile` name both a package here and a function of the API. Python binds a package to
# its parent's attribute when the package is first imported, which would replace the function there;
# importing both packages before the functions are bound below keeps `finetune.plan` the function.
for _package in ("finetune.plan", "finetune.compile"):
    importlib.import_module(_package)
del _package

from finetune.api import compile, make_plan, measure, plan, run  # noqa: E402
from finetune.errors import FinetuneError  # noqa: E402
from finetune.recipe import Recipe, load_recipe  # noqa: E402

__version__ = "0.1.0"


def merge(run_dir, output_dir, **kwargs):
    """Merge a run's LoRA adapter into its base model (see finetune.merging.merge)."""
    from finetune.merging import merge as _merge

    return _merge(run_dir, output_dir, **kwargs)


def convert(
    config,
    *,
    source: str,
    output=None,
    method: str | None = None,
    gpus: int | None = None,
    hardware: str | None = None,
):
    """A peer's config (axolotl, llamafactory, trl) as a recipe (see finetune.peers.convert_file); `gpus`: the GPU
    count it ran on, for the global batch its per-GPU batch sizes make; `hardware`: the preset it ran on (its GPU
    count, and the recipe's hardware)."""
    from finetune.peers import convert_file

    return convert_file(config, source=source, output=output, method=method, gpus=gpus, hardware=hardware)


def push(run_dir, **kwargs):
    """Upload a run's adapter or merged model with a model card (see finetune.hub.push)."""
    from finetune.hub import push as _push

    return _push(run_dir, **kwargs)


def generate(run_dir, prompts, **kwargs):
    """Completions of a prompt or a list of prompts by a run's model (see finetune.inference.generate)."""
    from finetune.inference import generate as _generate

    return _generate(run_dir, prompts, **kwargs)


def evaluate(run_dir, tasks, **kwargs):
    """lm-evaluation-harness tasks on a run's model and its base (see finetune.evaluation.evaluate)."""
    from finetune.evaluation import evaluate as _evaluate

    return _evaluate(run_dir, tasks, **kwargs)


__all__ = [
    "Recipe",
    "FinetuneError",
    "load_recipe",
    "plan",
    "make_plan",
    "measure",
    "compile",
    "run",
    "merge",
    "push",
    "convert",
    "generate",
    "evaluate",
    "__version__",
]
