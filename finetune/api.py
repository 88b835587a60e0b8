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
from finetune.errors import EXIT_PREEMPTED, EXIT_USAGE, FinetuneError, TrainingFailed
from finetune.recipe import Recipe, load_recipe

log = logging.getLogger("finetune.api")


def _check_resume(run_dir: Path, resume: str, *, world_size: int) -> None:
    """Refuse a resume the checkpoint cannot support before launching (RecipeError, exit 2)."""
    from finetune.train.checkpoint import check_resume, resolve_resume

    start = resolve_resume(str(resume), run_dir)
    if start is None:
        return
    resolved = load_recipe(run_dir / rundir.RESOLVED_RECIPE, allow_resolved=True)
    for note in check_resume(start, resolved, world_size=world_size):
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
    from finetune.plan import plan as plan_recipe

    recipe = _as_recipe(recipe, overrides)
    return recipe, plan_recipe(recipe, hardware=hardware)


def plan(recipe, *, hardware: str | None = None, overrides: list[str] | None = None):
    """Plan a recipe on a hardware preset (name, file, or auto)."""
    return make_plan(recipe, hardware=hardware, overrides=overrides)[1]


def compile(recipe, *, hardware: str | None = None, overrides: list[str] | None = None,
            output: str | Path | None = None):
    """Plan and write the run directory's launch files; DoesNotFitError (exit 3) when nothing fits."""
    from finetune.compile import compile_recipe

    recipe = _as_recipe(recipe, overrides)
    return compile_recipe(recipe, run_dir=Path(output).resolve() if output else None, hardware=hardware)


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


def run(recipe, *, hardware: str | None = None, overrides: list[str] | None = None,
        output: str | Path | None = None, dry_run: bool = False, resume: str = "auto",
        node_rank: int | None = None, main_address: str | None = None,
        main_port: int | None = None) -> RunResult:
    """Plan, compile, launch, train, save (and push when the recipe has hub.repo)."""
    from finetune.compile.compiler import default_run_dir
    from finetune.launch import run_with_oom_retries
    from finetune.train.precheck import check_data

    recipe = _as_recipe(recipe, overrides)
    target = Path(output).resolve() if output else default_run_dir(recipe)
    created = not target.exists()  # bad input must not leave a half-written run dir behind
    try:
        # trackers installed, Hub push allowed (on the node that pushes): before anything is loaded
        check_destinations(recipe, pushes=node_rank in (None, 0))
        check_data(recipe)  # paths and rows, before anything is written
        spec = compile(recipe, hardware=hardware, output=target)
        _check_resume(Path(spec.run_dir), resume, world_size=spec.world_size)
    except FinetuneError:
        if created:
            shutil.rmtree(target, ignore_errors=True)
        raise
    run_dir = Path(spec.run_dir)
    log.info(spec.summary)
    if dry_run:
        return RunResult(run_dir, 0, launched=False)
    (run_dir / rundir.RANK_ERROR).unlink(missing_ok=True)
    code, spec = run_with_oom_retries(recipe, spec, hardware=hardware, resume=str(resume), node_rank=node_rank,
                                      main_address=main_address, main_port=main_port)
    if isinstance(code, int) and code not in (0, EXIT_PREEMPTED):
        code = rundir.read_rank_error(run_dir).get("exit_code", code)
    if code == EXIT_USAGE:  # a rank's preflight refused the recipe or data (its message is above)
        if created and not any((run_dir / rundir.CHECKPOINTS).glob("checkpoint-*")):
            shutil.rmtree(run_dir, ignore_errors=True)
        raise FinetuneError("stopped before training; fix what the message above names and run again",
                            hint="finetune validate RECIPE checks the recipe and its data without training")
    if not isinstance(code, int):  # multi-node without --node-rank: what to run on each node
        return RunResult(run_dir, 0, launched=False, instructions=str(code))
    if code == EXIT_PREEMPTED:
        return RunResult(run_dir, code)
    if code != 0:
        raise TrainingFailed(f"training exited with code {code}; the log above names the failing rank",
                             file=str(run_dir), hint=f"fix the cause, then rerun to resume from the "
                                                     f"last complete checkpoint in {run_dir}")
    summary = rundir.read_summary(run_dir)
    resolved = load_recipe(run_dir / rundir.RESOLVED_RECIPE, allow_resolved=True)
    pushed = None
    if resolved.hub.repo and (node_rank in (None, 0)):
        from finetune.hub import push_from_recipe

        pushed = push_from_recipe(run_dir)
    return RunResult(run_dir, 0, summary, pushed=pushed)


