"""The public Python API: load -> plan -> compile -> launch -> (push).

Load, plan and compile are pure and import no torch; `run` starts processes only
through finetune.launch. Nothing here prints: results are return values, and a run's progress
(what was compiled, resume notes) goes to the `finetune.api` logger, which the CLI shows.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from finetune import rundir
from finetune.checkpoints.fields import compare_fields, data_fields, grown, recipe_fields
from finetune.checkpoints.resume import (
    check_resume,
    complete_checkpoints,
    latest_checkpoint,
    resolve_resume,
    resume_advice,
)
from finetune.data.check import check_data
from finetune.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, FinetuneError, RecipeError, TrainingFailed
from finetune.plan.types import GIB
from finetune.recipe import Recipe, load_recipe

log = logging.getLogger("finetune.api")


def _check_resume(run_dir: Path, resume: str, *, resolved: Recipe, world_size: int, fields: dict | None = None) -> None:
    """Refuse a resume the checkpoint cannot support before launching (RecipeError, exit 2)."""
    start = resolve_resume(str(resume), run_dir)
    if start is None:
        return
    for note in check_resume(start, resolved, world_size=world_size, fields=fields):
        log.info(f"resume from {start.name}: changed safely: {note}")


def _as_recipe(recipe, overrides: list[str] | None = None) -> Recipe:
    if isinstance(recipe, Recipe):
        if overrides:
            from finetune.recipe.load import apply_overrides

            raw = apply_overrides(recipe.model_dump(mode="json", exclude_none=True), list(overrides))
            fresh = load_recipe(raw)
            fresh._source_dir, fresh._source_name = recipe._source_dir, recipe._source_name
            return fresh
        return recipe
    return load_recipe(recipe, overrides=overrides)


def make_plan(recipe, *, hardware: str | None = None, overrides: list[str] | None = None):
    """Return (recipe, plan). The plan says fits or not; it never raises for 'does not fit'."""
    from finetune.data.check import unreadable_sources
    from finetune.data.lengths import local_sample, with_measured_lengths
    from finetune.plan import plan as plan_recipe

    recipe = _as_recipe(recipe, overrides)
    recipe = with_measured_lengths(recipe, local_sample(recipe))  # local data: examples' or sequences' lengths
    result = plan_recipe(recipe, hardware=hardware)
    missing = unreadable_sources(recipe)
    if missing:
        result.warnings.append(
            f"planned without reading {'; '.join(missing)}: `finetune validate` and `finetune run` refuse the recipe "
            "until the data is there"
        )
    return recipe, result


def plan(recipe, *, hardware: str | None = None, overrides: list[str] | None = None):
    """Plan a recipe on a hardware preset (name, file, or auto)."""
    return make_plan(recipe, hardware=hardware, overrides=overrides)[1]


def compile(
    recipe, *, hardware: str | None = None, overrides: list[str] | None = None, output: str | Path | None = None
):
    """Plan and write the run directory's launch files; DoesNotFitError (exit 3) when nothing fits."""
    from finetune.compile.compiler import default_run_dir, prepare_recipe
    from finetune.data.lengths import local_sample, with_measured_lengths

    recipe = _as_recipe(recipe, overrides)
    recipe = with_measured_lengths(recipe, local_sample(recipe))  # as `finetune plan` and `run` plan it
    target = Path(output).resolve() if output else default_run_dir(recipe)
    return _write_guarded(prepare_recipe(recipe, run_dir=target, hardware=hardware), recipe)


def _write_guarded(compiled, recipe: Recipe):
    """`finetune compile` writes only into a directory finetune owns, and not while a run uses it."""
    from finetune.guard import RunLock, check_output_dir, claim

    target = Path(compiled.spec.run_dir)
    check_output_dir(target, recipe)
    with RunLock(target):
        claim(target)
        return compiled.write()


def check_destinations(recipe: Recipe, *, pushes: bool = True) -> None:
    """Where the run reports and publishes: each logging.report_to tracker is installed, and for
    hub.repo (when this process pushes) the Hub token may write there (RecipeError, exit 2, before
    anything slow)."""
    from finetune.trackers import check_trackers

    check_trackers(recipe)
    if recipe.hub.repo and pushes:
        from finetune.hub import check_push_access

        check_push_access(recipe.hub.repo, private=recipe.hub.private)


