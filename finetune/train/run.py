"""One rank's whole run: resolved recipe -> tokenizer -> preflight + data -> model -> TRL -> outputs.

`_run` is setup, train, finish in that order; everything a user must fix is raised as a FinetuneError
before the model is loaded (data) or before training starts (recipe).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from finetune import rundir, strategies
from finetune.checkpoints.fields import data_fields, recipe_fields
from finetune.checkpoints.resume import check_resume, resolve_resume
from finetune.checkpoints.retention import prepare_checkpoints
from finetune.compile.files import write_atomic
from finetune.recipe.load import load_resolved_recipe
from finetune.recipe.schema import Recipe
from finetune.train.callbacks import CommitCallback, LibraryCardCallback, MetricsCallback, NonFiniteCallback
from finetune.train.diskspace import DiskSpaceCallback, output_bytes, save_final

log = logging.getLogger("finetune.train")


def _setup_logging(is_main: bool) -> None:
    import datasets
    import transformers

    logging.basicConfig(format="[finetune] %(message)s", level=logging.INFO if is_main else logging.WARNING)
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    transformers.logging.set_verbosity_warning()
    datasets.disable_progress_bars()


# set (to anything) in the environment of `finetune run`: the ranks run their backward in torch's anomaly mode
DETECT_ANOMALY = "FINETUNE_DETECT_ANOMALY"


def run_rank(resolved_path: str | Path, *, resume: str = "auto", recipe: Recipe | None = None) -> dict | None:
    """Train one rank. Returns the summary on the main process (None elsewhere). `recipe`: the resolved recipe
    already loaded from `resolved_path` (the rank's entrypoint loads it before the libraries)."""
    if recipe is None:
        recipe = load_resolved_recipe(resolved_path)
    run_dir = Path(recipe.output.dir or Path(resolved_path).parent).resolve()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # forked dataloader workers otherwise warn

    from accelerate import PartialState
    from transformers import set_seed

    state = PartialState(
        cpu=recipe.resolved.device == "cpu", timeout=timedelta(minutes=recipe.distributed.timeout_minutes)
    )
    set_seed(recipe.train.seed)
    if os.environ.get(DETECT_ANOMALY):
        import torch

        # torch's anomaly mode: the first backward function that returns a NaN raises, naming itself, and the
        # forward's stack that made it is printed (several times slower: for finding a NaN, not for training)
        torch.autograd.set_detect_anomaly(True)
    apply_kernel_switches(recipe)
    from finetune.train.signals import Preempted, PreemptionCallback

    # SIGTERM/SIGUSR1/SIGHUP from now on: checkpoint at the next step, exit 75 (SIGINT: 130)
    (run_dir / rundir.LOGS_DIR).mkdir(parents=True, exist_ok=True)
    preempt = PreemptionCallback(log_path=run_dir / rundir.LOGS_DIR / f"rank-{state.process_index}.log")
    # after the callback: the log handler writes to the stream it installs, which outlives the console
    _setup_logging(state.is_main_process)
    try:
        summary = _run(recipe, state=state, run_dir=run_dir, resume=resume, preempt=preempt)
    except Exception as exc:
        from finetune.train.failure import as_finetune_error

        # out of memory: the measured peak is recorded for the launcher to re-plan with (train/oom.py)
        oom = _out_of_memory(run_dir, recipe, exc)
        err = oom if oom is not None else as_finetune_error(exc, run_dir=run_dir)
        if state.is_main_process:  # the launcher's exit code loses ours (accelerate exits 1 for one process)
            try:
                rundir.write_rank_error(run_dir, exit_code=err.exit_code, message=err.render())
            except OSError:  # a full disk: the message still reaches the console
                pass
        if isinstance(err, Preempted):  # every rank stopped at the same step boundary: leave together
            state.destroy_process_group()
        if err is exc:
            raise
        raise err from (None if oom is not None else exc)
    finally:
        preempt.restore()
    # PyTorch's rule for a clean exit: a rank that exits with its process group alive can leave a
    # peer blocked in a pending collective (accelerate's end_training does the same)
    state.destroy_process_group()
    return summary


def apply_kernel_switches(recipe: Recipe) -> None:
    """torch's process-wide kernel choices the plan made: cuDNN's attention off where the method's padded rows
    cannot be kept off its NaN lengths (plan.cudnn_attention_off)."""
    if recipe.resolved and not recipe.resolved.cudnn_attention:
        import torch

        torch.backends.cuda.enable_cudnn_sdp(False)


def _out_of_memory(run_dir: Path, recipe, exc: Exception):
    """Out of memory: record the measured peak for the launcher to re-plan with (train/oom.py) and
    return the error the rank exits with, without a traceback; None for any other exception."""
    from finetune.train.oom import out_of_memory_error, record

    found = out_of_memory_error(exc)
    return None if found is None else record(run_dir, recipe, error=found)


def _run(recipe, *, state, run_dir: Path, resume: str, preempt) -> dict | None:
    """setup -> train -> finish; the summary on the main process, None elsewhere."""
    session = _setup(recipe, state=state, run_dir=run_dir, resume=resume)
    trainer, result = _train(session, preempt=preempt)
    return _finish(session, trainer=trainer, result=result)


@dataclass
class _Session:
    """What setup prepared for training and finishing."""

    recipe: Any
    state: Any  # accelerate's PartialState
    run_dir: Path
    tokenizer: Any
    data: Any  # finetune.train.preflight.PreparedData
    model: Any
    args: Any  # the TRL config (TrainingArguments)
    resume_from: Path | None
    cases: list | None  # task-eval examples, or None
    fields: dict  # recipe and data fields a checkpoint and the finished run are checked against
    at_load: dict = field(default_factory=dict)  # this rank's GPU memory right after loading, before wrapping
    summary: dict = field(default_factory=dict)


def _setup(recipe, *, state, run_dir: Path, resume: str) -> _Session:
    """Everything before the first step: tokenizer, data (preflight before any model is loaded), the
    resume point and the checkpoints it keeps, the training arguments, the model, and the task eval
    before training."""
    from finetune.trackers import apply_tracker_env, check_trackers
    from finetune.train import taskeval
    from finetune.train.memory_report import load_figures
    from finetune.train.model import load_tokenizer, load_training_model
    from finetune.train.occupancy import check_device_free
    from finetune.train.preflight import prepare_data
    from finetune.train.trainers import training_args

    check_trackers(recipe)  # before anything is loaded (finetune run checks it before launching, too)
    apply_tracker_env(recipe, run_dir)  # before the Trainer builds its tracker callbacks

    tokenizer = load_tokenizer(recipe)
    data = prepare_data(recipe, tokenizer, state=state)  # preflight: before any model is loaded
    cases = taskeval.load_cases(recipe) if recipe.data.task_eval else None
    fields = {
        **recipe_fields(recipe),
        **data_fields(train=data.fingerprints.get("train", []), eval=data.fingerprints.get("eval", [])),
    }
    resume_from = _resume_point(recipe, state=state, run_dir=run_dir, resume=resume, fields=fields)
    if strategies.is_deepspeed(recipe.distributed.strategy):  # before DeepSpeed JIT-builds its ops
        from finetune.compat.deepspeed_arch_list import make_arch_list_readable

        note = make_arch_list_readable()
        if note and state.is_main_process:
            log.info(note)
    args = training_args(recipe, run_dir=run_dir, has_eval=data.eval is not None)
    args.save_total_limit = None  # retention is CommitCallback's: only after a newer checkpoint is complete
    # the eval before training runs inside train(), after the model is wrapped: FSDP2 cannot wrap a model
    # for an evaluate() called first (accelerate needs the model and optimizer prepared together)
    args.eval_on_start = data.eval is not None and resume_from is None
    check_device_free(recipe)  # another process on this GPU would look like a planning error
    loading = time.perf_counter()
    model = load_training_model(recipe, args=args)
    load_s = time.perf_counter() - loading
    log.info(f"model loaded in {load_s:.0f} s")
    session = _Session(
        recipe=recipe,
        state=state,
        run_dir=run_dir,
        tokenizer=tokenizer,
        data=data,
        model=model,
        args=args,
        resume_from=resume_from,
        cases=cases,
        fields=fields,
        at_load=load_figures(model),
    )
    session.summary = {
        "run_dir": str(run_dir),
        "tokenized_cache": {"key": data.cache_key, "hit": data.cache_hit},
        "data_notes": data.notes,
        "resumed_from": str(resume_from) if resume_from else None,
        "model_load_s": round(load_s, 1),  # from_pretrained (and quantization) on this rank; wrapping is later
    }
    if cases and resume_from is None:
        if state.is_main_process:
            before_model = session.model if state.num_processes == 1 else taskeval.load_base(recipe)
            session.summary["task_eval_before"] = taskeval.exact_match(
                before_model, tokenizer, cases, max_new_tokens=recipe.data.task_eval.max_new_tokens
            )
            session.model.train()
            log.info(f"exact match before training: {session.summary['task_eval_before']['exact_match']:.1%}")
        state.wait_for_everyone()
    return session


def _resume_point(recipe, *, state, run_dir: Path, resume: str, fields: dict) -> Path | None:
    """The checkpoint to resume from (checked against the recipe), or None for a fresh start, whose old
    metrics and summary go; incomplete and discarded checkpoints go before the Trainer writes any."""
    resume_from = resolve_resume(resume, run_dir)
    if resume_from is not None:
        log.info(f"resuming from {resume_from}")
        for note in check_resume(resume_from, recipe, world_size=state.num_processes, fields=fields):
            log.info(f"resume: changed safely: {note}")
    elif state.is_main_process:  # a fresh start neither mixes in old rows nor leaves an old run's summary
        (run_dir / rundir.METRICS).unlink(missing_ok=True)
        (run_dir / rundir.SUMMARY).unlink(missing_ok=True)
    state.wait_for_everyone()
    if state.is_main_process:
        prepare_checkpoints(run_dir, start=resume_from)
    state.wait_for_everyone()
    return resume_from


def _callbacks(session: _Session, *, preempt) -> list:
    from finetune.train.memory_report import PeakMemoryCallback
    from finetune.train.oom import BaselineCallback
    from finetune.train.progress import ConsoleProgress
    from finetune.train.trainers import trainer_checkpointing

    recipe, run_dir = session.recipe, session.run_dir
    callbacks = [
        MetricsCallback(run_dir, recipe=recipe),
        LibraryCardCallback(),
        PeakMemoryCallback(run_dir, at_load=session.at_load),
        ConsoleProgress(),
        NonFiniteCallback(policy=recipe.train.on_nonfinite, max_bad_steps=recipe.train.max_bad_steps, run_dir=run_dir),
        CommitCallback(run_dir, fields=session.fields, strategy=recipe.distributed.strategy, keep=recipe.output.keep),
        DiskSpaceCallback(run_dir, estimate=output_bytes(recipe, run_dir)[1]),
        preempt,
        BaselineCallback(),
    ]
    k = getattr(recipe.resolved, "checkpoint_layers", None)
    if k is not None and trainer_checkpointing(recipe):
        from finetune.train.checkpointing import PartialCheckpointing

        callbacks.append(PartialCheckpointing(k))
    from finetune.train.cadence import cadence_callbacks

    callbacks += cadence_callbacks(recipe, has_eval=session.data.eval is not None)
    if recipe.logging.profile_steps:
        from finetune.train.profile import ProfilerCallback

        start, stop = recipe.logging.profile_steps
        callbacks.append(ProfilerCallback(run_dir, start=start, stop=stop, rank=session.state.process_index))
    if recipe.logging.memory_profile_step:
        from finetune.train.memory_history import MemoryHistoryCallback

        step = recipe.logging.memory_profile_step
        callbacks.append(MemoryHistoryCallback(run_dir, step=step, rank=session.state.process_index))
    return callbacks


def _train(session: _Session, *, preempt):
    """(trainer, TrainOutput): the TRL trainer built and run (the eval before training is its eval_on_start).
    A preemption raises once every rank has stopped at the same step and saved its checkpoint."""
    from transformers.trainer_callback import PrinterCallback

    from finetune.train.model import adapter_input_casting
    from finetune.train.trainers import build_trainer

    recipe, resume_from = session.recipe, session.resume_from
    trainer = build_trainer(
        recipe,
        args=session.args,
        model=session.model,
        tokenizer=session.tokenizer,
        data=session.data,
        callbacks=_callbacks(session, preempt=preempt),
    )
    trainer.remove_callback(PrinterCallback)  # ConsoleProgress prints the readable version
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, NonFiniteCallback):
            callback.keep_micro_batches(trainer)  # a bad step's micro-batches, written for its reproduction
    with adapter_input_casting(recipe, trainer.model):
        result = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    if preempt.stopped_at is not None:
        raise preempt.error(session.run_dir)
    if session.args.eval_on_start:
        session.summary["eval_loss_before"] = next(
            (h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h and h.get("step") == 0), None
        )
    return trainer, result


