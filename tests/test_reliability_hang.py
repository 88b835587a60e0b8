"""A rank that dies mid-training makes a 2-process gloo run fail within a bounded time (the recipe's
collective timeout, set low here), with a non-zero exit and output naming the failed rank."""

from __future__ import annotations

import signal
import time

import pytest
from reliability_util import cli_argv, cpu_preset, losses, start, tree, wait_for, write_recipe

pytestmark = pytest.mark.slow


def test_a_dead_rank_fails_the_job_instead_of_hanging(tmp_path):
    preset = cpu_preset(tmp_path / "cpu2.yaml", procs=2)
    recipe = write_recipe(tmp_path / "recipe.yaml", hardware=str(preset),
                          train={"epochs": None, "max_steps": 400, "micro_batch_size": 4},
                          output={"save_every": None})
    run_dir = tmp_path / "run"
    proc = start(cli_argv(recipe, run_dir, "--set", "distributed.timeout_minutes=0.2"), cache=tmp_path / "cache")
    assert wait_for(lambda: (run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= 2,
                    proc=proc), proc.communicate()[0][-3000:]
    ranks = [p for p in tree(proc) if "finetune.train" in " ".join(p.cmdline()) and "accelerate" not in
             " ".join(p.cmdline())]
    assert len(ranks) == 2, [p.cmdline() for p in ranks]
    victim = next(p for p in ranks if "LOCAL_RANK" in p.environ() and p.environ()["LOCAL_RANK"] == "1")
    t0 = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    elapsed = time.monotonic() - t0
    assert proc.returncode not in (0, None), out[-3000:]
    assert elapsed < 60, elapsed  # 0.2 min collective timeout + teardown, not a hang
    assert "rank: 1" in out or "rank 1" in out, out[-3000:]