@dataclass
class RunResult:
    run_dir: Path
    exit_code: int  # 0, or EXIT_PREEMPTED when a checkpoint was saved on a signal (run again to resume)
    summary: dict = field(default_factory=dict)  # RUN_DIR/summary.json of a finished run
    launched: bool = True  # False for a dry run and for multi-node instructions
    instructions: str | None = None  # multi-node without a node rank: what to run on each node
    pushed: str | None = None  # the Hub commit URL when the recipe's hub.repo was pushed


def run(
    recipe,
    *,
    hardware: str | None = None,
    overrides: list[str] | None = None,
    output: str | Path | None = None,
    dry_run: bool = False,
    resume: str = "auto",
    node_rank: int | None = None,
    main_address: str | None = None,
    main_port: int | None = None,
) -> RunResult:
    """Plan, compile, launch, train, save (and push when the recipe has hub.repo).

    Every check (output directory, lock, data, finished run, resume, model files, disk) runs before
    anything is written into the run directory."""
    from finetune.compile.compiler import default_run_dir
    from finetune.guard import RunLock, check_output_dir

    recipe = _as_recipe(recipe, overrides)
    target = Path(output).resolve() if output else default_run_dir(recipe)
    check_output_dir(target, recipe)
    created = not target.exists()  # bad input must not leave a half-made run dir behind
    lock = RunLock(target, node_rank=node_rank or 0)
    try:
        lock.acquire()
        if lock.note:
            log.info(lock.note)
        return _run_locked(
            recipe,
            target=target,
            hardware=hardware,
            dry_run=dry_run,
            resume=resume,
            node_rank=node_rank,
            main_address=main_address,
            main_port=main_port,
        )
    except FinetuneError:
        lock.release()
        # a directory this call made and in which no step was trained holds nothing worth keeping
        if (
            created
            and not (target / rundir.METRICS).exists()
            and not any((target / rundir.CHECKPOINTS).glob("checkpoint-*"))
        ):
            shutil.rmtree(target, ignore_errors=True)
        raise
    finally:
        lock.release()


def _fields(resolved: Recipe, data) -> dict:
    return {**recipe_fields(resolved), **data_fields(train=data.train, eval=data.eval)}


def _finished(run_dir: Path, resume: str, fields: dict) -> dict | None:
    """The finished run's record when this rerun has nothing to do; RecipeError when the recipe changed;
    None when training should (re)start: no finished run, --resume never, or a grown max_steps/epochs."""
    done = rundir.read_finished(run_dir)
    if not done or resume == "never":
        return None
    notes, refused = compare_fields(done.get("recipe_fields", {}), fields)
    if refused:
        raise RecipeError(
            f"{run_dir} holds a finished run, and the recipe changed since: {'; '.join(refused)}",
            key=refused[0].split(" ")[0],
            hint="change those keys back, or train again from scratch with --resume never (the "
            "finished outputs are kept aside until the new run replaces them), or pass "
            "another --output",
        )
    if not grown(done.get("recipe_fields", {}), fields):
        return done
    if latest_checkpoint(run_dir) is None:
        raise RecipeError(
            f"{run_dir} holds a finished run that kept no checkpoint, so it cannot continue to the "
            f"larger {', '.join(n.split(' ')[0] for n in notes if 'continues' in n)}",
            key="train.max_steps",
            hint="train again from scratch with --resume never, or pass "
            "another --output (set output.save_every to keep runs "
            "extendable)",
        )
    return None