def _finish(session: _Session, *, trainer, result) -> dict | None:
    """The final eval loss, the model (or adapter) and tokenizer saved, the task eval after training,
    and on the main process the summary written and printed."""
    from finetune.train import taskeval

    recipe, state, run_dir, summary = session.recipe, session.state, session.run_dir, session.summary
    if session.data.eval is not None:
        done = [
            h["eval_loss"]
            for h in trainer.state.log_history
            if "eval_loss" in h and h.get("step") == trainer.state.global_step
        ]
        summary["eval_loss_final"] = done[-1] if done else trainer.evaluate()["eval_loss"]
    if getattr(trainer, "is_fsdp_enabled", False):
        # checkpoints stay sharded (resumable on another world size); the final model or adapter
        # is gathered into plain safetensors, or save_model would write nothing from the sharded state
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    if not recipe.resolved.measure:  # `finetune plan --measure` keeps nothing
        save_final(trainer, session.tokenizer, recipe=recipe, run_dir=run_dir, state=state)
        from finetune.train.memory_report import PeakMemoryCallback

        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, PeakMemoryCallback):
                callback.after_final_save(trainer.state.global_step)
        if state.is_main_process:
            from finetune.modelcard import remove_library_card

            remove_library_card(run_dir, made_by="peft")  # `finetune push` writes the real card
    state.wait_for_everyone()
    if session.cases and state.is_main_process:
        trained = taskeval.load_trained(recipe, run_dir)
        summary["task_eval_after"] = taskeval.exact_match(
            trained, session.tokenizer, session.cases, max_new_tokens=recipe.data.task_eval.max_new_tokens
        )
    if not state.is_main_process:
        return None
    summary.update(_train_figures(recipe, run_dir, trainer, result))
    from finetune.envreport import stack_versions

    summary[rundir.SUMMARY_VERSIONS] = stack_versions()  # for the model card
    write_atomic(run_dir / rundir.SUMMARY, json.dumps(summary, indent=2) + "\n")
    if recipe.resolved.measure:  # its run dir is temporary: `plan --measure` prints its own figures
        return summary
    # written last: a rerun of the same recipe finds the run complete (finetune.api)
    write_atomic(
        run_dir / rundir.FINISHED,
        json.dumps({"step": trainer.state.global_step, "recipe_fields": session.fields}, default=str) + "\n",
    )
    print(format_summary(summary), flush=True)
    return summary


