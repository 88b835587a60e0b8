"""The run directory's file names and their readers, once. Torch-free.

RUN_DIR/
  recipe.resolved.yaml   every default and planner decision (the one artifact ranks read)
  plan.json              the planner's candidates and choice
  accelerate.yaml, ds_config.json, launch.sh, job.sbatch, launch.json
  metrics.jsonl          one JSON object per logged step (rank 0)
  summary.json           the figures of a finished run
  loss.png               the loss curve
  memory/rank-K.json     each rank's peak memory, rewritten at every logged step
  profile/               torch.profiler traces (logging.profile_steps), memory peaks (memory_profile_step)
  tensorboard/, wandb/, mlruns/, trackio/   the trackers' own files (finetune/trackers.py)
  eval/                  `finetune eval`: lm-evaluation-harness results per model (base, trained)
  logs/                  launcher logs and the main rank's error (rank-error.json)
  logs/oom-rank-K.json   a rank that ran out of memory: its measured peak and the setting in force
  logs/oom-retries.json  what the launcher changed after each out-of-memory failure
  checkpoints/checkpoint-N
  .finetune-run.json     ownership marker: finetune created this directory and may write into it
  .finetune-node0.lock   held while a run of node 0 uses the directory (pid, host, heartbeat)
  finished.json          written last by a finished run: its step and recipe fields
  previous-run/          what a new run set aside (old metrics, summary, checkpoints) until it succeeds
"""

from __future__ import annotations

import json
from pathlib import Path

RESOLVED_RECIPE = "recipe.resolved.yaml"
PLAN_JSON = "plan.json"
ACCELERATE_YAML = "accelerate.yaml"
DS_CONFIG = "ds_config.json"
LAUNCH_SH = "launch.sh"
JOB_SBATCH = "job.sbatch"
LAUNCH_JSON = "launch.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
LOSS_PNG = "loss.png"
MEMORY_DIR = "memory"
PROFILE_DIR = "profile"
LOGS_DIR = "logs"
NONFINITE_DIR = "nonfinite"  # the micro-batches of a step whose gradients were not finite: step-N-rank-R.pt
RANK_ERROR = f"{LOGS_DIR}/rank-error.json"  # the main rank's FinetuneError, read by the launching API
CHECKPOINTS = "checkpoints"  # the Trainer's checkpoint-N directories
OOM_RETRIES = f"{LOGS_DIR}/oom-retries.json"  # the launcher's re-plans after out-of-memory failures
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"
TRACKIO_DIR = "trackio"
WANDB_DIR = "wandb"  # wandb writes under WANDB_DIR/wandb; WANDB_DIR is RUN_DIR
EVAL_DIR = "eval"  # `finetune eval`: eval/<label>.json, lm-eval's results per model
MODEL_CARD = "README.md"  # written by libraries' save_pretrained; finetune keeps none in RUN_DIR
OWNER = ".finetune-run.json"  # ownership marker: only directories carrying it are written into
FINISHED = "finished.json"  # a finished run's step and recipe fields (rerun detection)
PUSHED = "pushed.json"  # where the run's own push (its recipe's hub: section) went; a rerun pushes if absent
PREVIOUS = "previous-run"  # a previous run's outputs, kept until the new run has replaced them
RESCUE_ENV = "FINETUNE_RESCUE_DIR"  # where a final save goes when RUN_DIR's disk is full

# summary.json keys that other parts read (the model card, the Hub push, benchmarks)
SUMMARY_STEPS = "steps"
SUMMARY_FIRST_LOSS = "first_train_loss"
SUMMARY_FINAL_LOSS = "final_train_loss"
SUMMARY_BEST_EVAL = "best_eval_loss"
SUMMARY_TOKENS = "tokens_seen"
SUMMARY_TOKENS_PER_S = "tokens_per_second"
SUMMARY_EVAL_AFTER = "eval_loss_final"
SUMMARY_TASK_EVAL_BEFORE = "task_eval_before"
SUMMARY_TASK_EVAL_AFTER = "task_eval_after"
SUMMARY_VERSIONS = "versions"  # the stack the run trained with: {package: version}
SUMMARY_LM_EVAL = "lm_eval"  # `finetune eval`: {task: {metric: {"base": x, "trained": y}}} and its settings