def _run_locked(
    recipe: Recipe, *, target: Path, hardware, dry_run: bool, resume: str, node_rank, main_address, main_port
) -> RunResult:
    from finetune import prelaunch
    from finetune.compile.compiler import prepare_recipe
    from finetune.data.lengths import with_measured_lengths
    from finetune.guard import claim
    from finetune.launch import run_with_oom_retries

    # trackers installed, Hub push allowed (on the node that pushes): before anything is loaded
    check_destinations(recipe, pushes=node_rank in (None, 0))
    data = check_data(recipe)  # paths and rows, before anything is written
    recipe = with_measured_lengths(recipe, data.sample)  # the examples' or sequences' lengths
    compiled = prepare_recipe(recipe, run_dir=target, hardware=hardware)
    spec, fields = compiled.spec, _fields(compiled.resolved, data)
    done = _finished(target, resume, fields)
    if done is not None:
        from finetune.hub import pending_push, push_from_recipe

        pushed = None
        if node_rank in (None, 0) and not dry_run and pending_push(target):
            log.info(f"{target} is complete, but its push to {compiled.resolved.hub.repo} did not finish: pushing it")
            pushed = push_from_recipe(target)
        else:
            log.info(
                f"{target} is complete: it finished at step {done.get('step')} with this recipe; nothing to "
                f"do (to train again from scratch: --resume never)"
            )
        return RunResult(target, 0, rundir.read_summary(target), launched=False, pushed=pushed)
    _check_resume(target, resume, resolved=compiled.resolved, world_size=spec.world_size, fields=fields)
    prelaunch.check_model_files(recipe)
    prelaunch.check_chat_template(recipe, data.first)
    if not dry_run and not (spec.multi_node and node_rank is None):
        prelaunch.check_devices(spec)
        prelaunch.check_attention_package(compiled.resolved)
        prelaunch.check_disk(target, plan=compiled.plan, recipe=recipe)
        prelaunch.check_swap_disk(compiled.plan, compiled.resolved)
    claim(target)
    compiled.write()
    run_dir = Path(spec.run_dir)
    log.info(spec.summary)
    if dry_run:
        return RunResult(run_dir, 0, launched=False)
    if node_rank in (None, 0):
        set_aside_previous(run_dir, resume=resume)
    (run_dir / rundir.RANK_ERROR).unlink(missing_ok=True)
    before = _newest_checkpoint(run_dir)
    code, spec = run_with_oom_retries(
        recipe,
        spec,
        hardware=hardware,
        resume=str(resume),
        node_rank=node_rank,
        main_address=main_address,
        main_port=main_port,
    )
    if not isinstance(code, int):  # multi-node without --node-rank: what to run on each node
        return RunResult(run_dir, 0, launched=False, instructions=str(code))
    # finished.json is set aside before the launch and written last by the run: a signal that came after
    # it found a complete run (its outputs saved), which is reported as complete, not as preempted
    signalled_after_finish = code in (EXIT_PREEMPTED, EXIT_INTERRUPTED) and bool(rundir.read_finished(run_dir))
    if code != 0 and not signalled_after_finish:
        return _stopped(run_dir, code, before=before)
    if node_rank in (None, 0):
        shutil.rmtree(run_dir / rundir.PREVIOUS, ignore_errors=True)  # the new run replaced it
    summary = rundir.read_summary(run_dir)
    resolved = load_recipe(run_dir / rundir.RESOLVED_RECIPE, allow_resolved=True)
    pushed = None
    if signalled_after_finish:
        later = (
            f"\n  not pushed to {resolved.hub.repo}: run the same command again to push" if resolved.hub.repo else ""
        )
        log.info(f"stopped by a signal after training finished: {run_dir} is complete{later}")
    elif resolved.hub.repo and (node_rank in (None, 0)):
        from finetune.hub import push_from_recipe

        pushed = push_from_recipe(run_dir)
    return RunResult(run_dir, 0, summary, pushed=pushed)


def _newest_checkpoint(run_dir: Path) -> Path | None:
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def set_aside_previous(run_dir: Path, *, resume: str) -> None:
    """Move what a new run will replace into RUN_DIR/previous-run/ (a rename: no space needed), so that
    nothing of a previous run is lost until the new one has finished; deleted after it succeeds."""
    prev = run_dir / rundir.PREVIOUS
    names = [rundir.FINISHED, rundir.PUSHED]
    if resume == "never" or (resume == "auto" and _newest_checkpoint(run_dir) is None):
        names += [rundir.METRICS, rundir.SUMMARY, rundir.LOSS_PNG]
        root = run_dir / rundir.CHECKPOINTS
        names += [f"{rundir.CHECKPOINTS}/{p.name}" for p in sorted(root.glob("checkpoint-*"))] if root.is_dir() else []
    for name in names:
        src, dst = run_dir / name, prev / name
        if src.exists() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            src.rename(dst)


def _stopped(run_dir: Path, code: int, *, before: Path | None) -> RunResult:
    """A launch that did not finish: say only what happened, and how to go on."""
    newest = _newest_checkpoint(run_dir)
    if code in (EXIT_PREEMPTED, EXIT_INTERRUPTED):
        what = "preempted" if code == EXIT_PREEMPTED else "interrupted"
        if newest is not None and newest != before:
            log.info(
                f"{what}: a checkpoint was saved ({newest.name}) in {run_dir}\n"
                f"  fix: run the same command to resume from it"
            )
        else:
            log.info(f"{what} before a new checkpoint was written\n  fix: {resume_advice(run_dir)}")
        return RunResult(run_dir, code)
    err = rundir.read_rank_error(run_dir)
    if err.get("message"):
        failure = TrainingFailed(f"training stopped: {err['message']}")
        failure.exit_code = err.get("exit_code", code)
        raise failure
    raise TrainingFailed(
        f"training exited with code {code}; the log above names the failing rank and its error",
        file=str(run_dir),
        hint=f"fix the cause, {resume_advice(run_dir)}",
    )