def _train_figures(recipe, run_dir: Path, trainer, result) -> dict:
    rows = rundir.read_metrics(run_dir)
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    evals = [r["eval_loss"] for r in rows if r.get("eval_loss") is not None and r["step"] > 0]
    runtime = result.metrics.get("train_runtime") or 0.0
    tokens = trainer.state.num_input_tokens_seen or 0
    adapter = recipe.adapter.type != "full"
    return {
        "method": recipe.method.type,
        "adapter": recipe.adapter.type,
        "output": str(run_dir / ("adapter_model.safetensors" if adapter else "")).rstrip("/"),
        rundir.SUMMARY_STEPS: trainer.state.global_step,
        rundir.SUMMARY_FINAL_LOSS: losses[-1] if losses else None,
        rundir.SUMMARY_FIRST_LOSS: losses[0] if losses else None,
        rundir.SUMMARY_BEST_EVAL: min(evals) if evals else None,
        "train_runtime_s": round(runtime, 2),
        rundir.SUMMARY_TOKENS: tokens,
        rundir.SUMMARY_TOKENS_PER_S: round(tokens / runtime, 1) if runtime and tokens else None,
    }


def _fmt(value, spec=".4f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_summary(s: dict) -> str:
    lines = [
        "",
        "=== finetune: done ===",
        f"  {'adapter' if s['adapter'] != 'full' else 'model'}: {s['output']}",
        f"  steps: {s['steps']}   train loss: {_fmt(s['first_train_loss'])} -> {_fmt(s['final_train_loss'])}",
        f"  eval loss: before {_fmt(s.get('eval_loss_before'))}, final {_fmt(s.get('eval_loss_final'))}, "
        f"best {_fmt(s.get('best_eval_loss'))}",
        f"  throughput: {_fmt(s['tokens_per_second'], '.0f')} tokens/s over {s['train_runtime_s']} s",
    ]
    before, after = s.get("task_eval_before"), s.get("task_eval_after")
    if after:
        lines.append(
            f"  exact match on {after['n']} held-out examples: "
            f"before {_fmt(before['exact_match'] if before else None, '.0%')}, "
            f"after {after['exact_match']:.0%}"
        )
        for ex in after["examples"]:
            lines.append(f"    {ex['prompt']!r} -> {ex['got']!r} (expected {ex['expected']!r})")
    lines.append(
        f"  metrics: {s['run_dir']}/{rundir.METRICS}, loss curve: {s['run_dir']}/{rundir.LOSS_PNG}, "
        f"summary: {s['run_dir']}/{rundir.SUMMARY}"
    )
    return "\n".join(lines)