def launch_log(node_rank: int) -> str:
    return f"{LOGS_DIR}/launch-node{node_rank}.log"


def lock_file(node_rank: int) -> str:
    """One lock per node: the nodes of one run share RUN_DIR, two runs of the same node may not."""
    return f".finetune-node{node_rank}.lock"


def memory_file(rank: int) -> str:
    return f"{MEMORY_DIR}/rank-{rank}.json"


def profile_stem(rank: int) -> str:
    """profile/rank-K: the profiler writes .trace.json.gz, .txt (tables) and .json (summary) after it,
    logging.memory_profile_step .memory.json (the peak's breakdown) and .memory.pickle.gz (the snapshot)."""
    return f"{PROFILE_DIR}/rank-{rank}"


def oom_record(rank: int) -> str:
    """Where rank `rank` records that it ran out of memory (finetune/train/oom.py)."""
    return f"{LOGS_DIR}/oom-rank-{rank}.json"


def read_oom_records(run_dir: Path) -> list[dict]:
    """Every rank's out-of-memory record of the last attempt, by rank ([] when none ran out)."""
    logs = Path(run_dir) / LOGS_DIR
    found = [_read_json(p) for p in sorted(logs.glob("oom-rank-*.json"))] if logs.is_dir() else []
    return sorted((r for r in found if "rank" in r), key=lambda r: r["rank"])


def clear_oom_records(run_dir: Path) -> None:
    """Before each attempt: a record left by an earlier attempt must not be read as this one's."""
    logs = Path(run_dir) / LOGS_DIR
    for path in logs.glob("oom-rank-*.json") if logs.is_dir() else ():
        path.unlink(missing_ok=True)


def read_memory_files(run_dir: Path) -> list[dict]:
    """Every rank's memory/rank-K.json (finetune/train/memory_report.py), by rank."""
    root = Path(run_dir) / MEMORY_DIR
    found = [_read_json(p) for p in sorted(root.glob("rank-*.json"))] if root.is_dir() else []
    return sorted((r for r in found if "rank" in r), key=lambda r: r["rank"])


def read_metrics(run_dir: Path) -> list[dict]:
    """Every complete row of RUN_DIR/metrics.jsonl (a line cut short by a crash is skipped: that step
    is re-run on resume); [] when there is none."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_summary(run_dir: Path) -> dict:
    """RUN_DIR/summary.json, or {} when it is missing or unreadable."""
    return _read_json(Path(run_dir) / SUMMARY)


def read_finished(run_dir: Path) -> dict:
    """RUN_DIR/finished.json ({step, recipe_fields}), or {} when the run has not finished."""
    return _read_json(Path(run_dir) / FINISHED)


def read_pushed(run_dir: Path) -> dict:
    """RUN_DIR/pushed.json ({repo, revision, merged, url}), or {} when the run's push has not completed."""
    return _read_json(Path(run_dir) / PUSHED)


def read_rank_error(run_dir: Path) -> dict:
    """{exit_code, message} written by the main rank for a FinetuneError, or {}."""
    return _read_json(Path(run_dir) / RANK_ERROR)


def write_rank_error(run_dir: Path, *, exit_code: int, message: str) -> None:
    path = Path(run_dir) / RANK_ERROR
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"exit_code": exit_code, "message": message}))


def write_json_atomic(path: Path, value) -> None:
    """Write JSON to a temporary sibling and rename it into place: a reader never sees half a file."""
    import os

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(value, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def update_summary(run_dir: Path, fields: dict) -> dict:
    """Merge `fields` into RUN_DIR/summary.json (written atomically); returns the new summary."""
    summary = {**read_summary(run_dir), **fields}
    write_json_atomic(Path(run_dir) / SUMMARY, summary)
    return summary


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
