"""The model card (README.md) pushed with a run: Hub metadata up front, then how it was made.

Pure text generation from files in RUN_DIR (recipe.resolved.yaml, summary.json, metrics.jsonl):
no torch, no network, and nothing from the environment, so no secret can end up in the card.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Literal

import yaml

from finetune import rundir
from finetune.recipe.schema import Recipe

Kind = Literal["adapter", "merged", "full"]
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# local data files look like Hub ids ("data/train.jsonl"); these suffixes say they are files
_FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".txt", ".arrow", ".gz", ".zst")

# the card's figures and the summary.json keys finetune/train/run.py writes them under
_SUMMARY_KEYS = {
    "steps": rundir.SUMMARY_STEPS,
    "train_loss": rundir.SUMMARY_FINAL_LOSS,
    "eval_loss": rundir.SUMMARY_BEST_EVAL,
    "tokens_per_second": rundir.SUMMARY_TOKENS_PER_S,
    "train_tokens": rundir.SUMMARY_TOKENS,
}


def is_hub_id(name: str, *, anchor: Path | None = None) -> bool:
    """True for `org/name` that is not a local path (checked relative to cwd and `anchor`)."""
    if not HUB_ID.match(name) or name.endswith(_FILE_SUFFIXES):
        return False
    return not (Path(name).exists() or (anchor is not None and (anchor / name).exists()))


def training_summary(run_dir: Path) -> dict[str, float]:
    """steps, train_loss, eval_loss (best), tokens_per_second, train_tokens: whatever is known.

    summary.json wins; metrics.jsonl fills the gaps (last train loss, best eval loss, last step).
    """
    out: dict[str, float] = {}
    summary = rundir.read_summary(run_dir)
    for key, name in _SUMMARY_KEYS.items():
        value = summary.get(name)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = value
    rows = rundir.read_metrics(run_dir)
    if rows:
        losses = [r for r in rows if isinstance(r.get("loss"), (int, float))]
        evals = [r["eval_loss"] for r in rows if isinstance(r.get("eval_loss"), (int, float))]
        steps = [r["step"] for r in rows if isinstance(r.get("step"), int)]
        if losses:
            out.setdefault("train_loss", losses[-1]["loss"])
        if evals:
            out.setdefault("eval_loss", min(evals))
        if steps:
            out.setdefault("steps", max(steps))
        tps = [r["tokens_per_second"] for r in losses if isinstance(r.get("tokens_per_second"), (int, float))]
        if tps:
            out.setdefault("tokens_per_second", sum(tps) / len(tps))
    return out


def card_metadata(recipe: Recipe, *, kind: Kind, license: str | None = None,
                  base_model: str | None = None) -> dict:
    """The YAML front matter the Hub indexes (base_model, library_name, tags, datasets, license)."""
    base = base_model or recipe.model.name
    adapter = "full" if kind == "full" else recipe.adapter.type
    tags = ["finetune", recipe.method.type, adapter]
    if recipe.adapter.dora and adapter != "full":
        tags.append("dora")
    tags.append("trl")
    if kind == "merged":
        tags.append("merged")
    meta: dict = {}
    if is_hub_id(base):
        meta["base_model"] = base
    meta["library_name"] = "peft" if kind == "adapter" else "transformers"
    meta["pipeline_tag"] = "text-generation"
    meta["tags"] = tags
    datasets = [s.path for s in recipe.data.sources + recipe.data.eval_sources if is_hub_id(s.path)]
    if datasets:
        meta["datasets"] = list(dict.fromkeys(datasets))
    if license:
        meta["license"] = license
    return meta


def _fmt(key: str, value: float) -> str:
    if key in ("steps", "train_tokens"):
        return f"{int(value):,}"
    if key == "tokens_per_second":
        return f"{value:,.1f}"
    return f"{value:.4f}"  # losses


def _adapter_line(recipe: Recipe, kind: Kind) -> str:
    a = recipe.adapter
    if kind == "full" or a.type == "full":
        return "full fine-tune (all weights trained)"
    targets = a.target_modules
    if targets is None and recipe.resolved is not None:
        targets = recipe.resolved.lora_targets
    shown = targets if isinstance(targets, str) else ", ".join(targets or []) or "registry default"
    extras = [x for x, on in (("DoRA", a.dora), ("rsLoRA", a.rslora)) if on]
    line = f"{'QLoRA' if a.type == 'qlora' else 'LoRA'} r={a.r}, alpha={a.alpha:g}, dropout={a.dropout:g}"
    line += f", targets: {shown}" + (f" ({', '.join(extras)})" if extras else "")
    if a.type == "qlora":
        line += (f"; base quantized to {a.quant_type}{' (double quant)' if a.double_quant else ''}, "
                 f"compute dtype {a.compute_dtype}")
    if kind == "merged":
        line += "; merged into the base weights"
    return line


def _usage(repo_id: str, kind: Kind, base: str) -> str:
    if kind == "adapter":
        note = "" if is_hub_id(base) else (
            "\nThe base model was a local directory: set `base_model_name_or_path` in "
            "`adapter_config.json` to where others can load it from.\n")
        return (
            "```python\n"
            "from peft import AutoPeftModelForCausalLM\n"
            "from transformers import AutoTokenizer\n\n"
            f'model = AutoPeftModelForCausalLM.from_pretrained("{repo_id}")  # loads {base} + this adapter\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
            "```\n\n"
            "To fold the adapter into the base weights: `finetune merge RUN_DIR -o OUT_DIR`, or "
            "`model.merge_and_unload()` in peft.\n" + note)
    return (
        "```python\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f'model = AutoModelForCausalLM.from_pretrained("{repo_id}", dtype="auto")\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
        "```\n")


def recipe_excerpt(recipe: Recipe) -> str:
    """The settings the recipe chose (non-defaults) of the sections that define the model."""
    dumped = recipe.model_dump(mode="json", exclude_defaults=True, exclude_none=True)
    keep = {k: dumped[k] for k in ("model", "method", "adapter", "data", "train", "distributed")
            if dumped.get(k)}
    return yaml.safe_dump(keep, sort_keys=False).rstrip()


def render_model_card(recipe: Recipe, *, run_dir: Path, repo_id: str, kind: Kind,
                      license: str | None = None, base_model: str | None = None) -> str:
    """README.md text: YAML front matter + what was trained, where, how well, and how to load it."""
    base = base_model or recipe.model.name
    meta = card_metadata(recipe, kind=kind, license=license, base_model=base)
    stats = training_summary(run_dir)
    m = recipe.method
    what = {"adapter": "a LoRA adapter for", "merged": "a fine-tune (adapter merged) of",
            "full": "a full fine-tune of"}[kind]
    base_link = f"[{base}](https://huggingface.co/{base})" if is_hub_id(base) else f"`{base}`"
    method = "SFT (supervised fine-tuning)" if m.type == "sft" else (
        f"DPO (beta={m.beta:g}, loss {m.loss_type})")
    rows = [("method", method), ("adapter", _adapter_line(recipe, kind))]
    rows.append(("data", "; ".join(f"{s.path} ({s.format})" for s in recipe.data.sources)))
    t = recipe.train
    length = f"{t.max_steps} steps" if t.max_steps else f"{t.epochs or 1:g} epochs"
    rows.append(("schedule", f"{length}, lr {t.lr:g} ({t.scheduler}), global batch "
                             f"{t.global_batch_size}, max length {recipe.data.max_length}, "
                             f"precision {t.precision}"))
    res = recipe.resolved
    if res is not None:
        gpus = "CPU" if res.device == "cpu" else (
            f"{res.world_size} GPU{'s' if res.world_size != 1 else ''}"
            f" ({res.num_nodes} node{'s' if res.num_nodes != 1 else ''} x {res.gpus_per_node})")
        rows.append(("hardware", f"{res.hardware}: {gpus}"))
    rows.append(("strategy", recipe.distributed.strategy))
    labels = {"steps": "steps", "train_tokens": "training tokens", "train_loss": "final train loss",
              "eval_loss": "best eval loss", "tokens_per_second": "throughput (tokens/s)"}
    for key, label in labels.items():
        if key in stats:
            rows.append((label, _fmt(key, stats[key])))

    name = repo_id.split("/")[-1]
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).rstrip(), "---", "",
             f"# {name}", "",
             f"This is {what} {base_link}, trained with "
             "`finetune` (a YAML recipe run on TRL, PEFT and Accelerate).", "",
             "## Training", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows]
    if (run_dir / rundir.LOSS_PNG).is_file():
        lines += ["", "## Loss curve", "", f"![training loss]({rundir.LOSS_PNG})"]
    lines += ["", "## Recipe", "",
              "The settings the recipe chose are below; the complete recipe, with every default and "
              f"planner decision, is `{rundir.RESOLVED_RECIPE}` in this repository.", "",
              "```yaml", recipe_excerpt(recipe), "```", "",
              "## How to use", "", _usage(repo_id, kind, base)]
    return "\n".join(lines)


def parse_front_matter(text: str) -> dict:
    """The YAML metadata of a model card (used by tests and by `license_of_local_model`)."""
    m = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    if not m:
        return {}
    data = yaml.safe_load(m.group(1))
    return data if isinstance(data, dict) else {}
