"""The model card (README.md) pushed with a run: Hub metadata up front, then how it was made.

Built with huggingface_hub's ModelCard / ModelCardData (the evaluation results become the Hub's
`model-index`) from files in RUN_DIR (recipe.resolved.yaml, summary.json, metrics.jsonl): no torch,
no network, and nothing from the environment, so no secret can end up in the card. Local paths never
do either: a data file or a base-model directory is shown by its name (`public_name`).

The libraries write template cards of their own (peft into RUN_DIR with the adapter, TRL into
checkpoints/ with every checkpoint); `remove_library_card` deletes exactly those.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Literal

import yaml

from finetune import rundir
from finetune.plan.workload import FUSED_EXPERT_WEIGHTS
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


def public_name(path: str) -> str:
    """A Hub id as it is; a local file or directory by its name only (no absolute paths in public)."""
    return path if is_hub_id(path) else Path(path).name


def public_recipe(recipe: Recipe, **dump_options) -> dict:
    """The recipe as JSON with every local path reduced to its name (the card and the uploaded
    recipe.resolved.yaml): model.name, data paths, a chat template file, output.dir; allow_paths,
    cache_dir and nvme_path dropped.
    `dump_options` go to model_dump (e.g. exclude_defaults=True)."""
    data = recipe.model_dump(mode="json", **dump_options)
    if data.get("model", {}).get("name"):
        data["model"]["name"] = public_name(data["model"]["name"])
    d = data.get("data", {})
    for key in ("sources", "eval_sources"):
        for src in d.get(key) or []:
            if "path" in src:
                src["path"] = public_name(src["path"])
    if d.get("path"):
        d["path"] = public_name(d["path"])
    if (d.get("task_eval") or {}).get("path"):
        d["task_eval"]["path"] = public_name(d["task_eval"]["path"])
    if str(d.get("chat_template") or "").endswith(".jinja"):  # a template file, not template text
        d["chat_template"] = Path(d["chat_template"]).name
    d.pop("allow_paths", None)
    d.pop("cache_dir", None)
    if (data.get("output") or {}).get("dir"):
        data["output"]["dir"] = Path(data["output"]["dir"]).name
    (data.get("distributed") or {}).pop("nvme_path", None)
    return data


def remove_library_card(directory: Path, *, made_by: str) -> bool:
    """Delete DIRECTORY/README.md when it is the template card peft (`made_by="peft"`) or TRL
    (`"trl"`) writes; any other README.md is kept. True when one was removed."""
    path = Path(directory) / rundir.MODEL_CARD
    if not path.is_file():
        return False
    text = path.read_text(errors="replace")
    meta = parse_front_matter(text)
    ours = {
        "peft": meta.get("library_name") == "peft" and "### Framework versions" in text,
        "trl": "trained using [TRL](https://github.com/huggingface/trl)" in text,
    }[made_by]
    if ours:
        path.unlink()
    return ours


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


def card_metadata(recipe: Recipe, *, kind: Kind, license: str | None = None, base_model: str | None = None) -> dict:
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
    if a.target_experts:
        layers = "every MoE layer" if a.target_experts is True else "layers " + ", ".join(map(str, a.target_experts))
        shown += f" and the routed experts' fused weights ({', '.join(FUSED_EXPERT_WEIGHTS)}) of {layers}"
    extras = [x for x, on in (("DoRA", a.dora), ("rsLoRA", a.rslora)) if on]
    line = f"{'QLoRA' if a.type == 'qlora' else 'LoRA'} r={a.r}, alpha={a.alpha:g}, dropout={a.dropout:g}"
    line += f", targets: {shown}" + (f" ({', '.join(extras)})" if extras else "")
    if a.type == "qlora":
        line += (
            f"; base quantized to {a.quant_type}{' (double quant)' if a.double_quant else ''}, "
            f"compute dtype {a.compute_dtype}"
        )
    if kind == "merged":
        line += "; merged into the base weights"
    return line


def _usage(repo_id: str, kind: Kind, base: str) -> str:
    base = public_name(base)
    if kind == "adapter":
        note = (
            ""
            if is_hub_id(base)
            else (
                "\nThe base model was a local directory: set `base_model_name_or_path` in "
                "`adapter_config.json` to where others can load it from.\n"
            )
        )
        return (
            "```python\n"
            "from peft import AutoPeftModelForCausalLM\n"
            "from transformers import AutoTokenizer\n\n"
            f'model = AutoPeftModelForCausalLM.from_pretrained("{repo_id}")  # loads {base} + this adapter\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
            "```\n\n"
            "To fold the adapter into the base weights: `finetune merge RUN_DIR -o OUT_DIR`, or "
            "`model.merge_and_unload()` in peft.\n" + note
        )
    return (
        "```python\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f'model = AutoModelForCausalLM.from_pretrained("{repo_id}", dtype="auto")\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")\n'
        "```\n"
    )


def recipe_excerpt(recipe: Recipe) -> str:
    """The settings the recipe chose (non-defaults) of the sections that define the model, local
    paths shown by name."""
    dumped = public_recipe(recipe, exclude_defaults=True, exclude_none=True)
    keep = {k: dumped[k] for k in ("model", "method", "adapter", "data", "train", "distributed") if dumped.get(k)}
    return yaml.safe_dump(keep, sort_keys=False).rstrip()


def eval_results(recipe: Recipe, summary: dict) -> list:
    """huggingface_hub EvalResults (the card's model-index) for the trained model: eval loss on the
    eval data, exact match on data.task_eval, and each lm-eval task metric."""
    from huggingface_hub import EvalResult

    out = []
    evals = ", ".join(public_name(s.path) for s in recipe.data.eval_sources) or "held-out split of the training data"
    loss = summary.get(rundir.SUMMARY_EVAL_AFTER)
    if isinstance(loss, (int, float)) and math.isfinite(loss):
        out.append(
            EvalResult(
                task_type="text-generation",
                dataset_type=evals,
                dataset_name=evals,
                metric_type="loss",
                metric_name="eval loss",
                metric_value=round(loss, 4),
            )
        )
    task = summary.get(rundir.SUMMARY_TASK_EVAL_AFTER)
    if isinstance(task, dict) and recipe.data.task_eval is not None:
        name = public_name(recipe.data.task_eval.path)
        out.append(
            EvalResult(
                task_type="text-generation",
                dataset_type=name,
                dataset_name=name,
                metric_type="exact_match",
                metric_name=f"exact match ({task.get('n')} examples)",
                metric_value=round(task["exact_match"], 4),
            )
        )
    for task_name, metrics in (summary.get(rundir.SUMMARY_LM_EVAL) or {}).get("results", {}).items():
        for metric, values in metrics.items():
            value = values.get("trained")
            if isinstance(value, (int, float)):
                out.append(
                    EvalResult(
                        task_type="text-generation",
                        dataset_type=task_name,
                        dataset_name=task_name,
                        metric_type=metric.split(",")[0],
                        metric_name=f"{metric} (lm-eval)",
                        metric_value=round(value, 4),
                        source_name="lm-evaluation-harness",
                        source_url="https://github.com/EleutherAI/lm-evaluation-harness",
                    )
                )
    return out


def _evaluation_lines(recipe: Recipe, summary: dict) -> list[str]:
    """Before/after table of eval loss, task exact match and lm-eval metrics (only what was measured)."""
    rows = []

    def num(x, spec=".4f"):
        return format(x, spec) if isinstance(x, (int, float)) and math.isfinite(x) else "-"

    if isinstance(summary.get(rundir.SUMMARY_EVAL_AFTER), (int, float)):
        rows.append(
            (
                "eval loss (lower is better)",
                num(summary.get("eval_loss_before")),
                num(summary[rundir.SUMMARY_EVAL_AFTER]),
            )
        )
    before, after = summary.get(rundir.SUMMARY_TASK_EVAL_BEFORE), summary.get(rundir.SUMMARY_TASK_EVAL_AFTER)
    if isinstance(after, dict):
        rows.append(
            (
                f"exact match, {after.get('n')} held-out examples",
                num((before or {}).get("exact_match"), ".1%"),
                num(after.get("exact_match"), ".1%"),
            )
        )
    lm = summary.get(rundir.SUMMARY_LM_EVAL) or {}
    for task_name, metrics in lm.get("results", {}).items():
        for metric, values in metrics.items():
            rows.append((f"{task_name} {metric} (lm-eval)", num(values.get("base")), num(values.get("trained"))))
    if not rows:
        return []
    lines = ["", "## Evaluation", "", "| | base model | this model |", "|---|---|---|"]
    lines += [f"| {name.replace('|', '/')} | {b} | {a} |" for name, b, a in rows]
    if lm:
        shots = lm.get("num_fewshot")
        lines += [
            "",
            f"lm-evaluation-harness {lm.get('version', '')}".rstrip()
            + (f", {shots}-shot" if shots is not None else "")
            + (f", first {lm['limit']} examples per task" if lm.get("limit") else "")
            + ".",
        ]
    return lines


def _versions_lines(summary: dict) -> list[str]:
    from finetune.envreport import package_version

    versions = summary.get(rundir.SUMMARY_VERSIONS) or {
        name: package_version(name)
        for name in ("finetune", "torch", "transformers", "trl", "peft", "accelerate", "datasets")
    }
    shown = [f"- {name} {version}" for name, version in versions.items() if version]
    return ["", "## Framework versions", "", *shown] if shown else []


def render_model_card(
    recipe: Recipe,
    *,
    run_dir: Path,
    repo_id: str,
    kind: Kind,
    license: str | None = None,
    base_model: str | None = None,
) -> str:
    """README.md text: YAML metadata (with model-index) + what was trained, how well, how to load it."""
    from huggingface_hub import ModelCard, ModelCardData

    base = base_model or recipe.model.name
    summary = rundir.read_summary(run_dir)
    name = repo_id.split("/")[-1]
    meta = card_metadata(recipe, kind=kind, license=license, base_model=base)
    results = eval_results(recipe, summary)
    data = ModelCardData(**meta, model_name=name if results else None, eval_results=results or None)
    stats = training_summary(run_dir)
    m = recipe.method
    what = {
        "adapter": "a LoRA adapter for",
        "merged": "a fine-tune (adapter merged) of",
        "full": "a full fine-tune of",
    }[kind]
    base_link = f"[{base}](https://huggingface.co/{base})" if is_hub_id(base) else f"`{public_name(base)}`"
    method = "SFT (supervised fine-tuning)" if m.type == "sft" else (f"DPO (beta={m.beta:g}, loss {m.loss_type})")
    rows = [("method", method), ("adapter", _adapter_line(recipe, kind))]
    rows.append(("data", "; ".join(f"{public_name(s.path)} ({s.format})" for s in recipe.data.sources)))
    t = recipe.train
    length = f"{t.max_steps} steps" if t.max_steps else f"{t.epochs or 1:g} epochs"
    rows.append(
        (
            "schedule",
            f"{length}, lr {t.lr:g} ({t.scheduler}), global batch "
            f"{t.global_batch_size}, max length {recipe.data.max_length}, "
            f"precision {t.precision}",
        )
    )
    res = recipe.resolved
    if res is not None:
        gpus = (
            "CPU"
            if res.device == "cpu"
            else (
                f"{res.world_size} GPU{'s' if res.world_size != 1 else ''}"
                f" ({res.num_nodes} node{'s' if res.num_nodes != 1 else ''} x {res.gpus_per_node})"
            )
        )
        rows.append(("hardware", f"{res.hardware}: {gpus}"))
    rows.append(("strategy", recipe.distributed.strategy))
    labels = {
        "steps": "steps",
        "train_tokens": "training tokens",
        "train_loss": "final train loss",
        "eval_loss": "best eval loss",
        "tokens_per_second": "throughput (tokens/s)",
    }
    for key, label in labels.items():
        if key in stats:
            rows.append((label, _fmt(key, stats[key])))

    lines = [
        f"# {name}",
        "",
        f"This is {what} {base_link}, trained with `finetune` (a YAML recipe run on TRL, PEFT and Accelerate).",
        "",
        "## Training",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows]
    lines += _evaluation_lines(recipe, summary)
    if (run_dir / rundir.LOSS_PNG).is_file():
        lines += ["", "## Loss curve", "", f"![training loss]({rundir.LOSS_PNG})"]
    lines += [
        "",
        "## Recipe",
        "",
        "The settings the recipe chose are below; the complete recipe, with every default and "
        f"planner decision, is `{rundir.RESOLVED_RECIPE}` in this repository.",
        "",
        "```yaml",
        recipe_excerpt(recipe),
        "```",
        "",
        "## How to use",
        "",
        _usage(repo_id, kind, base),
    ]
    lines += _versions_lines(summary)
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")
    return str(card)


def parse_front_matter(text: str) -> dict:
    """The YAML metadata of a model card (used by tests and by `license_of_local_model`)."""
    m = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    if not m:
        return {}
    data = yaml.safe_load(m.group(1))
    return data if isinstance(data, dict) else {}
