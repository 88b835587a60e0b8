"""Trainer callbacks: metrics.jsonl + loss.png (rank 0), checkpoint commit, the non-finite policy."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from transformers import TrainerCallback

from finetune import rundir
from finetune.errors import TrainingFailed

log = logging.getLogger("finetune.train")


def peak_memory_gib() -> float:
    """GPU: torch's peak allocated bytes; CPU: the process's peak resident set."""
    from finetune.train.memory_report import memory_figures

    figures = memory_figures()
    return figures.get("gpu_max_allocated_gib", figures["host_rss_peak_gib"])


def ema(values: list[float], weight: float) -> list[float]:
    """Exponential moving average with bias correction (as TensorBoard draws it): early points are
    not pulled toward zero."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**i) if weight else v)
    return out


def plot_loss(rows: list[dict], out: Path, **options) -> None:
    """Write loss.png (see loss_figure for the options)."""
    import matplotlib.pyplot as plt

    fig = loss_figure(rows, **options)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def loss_figure(rows: list[dict], *, title: str | None = None, log_scale: bool = False, smoothing: float = 0.9):
    """Raw train loss faint, its EMA (logging.loss_smoothing) solid, eval loss as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [
        (r["step"], r["loss"]) for r in rows if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])
    ]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if train:
        steps, losses = zip(*train)
        smooth = smoothing > 0 and len(train) > 2
        ax.plot(
            steps,
            losses,
            color="C0",
            alpha=0.3 if smooth else 1.0,
            linewidth=0.8,
            label="train loss" + (" (raw)" if smooth else ""),
        )
        if smooth:
            ax.plot(
                steps, ema(list(losses), smoothing), color="C0", linewidth=1.8, label=f"train loss (EMA {smoothing:g})"
            )
    if evals:
        ax.plot(*zip(*evals), "o-", color="C1", label="eval loss")
    if log_scale:
        from matplotlib.ticker import LogFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    if title:
        ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("loss" + (" (log scale)" if log_scale else ""))
    ax.grid(alpha=0.3, which="both" if log_scale else "major")
    if train or evals:
        ax.legend()
    fig.tight_layout()
    return fig


def plot_title(recipe, run_dir: Path) -> str:
    """model · method/adapter · run name, for loss.png."""
    from finetune.trackers import run_name

    model = Path(recipe.model.name).name if Path(recipe.model.name).is_absolute() else recipe.model.name
    return f"{model} · {recipe.method.type} {recipe.adapter.type} · {run_name(recipe, run_dir)}"


class LibraryCardCallback(TrainerCallback):
    """TRL writes a template model card into checkpoints/ with every checkpoint; remove exactly that
    file (the card a push publishes is finetune's own)."""

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            from finetune.modelcard import remove_library_card

            remove_library_card(Path(args.output_dir), made_by="trl")


class MetricsCallback(TrainerCallback):
    """One JSON object per logged step in RUN_DIR/metrics.jsonl; loss.png at evals and at the end."""

    TRAIN_KEYS = ("loss", "learning_rate", "grad_norm", "epoch")
    # what TRL's trainers add to a training log when they compute it (SFT: token entropy and accuracy,
    # tokens trained so far; MoE: the router's auxiliary loss)
    TRL_TRAIN_KEYS = ("entropy", "mean_token_accuracy", "num_tokens", "aux_loss")

    def __init__(self, run_dir: Path, *, recipe=None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / rundir.METRICS
        self.png = self.run_dir / rundir.LOSS_PNG
        self.plot = (
            {}
            if recipe is None
            else {
                "title": plot_title(recipe, self.run_dir),
                "log_scale": recipe.logging.loss_log_scale,
                "smoothing": recipe.logging.loss_smoothing,
            }
        )
        self._last = (time.perf_counter(), 0)
        self._began = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self._began = time.perf_counter()
        self._last = (self._began, state.num_input_tokens_seen or 0)
        if state.is_world_process_zero:
            # On resume keep the rows up to the checkpoint's step; later ones are re-run.
            rows = [r for r in rundir.read_metrics(self.run_dir) if r.get("step", 0) <= state.global_step]
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
            row.update({k: logs[k] for k in self.TRL_TRAIN_KEYS if k in logs})
            now, seen = time.perf_counter(), state.num_input_tokens_seen or 0
            elapsed = now - self._last[0]
            row["tokens_per_second"] = (seen - self._last[1]) / elapsed if seen and elapsed > 0 else None
            self._last = (now, seen)
            # cumulative figures: throughput over any window of steps (e.g. past warm-up) is a difference
            row["tokens_seen"] = seen
            row["elapsed_s"] = round(now - self._began, 3)
            row["peak_memory_gib"] = round(peak_memory_gib(), 4)
            row.update({k: v for k, v in logs.items() if k.startswith("rewards/")})  # DPO margins/accuracies
        else:
            return  # the final train_runtime summary row goes to summary.json instead
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")

    def on_evaluate(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            plot_loss(rundir.read_metrics(self.run_dir), self.png, **self.plot)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            plot_loss(rundir.read_metrics(self.run_dir), self.png, **self.plot)


def reduce_flags(flags: list) -> list[float]:
    """Element-wise max over all ranks (the flags are the same on every rank afterwards); no-op
    when there is one process. Every rank must call it at the same point, or the job hangs.

    A flag is a number or a 0-dim tensor (a device-side verdict such as `sums_not_finite`'s). The ranks'
    flags meet in one device tensor filled in place (a number is a kernel argument, a tensor a device
    copy), so the one host sync is reading the reduced flags back, not building them."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [float(f) for f in flags]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.zeros(len(flags), dtype=torch.float32, device=device)
    for i, flag in enumerate(flags):
        if isinstance(flag, torch.Tensor) or flag:
            tensor[i] = flag
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class CommitCallback(TrainerCallback):
    """Marks a checkpoint complete once every rank has written its part, then applies retention.

    on_save runs on every rank after the Trainer wrote checkpoint-N: a barrier (all parts are
    written), the marker on the saving process (fsync of every file, then the marker atomically),
    our retention (the Trainer's save_total_limit is off so it never deletes what resume relies on),
    and a second barrier so that no rank exits (e.g. on preemption) before the commit is durable.
    """

    def __init__(self, run_dir: Path, *, fields: dict, strategy: str, keep: int):
        self.run_dir, self.fields, self.strategy, self.keep = Path(run_dir), fields, strategy, keep

    def on_save(self, args, state, control, **kwargs):
        from finetune.checkpoints.marker import write_marker
        from finetune.checkpoints.retention import retain

        barrier()
        if args.should_save:
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            write_marker(
                ckpt, step=state.global_step, world_size=rank_and_world()[1], strategy=self.strategy, fields=self.fields
            )
            removed = retain(self.run_dir, keep=self.keep, protect=state.best_model_checkpoint)
            log.info(
                f"checkpoint {ckpt.name} complete"
                + (f"; removed {', '.join(p.name for p in removed)} (output.keep={self.keep})" if removed else "")
            )
        barrier()


def sums_not_finite(tensors: list):
    """1.0 where some tensor's sum is not finite, else 0.0: a 0-dim tensor on the first tensor's device,
    computed without waiting for the GPU (0.0 as a number when there are no tensors).

    A NaN or an infinity anywhere makes a tensor's sum non-finite, and a sum is one vectorized read;
    `isfinite(g).all()` is several passes with temporaries, 20x slower on a CPU core: on offloaded (host)
    gradients it took 6.3 s of a 9.6 s step (full 3B, FSDP2 CPU offload, H100 profile in
    docs/results/profiles/full3b-fsdp2-offload-h100x2.txt). A sum of finite values can overflow too, so a
    non-finite sum is only a suspicion: `all_finite` then tests the elements themselves."""
    import torch

    by_device: dict = {}
    for g in tensors:
        by_device.setdefault(g.device, []).append(g.sum())
    verdict = None
    for sums in by_device.values():
        bad = (~torch.isfinite(torch.stack(sums).float())).any().float()
        verdict = bad if verdict is None else torch.maximum(verdict, bad.to(verdict.device))
    return 0.0 if verdict is None else verdict


def all_finite(tensors: list) -> bool:
    """Whether every element of `tensors` is finite (one host sync when the sums are finite)."""
    return not float(sums_not_finite(tensors)) or elements_finite(tensors)


def elements_finite(tensors: list) -> bool:
    """Whether every element is finite, tested element by element: the exact answer where a sum was not."""
    import torch

    return all(bool(torch.isfinite(g).all()) for g in tensors)


def nonfinite_gradients_named(named_grads: list) -> str:
    """Which of (name, gradient) hold a NaN or an infinity, in the model's order: how many, the first and the last.
    A non-finite value made in the backward reaches every layer below the one that made it, so the last named (the
    deepest layer) is where to look first; one made in the forward reaches them all."""
    import torch

    bad = [name for name, g in named_grads if not bool(torch.isfinite(g).all())]
    if not bad:
        return "no gradient of this rank holds a non-finite value"
    span = bad[0] if len(bad) == 1 else f"from {bad[0]} to {bad[-1]}"
    return f"{len(bad)} of {len(named_grads)} trained tensors non-finite, {span}"


def is_deepspeed_optimizer(optimizer) -> bool:
    """Whether the Trainer's optimizer is accelerate's wrapper of a DeepSpeed one. DeepSpeed's engine steps
    inside accelerator.backward() (accelerate's DeepSpeedEngineWrapper), so by the Trainer's
    on_pre_optimizer_step the step is taken or skipped already, and p.grad is None (DeepSpeed keeps the
    gradients in its own partitions)."""
    from accelerate.utils import DeepSpeedOptimizerWrapper

    return isinstance(optimizer, DeepSpeedOptimizerWrapper)


# the most a step's kept micro-batches may hold (they are on the GPU already: keeping them costs no copy, only memory
# until the next step); past it the step's earliest are let go
KEPT_MICRO_BATCH_BYTES = 64 * 2**20


def _nbytes(micro_batch) -> int:
    values = micro_batch.values() if isinstance(micro_batch, dict) else [micro_batch]
    return sum(getattr(v, "nbytes", 0) for v in values)


class KeepsStepMicroBatches:
    """Trainer mixin: the current optimizer step's micro-batches as the dataloader gave them (references, no copy;
    token ids are a few hundred KB each; at most KEPT_MICRO_BATCH_BYTES, the latest), for NonFiniteCallback to write
    when the step's gradients are not finite."""

    def training_step(self, model, inputs, *args, **kwargs):
        step = self.state.global_step
        if getattr(self, "_kept_step", None) != step:
            self._kept_step, self.step_micro_batches = step, []
        kept = self.step_micro_batches
        kept.append(inputs)
        held = sum(_nbytes(mb) for mb in kept)
        while len(kept) > 1 and held > KEPT_MICRO_BATCH_BYTES:
            held -= _nbytes(kept.pop(0))
        return super().training_step(model, inputs, *args, **kwargs)


def write_micro_batches(path: Path, micro_batches: list, *, step: int, rank: int) -> Path:
    """Write a step's micro-batches to `path` (torch.save; a temporary file renamed, so never half-written): their
    tensors on the CPU, other values as they are."""
    import os

    import torch

    def cpu(value):
        return value.detach().cpu() if isinstance(value, torch.Tensor) else value

    batches = [{k: cpu(v) for k, v in mb.items()} if isinstance(mb, dict) else cpu(mb) for mb in micro_batches]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save({"step": step, "rank": rank, "micro_batches": batches}, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no partial file behind
        raise
    return path


class NonFiniteCallback(TrainerCallback):
    """train.on_nonfinite for a non-finite loss or gradient on any rank.

    Checked at every optimizer step, and every rank comes to the same answer, so all of them skip or stop
    together (none is left in a collective). A bad step never updates the weights:
    - DDP/FSDP2: each rank checks its own gradients before the step and the ranks agree through one
      all-reduce; on a bad step every gradient is dropped (set to None), and torch's optimizers leave a
      parameter without a gradient untouched (no Adam moment decay, no weight decay).
    - DeepSpeed: the engine skipped the step itself (its gradient norm, reduced over all ranks, was not
      finite; ds_config's bf16.check_grad_overflow), before this hook runs; the callback reads that from
      accelerate's `step_was_skipped` and counts it.
    - fp16: the loss scaler (torch's GradScaler, DeepSpeed's dynamic scaler) skips a step whose gradients
      overflow and lowers the scale. That is routine, not a bad step: only a non-finite loss counts.
    `stop` then ends the run at the log of that step (naming the step, the rank where known, and the logged
    loss); `skip` goes on for up to train.max_bad_steps such steps and stops at the next. The logged loss
    and grad norm are checked too, in case a bad value left finite gradients (the loss only until it was
    first non-finite: the Trainer's logged loss stays NaN from then on, so under fp16 `skip` counts the
    first bad step only, and the loss scaler goes on skipping later ones).
    """

    def __init__(self, *, policy: str, max_bad_steps: int, run_dir: Path | None = None):
        self.policy, self.max_bad_steps, self.bad = policy, max_bad_steps, 0
        self.skipped: list[int] = []
        self.stopping: str | None = None
        self._last_logged = 0
        self._loss_was_nonfinite = False
        self.run_dir = run_dir  # where a bad step's micro-batches go (rundir.NONFINITE_DIR); None: not kept
        self.trainer = None  # the trainer whose step_micro_batches (KeepsStepMicroBatches) are written

    def keep_micro_batches(self, trainer) -> None:
        """Write a bad step's micro-batches from `trainer` (a KeepsStepMicroBatches) under run_dir."""
        self.trainer = trainer

    def _write_step(self, step: int, rank: int) -> str:
        """'; its micro-batches: PATH' once written, '' where there is nothing to write or it failed."""
        batches = getattr(self.trainer, "step_micro_batches", None)
        if self.run_dir is None or not batches:
            return ""
        path = Path(self.run_dir) / rundir.NONFINITE_DIR / f"step-{step}-rank-{rank}.pt"
        try:
            write_micro_batches(path, batches, step=step, rank=rank)
        except OSError as exc:  # a full disk must not hide the non-finite step itself
            log.warning(f"could not write the bad step's micro-batches to {path}: {exc}")
            return ""
        return f"; its micro-batches: {path}"

    def on_train_begin(self, args, state, control, **kwargs):
        self._last_logged = state.global_step
        self._loss_was_nonfinite = False

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        if args.fp16:
            return control  # the loss scaler skips overflowing steps; a non-finite loss is caught in on_log
        rank, world = rank_and_world()
        step = state.global_step + 1
        if is_deepspeed_optimizer(optimizer):
            # DeepSpeed's overflow flag: the same on every rank, so no collective here
            if optimizer.step_was_skipped:
                where = f"step {step} (DeepSpeed's gradients, reduced over {world} rank(s))"
                return self._bad_step(control, step, where + self._write_step(step, rank))
            return control
        named = [(n, p) for n, p in model.named_parameters() if p.grad is not None] if model is not None else []
        params = [p for _, p in named]
        grads = [
            p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # FSDP2: this rank's shard
            for p in params
        ]
        # one host sync a step on every rank: the sums' verdicts meet on the device and are read back once;
        # only where a sum was not finite do the ranks agree again on the elements themselves
        flags: list = [0.0] * world
        flags[rank] = sums_not_finite(grads)
        flags = reduce_flags(flags)
        if not any(flags):
            return control
        suspect = flags[rank]
        flags = [0.0] * world
        flags[rank] = 1.0 if suspect and not elements_finite(grads) else 0.0
        flags = reduce_flags(flags)
        if not any(flags):
            return control
        ranks = ",".join(str(r) for r, f in enumerate(flags) if f)
        where = f"step {step} (rank {ranks} of {world})"
        if flags[rank]:
            where += "; " + nonfinite_gradients_named([(n, g) for (n, _), g in zip(named, grads)])
            where += self._write_step(step, rank)
        for p in params:
            p.grad = None  # the optimizer skips it: this step changes no weight
        return self._bad_step(control, step, where)

    def _bad_step(self, control, step: int, where: str):
        """Count a skipped step; past the policy's allowance, stop at this step's log."""
        self.bad += 1
        if self.policy == "skip" and self.bad <= self.max_bad_steps:
            self.skipped.append(step)
            log.warning(
                f"non-finite gradients at {where}: step skipped, weights unchanged "
                f"({self.bad} of train.max_bad_steps={self.max_bad_steps})"
            )
            return control
        self.stopping = where
        control.should_log = True  # log this step now: on_log stops the run with the loss it saw
        control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs and "grad_norm" not in logs:
            return
        window = (self._last_logged, state.global_step)
        self._last_logged = state.global_step
        # fp16: a non-finite grad norm is the loss scaler's skipped step (on_pre_optimizer_step)
        keys = ("loss",) if args.fp16 else ("loss", "grad_norm")
        bad = {k: logs[k] for k in keys if isinstance(logs.get(k), (int, float)) and not math.isfinite(logs[k])}
        if self.stopping is None:
            # once the Trainer's running loss sum has taken a NaN it keeps it (its reset is `tr_loss -= tr_loss`),
            # so every later log's loss is NaN too and says nothing about later steps
            fresh = {k: v for k, v in bad.items() if k != "loss" or not self._loss_was_nonfinite}
            self._loss_was_nonfinite = self._loss_was_nonfinite or "loss" in bad
            if not fresh or any(window[0] < s <= window[1] for s in self.skipped):
                return  # finite, or the non-finite average includes a step that was already skipped
            self.bad += 1
            if self.policy == "skip" and self.bad <= self.max_bad_steps:
                return
            rank, world = rank_and_world()
            self.stopping = f"step {state.global_step} (rank {rank} of {world})"
        what = ", ".join(f"{k}={v}" for k, v in bad.items()) or "gradients"
        raise TrainingFailed(
            f"non-finite {what} at {self.stopping}; {self.bad} bad step(s), policy "
            f"train.on_nonfinite={self.policy}"
            + (f", max_bad_steps={self.max_bad_steps}" if self.policy == "skip" else ""),
            key="train.on_nonfinite",
            hint="lower train.lr, keep train.max_grad_norm > 0, use bf16 instead of fp16, or resume from the "
            "last checkpoint with --resume auto",
        )
