"""kill -9 of a whole run (CLI, launcher, every rank) at random moments, including during a save:
running the same command again resumes from the last complete checkpoint, and every later step's
loss matches an uninterrupted run within 1e-4, for a kill in the first epoch and in later ones."""

from __future__ import annotations

import random
import re

import pytest

from tests.helpers.once import once_per_session
from tests.helpers.processes import checkpoints, cli_argv, kill_tree, losses, run, start, wait_for
from tests.helpers.recipes import resolve_recipe, write_recipe

pytestmark = pytest.mark.slow
STEPS = 12  # 3 epochs x 4 steps; checkpoints every 3 steps, keep 2


def _baseline(root) -> dict[int, float]:
    """The uninterrupted reference: the same recipe planned and compiled for real, trained in this process (a rank
    is a rank: its losses equal a `finetune run` launch's exactly; no launch spent on it)."""
    from finetune.train.run import run_rank

    run_rank(resolve_recipe(write_recipe(root / "recipe.yaml"), run_dir=root / "baseline"), resume="never")
    return losses(root / "baseline")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    recipe = write_recipe(root / "recipe.yaml")
    cache = root / "cache"
    baseline = once_per_session(tmp_path_factory, "kill-baseline", _baseline)  # for both pytest-xdist workers
    assert sorted(baseline) == list(range(1, STEPS + 1))
    return recipe, cache, baseline


def _complete(run_dir, name):
    return lambda: checkpoints(run_dir).get(name) is True


def _started(run_dir, name):
    return lambda: name in checkpoints(run_dir)


def _past_step(run_dir, step):
    def check():
        try:
            return max(losses(run_dir), default=0) >= step
        except FileNotFoundError:
            return False

    return check


CASES = {
    # after checkpoint-3 is complete, at a random step boundary of the first epoch (steps 3-4)
    "first-epoch": lambda rng, d: [_complete(d, "checkpoint-3"), _past_step(d, rng.choice([3, 4]))],
    # the moment the Trainer starts writing checkpoint-9 (third epoch), before or while it is marked
    "during-save-later-epoch": lambda rng, d: [_started(d, "checkpoint-9")],
    # a random step of the second or third epoch
    "random-later-epoch": lambda rng, d: [_complete(d, "checkpoint-6"), _past_step(d, rng.randint(6, 10))],
}


@pytest.mark.parametrize("case", list(CASES))
def test_kill9_then_resume_matches_uninterrupted(setup, tmp_path, case):
    recipe, cache, baseline = setup
    rng = random.Random(f"kill-{case}")  # seeded: the same moments on every CI run
    run_dir = tmp_path / "run"
    proc = start(cli_argv(recipe, run_dir), cache=cache)
    try:
        for condition in CASES[case](rng, run_dir):
            assert wait_for(condition, proc=proc), f"the run ended before the kill point: {proc.stdout.read()[-3000:]}"
    finally:
        kill_tree(proc)
    assert not (run_dir / "summary.json").exists(), "killed too late: the run had finished"
    before = checkpoints(run_dir)
    last_complete = max((int(n.split("-")[1]) for n, ok in before.items() if ok), default=0)

    again = run(cli_argv(recipe, run_dir), cache=cache)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-4000:]
    resumed = re.search(r"resuming from \S*checkpoint-(\d+)", out)
    assert resumed and int(resumed.group(1)) == last_complete, (before, out[-3000:])
    if case == "first-epoch":
        assert last_complete == 3  # resumed inside epoch 0 (3 of its 4 batches skipped)
    else:
        assert last_complete >= 6  # resumed in a later epoch
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(baseline[step], abs=1e-4), (step, got[step], baseline[step])
    final = checkpoints(run_dir)
    assert final == {"checkpoint-9": True, "checkpoint-12": True}, final  # incomplete ones are gone
