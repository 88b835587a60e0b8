"""The public Python API: load -> plan -> compile -> launch -> (push).

Load, plan and compile are pure and import no torch; `run` starts processes only
through finetune.launch.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from finetune import rundir
from finetune.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, FinetuneError, RecipeError, TrainingFailed
from finetune.recipe import Recipe, load_recipe


def _check_resume(run_dir: Path, resume: str, *, resolved: Recipe, world_size: int,
                  fields: dict | None = None) -> None:
    """Refuse a resume the checkpoint cannot support before launching (RecipeError, exit 2)."""
    from finetune.train.checkpoint import check_resume, resolve_resume

    start = resolve_resume(str(resume), run_dir)
    if start is None:
        return
    for note in check_resume(start, resolved, world_size=world_size, fields=fields):
        print(f"resume from {start.name}: changed safely: {note}", flush=True)


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
    from finetune.plan import plan as plan_recipe

    recipe = _as_recipe(recipe, overrides)
    return recipe, plan_recipe(recipe, hardware=hardware)


def plan(recipe, *, hardware: str | None = None, overrides: list[str] | None = None):
    """Plan a recipe on a hardware preset (name, file, or auto)."""
    return make_plan(recipe, hardware=hardware, overrides=overrides)[1]


def compile(recipe, *, hardware: str | None = None, overrides: list[str] | None = None,
            output: str | Path | None = None):
    """Plan and write the run directory's launch files; DoesNotFitError (exit 3) when nothing fits."""
    from finetune.compile.compiler import default_run_dir, prepare_recipe

    recipe = _as_recipe(recipe, overrides)
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


@dataclass
class RunResult:
    run_dir: Path
    exit_code: int
    summary: dict = field(default_factory=dict)
    launched: bool = True


def run(recipe, *, hardware: str | None = None, overrides: list[str] | None = None,
        output: str | Path | None = None, dry_run: bool = False, resume: str = "auto",
        node_rank: int | None = None, main_address: str | None = None,
        main_port: int | None = None) -> RunResult:
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
            print(lock.note, flush=True)
        return _run_locked(recipe, target=target, hardware=hardware, dry_run=dry_run, resume=resume,
                           node_rank=node_rank, main_address=main_address, main_port=main_port)
    except FinetuneError:
        lock.release()
        # a directory this call made and in which no step was trained holds nothing worth keeping
        if created and not (target / rundir.METRICS).exists() \
                and not any((target / rundir.CHECKPOINTS).glob("checkpoint-*")):
            shutil.rmtree(target, ignore_errors=True)
        raise
    finally:
        lock.release()


def _fields(resolved: Recipe, data) -> dict:
    from finetune.train.integrity import data_fields, recipe_fields

    return {**recipe_fields(resolved), **data_fields(train=data.train, eval=data.eval)}


def _finished(run_dir: Path, resume: str, fields: dict) -> dict | None:
    """The finished run's record when this rerun has nothing to do; RecipeError when the recipe changed;
    None when training should (re)start: no finished run, --resume never, or a grown max_steps/epochs."""
    from finetune.train.checkpoint import compare_fields, grown, latest_checkpoint

    done = rundir.read_finished(run_dir)
    if not done or resume == "never":
        return None
    notes, refused = compare_fields(done.get("recipe_fields", {}), fields)
    if refused:
        raise RecipeError(f"{run_dir} holds a finished run, and the recipe changed since: {'; '.join(refused)}",
                          key=refused[0].split(" ")[0],
                          hint="change those keys back, or train again from scratch with --resume never (the "
                               "finished outputs are kept aside until the new run replaces them), or pass "
                               "another --output")
    if not grown(done.get("recipe_fields", {}), fields):
        return done
    if latest_checkpoint(run_dir) is None:
        raise RecipeError(f"{run_dir} holds a finished run that kept no checkpoint, so it cannot continue to the "
                          f"larger {', '.join(n.split(' ')[0] for n in notes if 'continues' in n)}",
                          key="train.max_steps", hint="train again from scratch with --resume never, or pass "
                                                      "another --output (set output.save_every to keep runs "
                                                      "extendable)")
    return None