MEASURE_STEPS = 5


def _measuring(recipe: Recipe, *, steps: int, run_dir: Path, kept: bool) -> Recipe:
    """The recipe as `plan --measure` runs it: `steps` steps logged one by one, nothing evaluated,
    saved, pushed or reported elsewhere, no out-of-memory retry (the planned setting is what is measured).
    The recipe's logging.profile_steps and memory_profile_step stay where the run dir is `kept` (--keep): the
    profiles are the only things that would be left to read there."""
    from finetune.launch import with_setting

    return with_setting(
        recipe,
        train={"max_steps": steps, "epochs": None, "logging_steps": 1, "eval_steps": None, "oom_retries": 0},
        data={"eval_sources": [], "eval_fraction": None, "eval_rows": None, "task_eval": None},
        output={"dir": str(run_dir), "save_every": None},
        hub={"repo": None},
        logging={
            "report_to": ["none"],
            "profile_steps": recipe.logging.profile_steps if kept else None,
            "memory_profile_step": recipe.logging.memory_profile_step if kept else None,
        },
    )


def measure(
    recipe,
    *,
    hardware: str | None = None,
    overrides: list[str] | None = None,
    steps: int = MEASURE_STEPS,
    keep: str | Path | None = None,
):
    """Run `steps` real steps at the planned setting on this machine's devices (the real launcher and
    trainer, in a temporary run dir that is removed afterwards unless `keep` names a directory to use)
    and return a finetune.measurement.Measurement: measured vs predicted peak per rank and tokens/s."""
    import tempfile

    from finetune.compile.files import write_atomic
    from finetune.data.lengths import with_measured_lengths
    from finetune.launch import launch
    from finetune.measurement import RankPeak, read_measurement
    from finetune.plan.choose import usable_fraction
    from finetune.recipe.load import dump_recipe, recipe_dir
    from finetune.registry import get_preset
    from finetune.rundir import RESOLVED_RECIPE, read_oom_records

    if steps < 3:
        raise FinetuneError(
            f"--steps {steps}: a steady tokens/s needs at least 3 steps",
            hint="measure 5 or more steps (the first ones warm up)",
        )
    recipe = _as_recipe(recipe, overrides)
    recipe = with_measured_lengths(recipe, check_data(recipe).sample)
    run_dir = Path(keep).resolve() if keep else Path(tempfile.mkdtemp(prefix="finetune-measure-"))
    try:
        measuring = _measuring(recipe, steps=steps, run_dir=run_dir, kept=bool(keep))
        spec = compile(measuring, hardware=hardware, output=run_dir)
        if spec.multi_node:
            raise FinetuneError(
                f"--measure runs on this machine; the plan spans {spec.num_nodes} nodes",
                hint="measure one node's share with a one-node preset (--hardware auto)",
            )
        resolved = load_recipe(run_dir / RESOLVED_RECIPE, allow_resolved=True)
        resolved.resolved.measure = True  # the ranks save nothing (finetune/train/run.py)
        write_atomic(run_dir / RESOLVED_RECIPE, dump_recipe(resolved))
        the_plan = plan(measuring, hardware=hardware)  # what compile planned (the recipe's own plan)
        device_gib = get_preset(
            the_plan.hardware_source or hardware or recipe.hardware, base_dir=recipe_dir(recipe)
        ).gpu_memory_gib
        log.info(spec.summary)
        code = launch(spec, extra_args=["--resume", "never"])
        oom = read_oom_records(run_dir)
        if code != 0 and not oom:
            raise TrainingFailed(
                f"the measurement run exited with code {code}; the log above names the failing rank",
                file=str(run_dir),
                hint="fix the cause and measure again",
            )
        result = read_measurement(
            run_dir,
            plan=the_plan,
            steps=steps,
            usable_gib=usable_fraction(the_plan) * device_gib,
            device_gib=device_gib,
        )
        if oom:  # the ranks' peaks at the failure, where no logged step wrote memory/rank-K.json
            result.out_of_memory = "; ".join(r["message"] for r in oom)
            logged = {r.rank for r in result.ranks}
            result.ranks += [
                RankPeak(r["rank"], r["peak_bytes"] / GIB, (r.get("peak_allocated_bytes") or 0) / GIB or None)
                for r in oom
                if r["rank"] not in logged
            ]
    finally:
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    if not keep:
        result.run_dir = ""
    return result