MEASURE_STEPS = 5


def _measuring(recipe: Recipe, *, steps: int, run_dir: Path) -> Recipe:
    """The recipe as `plan --measure` runs it: `steps` steps logged one by one, nothing evaluated,
    saved, pushed or reported elsewhere, no out-of-memory retry (the planned setting is what is measured)."""
    from finetune.launch import with_setting

    return with_setting(
        recipe, train={"max_steps": steps, "epochs": None, "logging_steps": 1, "eval_steps": None,
                       "oom_retries": 0},
        data={"eval_sources": [], "eval_fraction": None, "task_eval": None},
        output={"dir": str(run_dir), "save_every": None}, hub={"repo": None},
        logging={"report_to": ["none"], "profile_steps": None})


def measure(recipe, *, hardware: str | None = None, overrides: list[str] | None = None,
            steps: int = MEASURE_STEPS, keep: str | Path | None = None):
    """Run `steps` real steps at the planned setting on this machine's devices (the real launcher and
    trainer, in a temporary run dir that is removed afterwards unless `keep` names a directory to use)
    and return a finetune.measurement.Measurement: measured vs predicted peak per rank and tokens/s."""
    import tempfile

    from finetune.compile.files import write_atomic
    from finetune.launch import launch
    from finetune.measurement import RankPeak, read_measurement
    from finetune.plan.choose import HEADROOM
    from finetune.recipe.load import dump_recipe, recipe_dir
    from finetune.registry import get_preset
    from finetune.rundir import RESOLVED_RECIPE, read_oom_records
    from finetune.train.precheck import check_data

    if steps < 3:
        raise FinetuneError(f"--steps {steps}: a steady tokens/s needs at least 3 steps",
                            hint="measure 5 or more steps (the first ones warm up)")
    recipe = _as_recipe(recipe, overrides)
    check_data(recipe)
    run_dir = Path(keep).resolve() if keep else Path(tempfile.mkdtemp(prefix="finetune-measure-"))
    try:
        measuring = _measuring(recipe, steps=steps, run_dir=run_dir)
        spec = compile(measuring, hardware=hardware, output=run_dir)
        if spec.multi_node:
            raise FinetuneError(f"--measure runs on this machine; the plan spans {spec.num_nodes} nodes",
                                hint="measure one node's share with a one-node preset (--hardware auto)")
        resolved = load_recipe(run_dir / RESOLVED_RECIPE, allow_resolved=True)
        resolved.resolved.measure = True  # the ranks save nothing (finetune/train/run.py)
        write_atomic(run_dir / RESOLVED_RECIPE, dump_recipe(resolved))
        the_plan = plan(measuring, hardware=hardware)  # what compile planned (the recipe's own plan)
        device_gib = get_preset(the_plan.hardware_source or hardware or recipe.hardware,
                                base_dir=recipe_dir(recipe)).gpu_memory_gib
        log.info(spec.summary)
        code = launch(spec, extra_args=["--resume", "never"])
        oom = read_oom_records(run_dir)
        if code != 0 and not oom:
            raise TrainingFailed(f"the measurement run exited with code {code}; the log above names the failing rank",
                                 file=str(run_dir), hint="fix the cause and measure again")
        result = read_measurement(run_dir, plan=the_plan, steps=steps, usable_gib=HEADROOM * device_gib,
                                  device_gib=device_gib)
        if oom:  # the ranks' peaks at the failure, where no logged step wrote memory/rank-K.json
            result.out_of_memory = "; ".join(r["message"] for r in oom)
            logged = {r.rank for r in result.ranks}
            result.ranks += [RankPeak(r["rank"], r["peak_bytes"] / 2**30,
                                      (r.get("peak_allocated_bytes") or 0) / 2**30 or None)
                             for r in oom if r["rank"] not in logged]
    finally:
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    if not keep:
        result.run_dir = ""
    return result