def _run_locked(recipe: Recipe, *, target: Path, hardware, dry_run: bool, resume: str, node_rank,
                main_address, main_port) -> RunResult:
    from finetune import prelaunch
    from finetune.compile.compiler import prepare_recipe
    from finetune.guard import claim
    from finetune.launch import launch
    from finetune.train.precheck import check_data

    data = check_data(recipe)  # paths and rows, before anything is written
    compiled = prepare_recipe(recipe, run_dir=target, hardware=hardware)
    spec, fields = compiled.spec, _fields(compiled.resolved, data)
    done = _finished(target, resume, fields)
    if done is not None:
        print(f"{target} is complete: it finished at step {done.get('step')} with this recipe; nothing to do "
              f"(to train again from scratch: --resume never)", flush=True)
        return RunResult(target, 0, rundir.read_summary(target), launched=False)
    _check_resume(target, resume, resolved=compiled.resolved, world_size=spec.world_size, fields=fields)
    prelaunch.check_model_files(recipe)
    prelaunch.check_chat_template(recipe, data.first)
    if not dry_run and not (spec.multi_node and node_rank is None):
        prelaunch.check_devices(spec)
        prelaunch.check_disk(target, plan=compiled.plan, recipe=recipe)
    claim(target)
    compiled.write()
    run_dir = Path(spec.run_dir)
    print(spec.summary, flush=True)
    if dry_run:
        print(f"dry run: launch files are in {run_dir}; start with `bash {run_dir}/launch.sh`")
        return RunResult(run_dir, 0, launched=False)
    if node_rank in (None, 0):
        set_aside_previous(run_dir, resume=resume)
    (run_dir / rundir.RANK_ERROR).unlink(missing_ok=True)
    before = _newest_checkpoint(run_dir)
    code = launch(spec, node_rank=node_rank, main_address=main_address, main_port=main_port,
                  extra_args=["--resume", str(resume)])
    if not isinstance(code, int):  # multi-node without --node-rank: what to run on each node
        print(code)
        return RunResult(run_dir, 0, launched=False)
    if code != 0:
        return _stopped(run_dir, code, before=before)
    if node_rank in (None, 0):
        shutil.rmtree(run_dir / rundir.PREVIOUS, ignore_errors=True)  # the new run replaced it
    summary = rundir.read_summary(run_dir)
    resolved = load_recipe(run_dir / rundir.RESOLVED_RECIPE, allow_resolved=True)
    if resolved.hub.repo and (node_rank in (None, 0)):
        from finetune.hub import push_from_recipe

        print(f"pushed to {push_from_recipe(run_dir)}")
    return RunResult(run_dir, 0, summary)


def _newest_checkpoint(run_dir: Path) -> Path | None:
    from finetune.train.checkpoint import complete_checkpoints

    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def set_aside_previous(run_dir: Path, *, resume: str) -> None:
    """Move what a new run will replace into RUN_DIR/previous-run/ (a rename: no space needed), so that
    nothing of a previous run is lost until the new one has finished; deleted after it succeeds."""
    prev = run_dir / rundir.PREVIOUS
    names = [rundir.FINISHED]
    if resume == "never" or (resume == "auto" and _newest_checkpoint(run_dir) is None):
        names += [rundir.METRICS, rundir.SUMMARY, rundir.LOSS_PNG]
        root = run_dir / rundir.CHECKPOINTS
        names += [f"{rundir.CHECKPOINTS}/{p.name}" for p in sorted(root.glob("checkpoint-*"))] if root.is_dir() else []
    for name in names:
        src, dst = run_dir / name, prev / name
        if src.exists() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            src.rename(dst)


def resume_hint(run_dir: Path) -> str:
    from finetune.train.failure import resume_advice

    return resume_advice(run_dir)


def _stopped(run_dir: Path, code: int, *, before: Path | None) -> RunResult:
    """A launch that did not finish: say only what happened, and how to go on."""
    newest = _newest_checkpoint(run_dir)
    if code in (EXIT_PREEMPTED, EXIT_INTERRUPTED):
        what = "preempted" if code == EXIT_PREEMPTED else "interrupted"
        if newest is not None and newest != before:
            print(f"{what}: a checkpoint was saved ({newest.name}) in {run_dir}\n"
                  f"  fix: run the same command to resume from it", flush=True)
        else:
            print(f"{what} before a new checkpoint was written\n  fix: {resume_hint(run_dir)}", flush=True)
        return RunResult(run_dir, code)
    err = rundir.read_rank_error(run_dir)
    if err.get("message"):
        failure = TrainingFailed(f"training stopped: {err['message']}")
        failure.exit_code = err.get("exit_code", code)
        raise failure
    raise TrainingFailed(f"training exited with code {code}; the log above names the failing rank and its error",
                         file=str(run_dir), hint=f"fix the cause, {resume_hint(run_dir)}")
