"""One rank's whole run: resolved recipe -> tokenizer -> preflight + data -> model -> TRL -> outputs.

Setup, train, cleanup in that order; everything a user must fix is raised as a FinetuneError
before the model is loaded (data) or before training starts (recipe).
"""

from __future__ import annotations

import json
import logging
import math
import os
from datetime import timedelta
from pathlib import Path

from finetune import rundir
from finetune.compile.files import write_atomic
from finetune.errors import RecipeError
from finetune.recipe.load import load_recipe
from finetune.train.callbacks import CommitCallback, MetricsCallback, NonFiniteCallback, read_metrics
from finetune.train.checkpoint import ZERO3, check_resume, prepare_checkpoints, resolve_resume
from finetune.train.diskspace import DiskSpaceCallback, output_bytes, save_final
from finetune.train.integrity import data_fields, recipe_fields

log = logging.getLogger("finetune.train")
RANK_ERROR = rundir.RANK_ERROR  # the main rank's error, read by finetune.api.run


def _setup_logging(is_main: bool) -> None:
    import datasets
    import transformers

    logging.basicConfig(format="[finetune] %(message)s", level=logging.INFO if is_main else logging.WARNING)
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    transformers.logging.set_verbosity_warning()
    datasets.disable_progress_bars()


def run_rank(resolved_path: str | Path, *, resume: str = "auto") -> dict | None:
    """Train one rank. Returns the summary on the main process (None elsewhere)."""
    recipe = load_recipe(resolved_path, allow_resolved=True)
    if recipe.resolved is None:
        raise RecipeError("not a resolved recipe (it has no resolved: section)", file=str(resolved_path),
                          hint="run it with `finetune run RECIPE`, which plans and compiles it first")
    run_dir = Path(recipe.output.dir or Path(resolved_path).parent).resolve()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # forked dataloader workers otherwise warn

    from accelerate import PartialState
    from transformers import set_seed

    state = PartialState(cpu=recipe.resolved.device == "cpu",
                         timeout=timedelta(minutes=recipe.distributed.timeout_minutes))
    _setup_logging(state.is_main_process)
    set_seed(recipe.train.seed)
    from finetune.train.signals import Preempted, PreemptionCallback

    # SIGTERM/SIGUSR1/SIGHUP from now on: checkpoint at the next step, exit 75 (SIGINT: 130)
    (run_dir / rundir.LOGS_DIR).mkdir(parents=True, exist_ok=True)
    preempt = PreemptionCallback(log_path=run_dir / rundir.LOGS_DIR / f"rank-{state.process_index}.log")
    try:
        summary = _run(recipe, state=state, run_dir=run_dir, resume=resume, preempt=preempt)
    except Exception as exc:
        from finetune.train.failure import as_finetune_error

        err = as_finetune_error(exc, run_dir=run_dir)
        if state.is_main_process:  # the launcher's exit code loses ours (accelerate exits 1 for one process)
            try:
                rundir.write_rank_error(run_dir, exit_code=err.exit_code, message=err.render())
            except OSError:  # a full disk: the message still reaches the console
                pass
        if isinstance(err, Preempted):  # every rank stopped at the same step boundary: leave together
            state.destroy_process_group()
        if err is exc:
            raise
        raise err from exc
    finally:
        preempt.restore()
    # PyTorch's rule for a clean exit: a rank that exits with its process group alive can leave a
    # peer blocked in a pending collective (accelerate's end_training does the same)
    state.destroy_process_group()
    return summary


