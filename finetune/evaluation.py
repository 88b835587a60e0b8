"""`finetune eval RUN_DIR --tasks ...`: lm-evaluation-harness on the trained model and its base.

lm-eval (`pip install 'finetune[eval]'`) does the evaluation: its HFLM wraps the model we load (the
adapter on its base, or the merged/full model; see finetune.inference.load), and `simple_evaluate`
runs the tasks: lm-eval's own, or task YAMLs in a directory of yours (`--include-path`, e.g. a
local jsonl dataset; see docs/after-training.md). The base model is evaluated the same way unless
`base=False`, so the results come side by side.

Where results go: RUN_DIR/eval/{trained,base}.json (lm-eval's full results), summary.json's `lm_eval`
(task -> metric -> {base, trained}), a row in metrics.jsonl (lm_eval/TASK/METRIC at the run's last
step, for the trackers' readers), and the model card's model-index at the next `finetune push`.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from finetune import rundir
from finetune.errors import FinetuneError


class EvalError(FinetuneError):
    """lm-eval is missing, or a task cannot be found or run."""


def _task_manager(tasks: list[str], include_path: str | None):
    """lm-eval's TaskManager: only the include path when it holds every task (indexing lm-eval's
    own few thousand tasks takes tens of seconds), else the include path plus lm-eval's tasks."""
    from lm_eval.tasks import TaskManager

    if include_path:
        if not Path(include_path).is_dir():
            raise EvalError(
                "not a directory", file=str(include_path), hint="pass the directory that holds your task YAML files"
            )
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(task in local.all_tasks for task in tasks):
            return local
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise EvalError(
            f"unknown lm-eval task(s): {', '.join(unknown)}",
            key="--tasks",
            hint="see `lm-eval ls tasks`, or put your task YAML into a directory and pass --include-path DIR",
        )
    return manager


def scores(results: dict) -> dict[str, dict[str, float]]:
    """{task: {"metric,filter": value}} from lm-eval's results: the task's metrics only (no alias,
    stderr or sample count)."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in (results.get("results") or {}).items():
        known = (results.get("higher_is_better") or {}).get(task) or {}
        kept = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k.split(",")[0] in known and math.isfinite(v)
        }
        if kept:
            out[task] = kept
    return out


def _run_lm_eval(
    model, tokenizer, tasks: list[str], *, manager, num_fewshot, limit, batch_size, apply_chat_template: bool
) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    results = simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=manager,
        num_fewshot=num_fewshot,
        limit=limit,
        log_samples=False,
        apply_chat_template=apply_chat_template,
        bootstrap_iters=1000,
    )
    if results is None:  # a non-main process of a distributed lm-eval run; we run one process
        raise EvalError("lm-eval returned no results")
    return results


def evaluate(
    run_dir: str | Path,
    tasks: list[str] | str,
    *,
    include_path: str | Path | None = None,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    batch_size: int = 8,
    base: bool = True,
    merged: bool = False,
    apply_chat_template: bool = False,
    dtype: str | None = None,
) -> dict:
    """Run lm-eval `tasks` on RUN_DIR's model (and its base unless base=False); record the results
    (see the module docstring) and return summary.json's `lm_eval` entry."""
    if importlib.util.find_spec("lm_eval") is None:
        raise EvalError(
            "lm-evaluation-harness is not installed", hint="pip install 'finetune[eval]'  (or: pip install lm_eval)"
        )
    from finetune.inference import load, model_dir

    run_dir = Path(run_dir)
    tasks = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    if not tasks:
        raise EvalError("no tasks given", key="--tasks", hint="e.g. --tasks hellaswag,arc_easy")
    model_dir(run_dir, merged=merged)  # a clear error before lm-eval indexes its tasks
    manager = _task_manager(tasks, str(include_path) if include_path else None)
    options = dict(
        manager=manager,
        num_fewshot=num_fewshot,
        limit=limit,
        batch_size=batch_size,
        apply_chat_template=apply_chat_template,
    )
    labels = ["trained"] + (["base"] if base else [])
    raw: dict[str, dict] = {}
    for label in labels:
        model, tokenizer = load(run_dir, merged=merged, base_only=label == "base", dtype=dtype)
        raw[label] = _run_lm_eval(model, tokenizer, tasks, **options)
        del model
    per_label = {label: scores(raw[label]) for label in labels}
    table: dict[str, dict[str, dict]] = {}
    for task, metrics in per_label["trained"].items():
        table[task] = {
            m: {"base": per_label.get("base", {}).get(task, {}).get(m), "trained": v} for m, v in metrics.items()
        }
    from importlib.metadata import version

    entry = {
        "results": table,
        "tasks": tasks,
        "num_fewshot": num_fewshot,
        "limit": limit,
        "merged": merged,
        "chat_template": apply_chat_template,
        "version": version("lm_eval"),
    }
    _record(run_dir, raw, entry)
    return entry


def _record(run_dir: Path, raw: dict[str, dict], entry: dict) -> None:
    out = run_dir / rundir.EVAL_DIR
    out.mkdir(exist_ok=True)
    for label, results in raw.items():
        keep = {
            k: results.get(k) for k in ("results", "versions", "n-shot", "higher_is_better", "n-samples", "configs")
        }
        rundir.write_json_atomic(out / f"{label}.json", keep)
    rundir.update_summary(run_dir, {rundir.SUMMARY_LM_EVAL: entry})
    step = rundir.read_summary(run_dir).get(rundir.SUMMARY_STEPS) or 0
    row = {"step": step}
    for task, metrics in entry["results"].items():
        for metric, values in metrics.items():
            row[f"lm_eval/{task}/{metric}"] = values["trained"]
    with (run_dir / rundir.METRICS).open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def render_table(entry: dict) -> str:
    rows = [
        (task, metric, v.get("base"), v["trained"])
        for task, metrics in entry["results"].items()
        for metric, v in metrics.items()
    ]
    width = max([len(f"{t} {m}") for t, m, _, _ in rows] + [12])
    lines = [f"{'task metric':{width}}  {'base':>8}  {'trained':>8}  {'change':>8}"]
    for task, metric, before, after in rows:
        change = f"{after - before:+8.4f}" if before is not None else f"{'':8}"
        shown = f"{before:8.4f}" if before is not None else f"{'-':>8}"
        lines.append(f"{task + ' ' + metric:{width}}  {shown}  {after:8.4f}  {change}")
    shots = entry.get("num_fewshot")
    lines.append(
        f"lm-evaluation-harness {entry['version']}"
        + (f", {shots}-shot" if shots is not None else "")
        + (f", limit {entry['limit']}" if entry.get("limit") else "")
    )
    return "\n".join(lines)
