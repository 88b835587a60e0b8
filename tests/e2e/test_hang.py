"""A rank that dies mid-training makes a 2-process gloo run fail within a bounded time (the recipe's
collective timeout, set low here), with a non-zero exit and output naming the failed rank."""

from __future__ import annotations

import signal
import time

import pytest

from finetune.errors import EXIT_TRAINING_FAILED
from tests.helpers.processes import cli_argv, losses, start, tree, wait_for
from tests.helpers.recipes import cpu_preset, write_recipe

pytestmark = pytest.mark.slow


def _two_rank_run_in_training(tmp_path):
    """Start a 2-process gloo run (collective timeout 12 s) and wait until it trains; return the
    launcher process and local rank 1's process."""
    preset = cpu_preset(tmp_path / "cpu2.yaml", procs=2)
    recipe = write_recipe(
        tmp_path / "recipe.yaml",
        hardware=str(preset),
        train={"epochs": None, "max_steps": 400, "micro_batch_size": 4},
        output={"save_every": None},
    )
    run_dir = tmp_path / "run"
    proc = start(cli_argv(recipe, run_dir, "--set", "distributed.timeout_minutes=0.2"), cache=tmp_path / "cache")
    assert wait_for(lambda: (run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= 2, proc=proc), (
        proc.communicate()[0][-3000:]
    )
    ranks = [
        p for p in tree(proc) if "finetune.train" in " ".join(p.cmdline()) and "accelerate" not in " ".join(p.cmdline())
    ]
    assert len(ranks) == 2, [p.cmdline() for p in ranks]
    victim = next(p for p in ranks if "LOCAL_RANK" in p.environ() and p.environ()["LOCAL_RANK"] == "1")
    return proc, victim


def test_a_dead_rank_fails_the_job_instead_of_hanging(tmp_path):
    proc, victim = _two_rank_run_in_training(tmp_path)
    t0 = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode == EXIT_TRAINING_FAILED, out[-3000:]
    assert elapsed < 60, elapsed  # 0.2 min collective timeout + teardown, not a hang
    assert "rank: 1" in out or "rank 1" in out, out[-3000:]


def test_a_stalled_rank_fails_the_job_within_the_collective_timeout(tmp_path):
    """A rank that stops answering (SIGSTOP: alive but silent, like a hung GPU or a stuck NFS read)
    makes the other rank's collective time out after distributed.timeout_minutes; the job then
    fails, naming the ranks, instead of waiting forever. After the first failure torchrun gives the
    stopped rank a fixed 30 s before SIGKILL."""
    proc, victim = _two_rank_run_in_training(tmp_path)
    t0 = time.monotonic()
    victim.send_signal(signal.SIGSTOP)
    try:
        out, _ = proc.communicate(timeout=150)
    finally:
        if victim.is_running():
            victim.send_signal(signal.SIGCONT)
            victim.kill()
    elapsed = time.monotonic() - t0
    assert proc.returncode == EXIT_TRAINING_FAILED, out[-3000:]
    assert elapsed < 90, elapsed  # 12 s collective timeout + torchrun's 30 s kill grace + teardown
    assert "Timed out" in out, out[-3000:]  # the waiting rank's collective gave up ...
    assert "rank      : 1" in out, out[-3000:]  # ... and the summary names the stalled rank