def _run(recipe, *, state, run_dir: Path, resume: str, preempt) -> dict | None:

    from finetune.train import taskeval
    from finetune.train.model import adapter_input_casting, load_model, load_tokenizer
    from finetune.train.preflight import prepare_data
    from finetune.train.trainers import build_trainer, training_args

    tokenizer = load_tokenizer(recipe)
    data = prepare_data(recipe, tokenizer, state=state)  # preflight: before any model is loaded
    cases = taskeval.load_cases(recipe) if recipe.data.task_eval else None
    fields = {**recipe_fields(recipe), **data_fields(train=data.fingerprints.get("train", []),
                                                     eval=data.fingerprints.get("eval", []))}
    resume_from = resolve_resume(resume, run_dir)
    if resume_from is not None:
        log.info(f"resuming from {resume_from}")
        for note in check_resume(resume_from, recipe, world_size=state.num_processes, fields=fields):
            log.info(f"resume: changed safely: {note}")
    elif state.is_main_process:  # a fresh start neither mixes in old rows nor leaves an old run's summary
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        (run_dir / "summary.json").unlink(missing_ok=True)
    state.wait_for_everyone()
    if state.is_main_process:  # incomplete and discarded checkpoints go before the Trainer writes any
        prepare_checkpoints(run_dir, start=resume_from)
    state.wait_for_everyone()

    if recipe.distributed.strategy in ZERO3:  # before DeepSpeed JIT-builds its ops
        from finetune.compat.deepspeed_arch_list import make_arch_list_readable

        note = make_arch_list_readable()
        if note and state.is_main_process:
            log.info(note)
    args = training_args(recipe, run_dir=run_dir, has_eval=data.eval is not None)
    args.save_total_limit = None  # retention is CommitCallback's: only after a newer checkpoint is complete
    model = load_model(recipe)
    summary: dict = {"run_dir": str(run_dir), "tokenized_cache": {"key": data.cache_key, "hit": data.cache_hit},
                     "data_notes": data.notes, "resumed_from": str(resume_from) if resume_from else None}
    max_new = recipe.data.task_eval.max_new_tokens if cases else 0
    if cases and resume_from is None:
        if state.is_main_process:
            before_model = model if state.num_processes == 1 else taskeval.load_base(recipe)
            summary["task_eval_before"] = taskeval.exact_match(before_model, tokenizer, cases,
                                                               max_new_tokens=max_new)
            model.train()
            log.info(f"exact match before training: {summary['task_eval_before']['exact_match']:.1%}")
        state.wait_for_everyone()

    from finetune.train.memory_report import PeakMemoryCallback
    from finetune.train.progress import ConsoleProgress

    callbacks = [MetricsCallback(run_dir), PeakMemoryCallback(run_dir), ConsoleProgress(),
                 NonFiniteCallback(policy=recipe.train.on_nonfinite, max_bad_steps=recipe.train.max_bad_steps),
                 CommitCallback(run_dir, fields=fields, strategy=recipe.distributed.strategy,
                                keep=recipe.output.keep),
                 DiskSpaceCallback(run_dir, estimate=output_bytes(recipe, run_dir)[1]), preempt]
    if recipe.logging.profile_steps:
        from finetune.train.profile import ProfilerCallback

        start, stop = recipe.logging.profile_steps
        callbacks.append(ProfilerCallback(run_dir, start=start, stop=stop, rank=state.process_index))
    trainer = build_trainer(recipe, args=args, model=model, tokenizer=tokenizer, data=data, callbacks=callbacks)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # ConsoleProgress prints the readable version
    if data.eval is not None and resume_from is None:
        summary["eval_loss_before"] = trainer.evaluate()["eval_loss"]
    with adapter_input_casting(recipe, trainer.model):
        result = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    if preempt.stopped_at is not None:
        raise preempt.error(run_dir)
    if data.eval is not None:
        done = [h["eval_loss"] for h in trainer.state.log_history
                if "eval_loss" in h and h.get("step") == trainer.state.global_step]
        summary["eval_loss_final"] = done[-1] if done else trainer.evaluate()["eval_loss"]
    if getattr(trainer, "is_fsdp_enabled", False):
        # checkpoints stay sharded (resumable on another world size); the final model or adapter
        # is gathered into plain safetensors, or save_model would write nothing under SHARDED
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    save_final(trainer, tokenizer, recipe=recipe, run_dir=run_dir, state=state)
    if cases and state.is_main_process:
        trained = taskeval.load_trained(recipe, run_dir)
        summary["task_eval_after"] = taskeval.exact_match(trained, tokenizer, cases, max_new_tokens=max_new)
    if not state.is_main_process:
        return None
    summary.update(_train_figures(recipe, run_dir, trainer, result))
    write_atomic(run_dir / rundir.SUMMARY, json.dumps(summary, indent=2) + "\n")
    # written last: a rerun of the same recipe finds the run complete (finetune.api)
    write_atomic(run_dir / rundir.FINISHED, json.dumps({"step": trainer.state.global_step, "recipe_fields": fields},
                                                       default=str) + "\n")
    print(format_summary(summary), flush=True)
    return summary


def _train_figures(recipe, run_dir: Path, trainer, result) -> dict:
    rows = read_metrics(run_dir / "metrics.jsonl")
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    evals = [r["eval_loss"] for r in rows if r.get("eval_loss") is not None and r["step"] > 0]
    runtime = result.metrics.get("train_runtime") or 0.0
    tokens = trainer.state.num_input_tokens_seen or 0
    adapter = recipe.adapter.type != "full"
    return {
        "method": recipe.method.type, "adapter": recipe.adapter.type,
        "output": str(run_dir / ("adapter_model.safetensors" if adapter else "")).rstrip("/"),
        "steps": trainer.state.global_step,
        "final_train_loss": losses[-1] if losses else None,
        "first_train_loss": losses[0] if losses else None,
        "best_eval_loss": min(evals) if evals else None,
        "train_runtime_s": round(runtime, 2),
        "tokens_seen": tokens,
        "tokens_per_second": round(tokens / runtime, 1) if runtime and tokens else None,
    }


def _fmt(value, spec=".4f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_summary(s: dict) -> str:
    lines = ["", "=== finetune: done ===",
             f"  {'adapter' if s['adapter'] != 'full' else 'model'}: {s['output']}",
             f"  steps: {s['steps']}   train loss: {_fmt(s['first_train_loss'])} -> {_fmt(s['final_train_loss'])}",
             f"  eval loss: before {_fmt(s.get('eval_loss_before'))}, final {_fmt(s.get('eval_loss_final'))}, "
             f"best {_fmt(s.get('best_eval_loss'))}",
             f"  throughput: {_fmt(s['tokens_per_second'], '.0f')} tokens/s over {s['train_runtime_s']} s"]
    before, after = s.get("task_eval_before"), s.get("task_eval_after")
    if after:
        lines.append(f"  exact match on {after['n']} held-out examples: "
                     f"before {_fmt(before['exact_match'] if before else None, '.0%')}, "
                     f"after {after['exact_match']:.0%}")
        for ex in after["examples"]:
            lines.append(f"    {ex['prompt']!r} -> {ex['got']!r} (expected {ex['expected']!r})")
    lines.append(f"  metrics: {s['run_dir']}/metrics.jsonl, loss curve: {s['run_dir']}/loss.png, "
                 f"summary: {s['run_dir']}/summary.json")
    return "\n".join(lines)
