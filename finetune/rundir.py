"""The run directory's file names and their readers, once. Torch-free.

    RUN_DIR/
      recipe.resolved.yaml   every default and planner decision (the one artifact ranks read)
      plan.json              the planner's candidates and choice
      accelerate.yaml, ds_config.json, launch.sh, job.sbatch, launch.json
      metrics.jsonl          one JSON object per logged step (rank 0)
      summary.json           the figures of a finished run
      loss.png               the loss curve
      memory/rank-K.json     each rank's peak memory, rewritten at every logged step
      profile/               torch.profiler traces (logging.profile_steps)
      logs/                  launcher logs and the main rank's error (rank-error.json)
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
RANK_ERROR = f"{LOGS_DIR}/rank-error.json"  # the main rank's FinetuneError, read by the launching API
CHECKPOINTS = "checkpoints"  # the Trainer's checkpoint-N directories
OWNER = ".finetune-run.json"  # ownership marker: only directories carrying it are written into
FINISHED = "finished.json"  # a finished run's step and recipe fields (rerun detection)
PREVIOUS = "previous-run"  # a previous run's outputs, kept until the new run has replaced them
RESCUE_ENV = "FINETUNE_RESCUE_DIR"  # where a final save goes when RUN_DIR's disk is full

# summary.json keys that other parts read (the model card, the Hub push, benchmarks)
SUMMARY_STEPS = "steps"
SUMMARY_FIRST_LOSS = "first_train_loss"
SUMMARY_FINAL_LOSS = "final_train_loss"
SUMMARY_BEST_EVAL = "best_eval_loss"
SUMMARY_TOKENS = "tokens_seen"
SUMMARY_TOKENS_PER_S = "tokens_per_second"


def launch_log(node_rank: int) -> str:
    return f"{LOGS_DIR}/launch-node{node_rank}.log"


def lock_file(node_rank: int) -> str:
    """One lock per node: the nodes of one run share RUN_DIR, two runs of the same node may not."""
    return f".finetune-node{node_rank}.lock"


def memory_file(rank: int) -> str:
    return f"{MEMORY_DIR}/rank-{rank}.json"


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


def read_rank_error(run_dir: Path) -> dict:
    """{exit_code, message} written by the main rank for a FinetuneError, or {}."""
    return _read_json(Path(run_dir) / RANK_ERROR)


def write_rank_error(run_dir: Path, *, exit_code: int, message: str) -> None:
    path = Path(run_dir) / RANK_ERROR
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"exit_code": exit_code, "message": message}))


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
