"""Trainer callbacks: metrics.jsonl + loss.png (rank 0), and the non-finite loss policy."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from transformers import TrainerCallback

from finetune.errors import TrainingFailed


def peak_memory_gib() -> float:
    """GPU: torch's peak allocated bytes; CPU: the process's peak resident set."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # ru_maxrss is KiB on Linux


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


class MetricsCallback(TrainerCallback):
    """One JSON object per logged step in RUN_DIR/metrics.jsonl; loss.png at evals and at the end."""

    TRAIN_KEYS = ("loss", "learning_rate", "grad_norm", "epoch")

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.png = Path(run_dir) / "loss.png"
        self._last = (time.perf_counter(), 0)

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = (time.perf_counter(), state.num_input_tokens_seen or 0)
        if state.is_world_process_zero:
            # On resume keep the rows up to the checkpoint's step; later ones are re-run.
            rows = [r for r in read_metrics(self.path) if r.get("step", 0) <= state.global_step]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        row = {"step": state.global_step}
        if "eval_loss" in logs:
            row.update({k: v for k, v in logs.items() if k.startswith("eval_")})
            row["epoch"] = logs.get("epoch", state.epoch)
        elif "loss" in logs:
            row.update({k: logs.get(k) for k in self.TRAIN_KEYS})
            now, seen = time.perf_counter(), state.num_input_tokens_seen or 0
            elapsed = now - self._last[0]
            row["tokens_per_second"] = (seen - self._last[1]) / elapsed if seen and elapsed > 0 else None
            self._last = (now, seen)
            row["peak_memory_gib"] = round(peak_memory_gib(), 4)
            row.update({k: v for k, v in logs.items() if k.startswith("rewards/")})  # DPO margins/accuracies
        else:
            return  # the final train_runtime summary row goes to summary.json instead
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")

    def on_evaluate(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            plot_loss(read_metrics(self.path), self.png)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            plot_loss(read_metrics(self.path), self.png)


class NonFiniteCallback(TrainerCallback):
    """train.on_nonfinite: `stop` at the first non-finite loss or grad norm; `skip` tolerates up to
    train.max_bad_steps of them, then stops. The logged loss is already averaged over all ranks, so
    every rank sees the same value and stops together (no rank is left waiting in a collective)."""

    def __init__(self, *, policy: str, max_bad_steps: int):
        self.policy, self.max_bad_steps, self.bad = policy, max_bad_steps, 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        bad = {k: logs[k] for k in ("loss", "grad_norm")
               if isinstance((logs or {}).get(k), (int, float)) and not math.isfinite(logs[k])}
        if not bad:
            return
        self.bad += 1
        what = ", ".join(f"{k}={v}" for k, v in bad.items())
        if self.policy == "skip" and self.bad <= self.max_bad_steps:
            return
        from accelerate import PartialState

        ps = PartialState()
        raise TrainingFailed(
            f"non-finite {what} at step {state.global_step} (rank {ps.process_index} of {ps.num_processes}); "
            f"{self.bad} bad step(s), policy train.on_nonfinite={self.policy}",
            key="train.on_nonfinite",
            hint="lower train.lr, keep train.max_grad_norm > 0, use bf16 instead of fp16, or resume from the "
                 "last checkpoint with --resume auto")
