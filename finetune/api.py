"""The public Python API: load -> plan -> compile -> launch -> (push).

Load, plan and compile are pure and import no torch; `run` starts processes only
through finetune.launch.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from finetune.errors import EXIT_PREEMPTED, EXIT_USAGE, FinetuneError, TrainingFailed
from finetune.recipe import Recipe, load_recipe


def _check_resume(run_dir: Path, resume: str, *, world_size: int) -> None:
    """Refuse a resume the checkpoint cannot support before launching (RecipeError, exit 2)."""
    from finetune.train.checkpoint import check_resume, resolve_resume

    start = resolve_resume(str(resume), run_dir)
    if start is None:
        return
    resolved = load_recipe(run_dir / "recipe.resolved.yaml", allow_resolved=True)
    for note in check_resume(start, resolved, world_size=world_size):
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
    exit_code: int
    summary: dict = field(default_factory=dict)
    launched: bool = True


def run(recipe, *, hardware: str | None = None, overrides: list[str] | None = None,
        output: str | Path | None = None, dry_run: bool = False, resume: str = "auto",
        node_rank: int | None = None, main_address: str | None = None,
        main_port: int | None = None) -> RunResult:
    """Plan, compile, launch, train, save (and push when the recipe has hub.repo)."""
    from finetune.compile.compiler import default_run_dir
    from finetune.launch import launch
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
    print(spec.summary, flush=True)
    if dry_run:
        print(f"dry run: launch files are in {run_dir}; start with `bash {run_dir}/launch.sh`")
        return RunResult(run_dir, 0, launched=False)
    rank_error = run_dir / "logs" / "rank-error.json"  # finetune.train.run.RANK_ERROR
    rank_error.unlink(missing_ok=True)
    code = launch(spec, node_rank=node_rank, main_address=main_address, main_port=main_port,
                  extra_args=["--resume", str(resume)])
    if isinstance(code, int) and code not in (0, EXIT_PREEMPTED) and rank_error.is_file():
        code = json.loads(rank_error.read_text()).get("exit_code", code)
    if code == EXIT_USAGE:  # a rank's preflight refused the recipe or data (its message is above)
        if created and not any((run_dir / "checkpoints").glob("checkpoint-*")):
            shutil.rmtree(run_dir, ignore_errors=True)
        raise FinetuneError("stopped before training; fix what the message above names and run again",
                            hint="finetune validate RECIPE checks the recipe and its data without training")
    if not isinstance(code, int):  # multi-node without --node-rank: what to run on each node
        print(code)
        return RunResult(run_dir, 0, launched=False)
    if code == EXIT_PREEMPTED:
        print(f"preempted: a checkpoint was saved in {run_dir}; run the same command to resume")
        return RunResult(run_dir, code)
    if code != 0:
        raise TrainingFailed(f"training exited with code {code}; the log above names the failing rank",
                             file=str(run_dir), hint=f"fix the cause, then rerun to resume from the "
                                                     f"last complete checkpoint in {run_dir}")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    resolved = load_recipe(run_dir / "recipe.resolved.yaml", allow_resolved=True)
    if resolved.hub.repo and (node_rank in (None, 0)):
        from finetune.hub import push_from_recipe

        print(f"pushed to {push_from_recipe(run_dir)}")
    return RunResult(run_dir, 0, summary)
