"""Slurm for real: a one-node cluster on localhost (tests/slurm_cluster.py) runs the job.sbatch that
`finetune compile` writes for the quickstart (shortened): it trains, is preempted by SIGUSR1 (what
`#SBATCH --signal=USR1@120` sends before the time limit), saves a checkpoint, exits 75, requeues
itself (`--requeue` + the script's `scontrol requeue`), resumes from the checkpoint and finishes.
Skips with the reason where slurm-wlm cannot be installed or its daemons cannot start."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.slurm_cluster import PARTITION, Cluster, ensure_installed

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = ensure_installed()
    if why:
        pytest.skip(f"Slurm test skipped: {why}")
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    why = c.start()
    if why:
        c.stop()
        pytest.skip(f"Slurm test skipped: {why}")
    yield c
    c.stop()


STEPS = 400
REQUEUE_START_DELAY_S = 3


def test_quickstart_sbatch_trains_is_preempted_requeues_and_finishes(cluster, tmp_path):
    from finetune.api import compile as compile_recipe

    run_dir = tmp_path / "run"
    compile_recipe(
        ROOT / "recipes" / "quickstart.yaml",
        output=run_dir,
        overrides=[
            # enough steps that the signal lands while it trains (~40 steps/s on 2 cores; the test polls every 0.5 s)
            f"train.max_steps={STEPS}",
            f"train.eval_steps={STEPS // 2}",
            "train.logging_steps=1",
            "data.task_eval.n=2",
            f"slurm.partition={PARTITION}",
            "slurm.account=finetune-ci",
            "slurm.time=00:15:00",
        ],
    )
    sbatch = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --requeue" in sbatch and "#SBATCH --time=00:15:00" in sbatch
    env = {
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "FINETUNE_CACHE_DIR": str(tmp_path / "cache"),
    }
    job_id = cluster.run("sbatch", "--parsable", str(run_dir / "job.sbatch"), env=env, cwd=tmp_path).stdout.strip()
    out = run_dir / f"slurm-{job_id}.out"
    info = cluster.job(job_id)
    assert info["Partition"] == PARTITION and info["Account"] == "finetune-ci" and info["TimeLimit"] == "00:15:00"

    def log() -> str:
        return out.read_text(errors="replace") if out.is_file() else ""

    # it trains; then the preemption signal Slurm sends before the time limit
    cluster.wait(lambda: f"step 2/{STEPS}" in log(), timeout=300, what="the job to train two steps")
    cluster.run("scancel", "--signal=USR1", job_id)
    cluster.wait(
        lambda: cluster.job(job_id).get("Restarts") == "1",
        timeout=180,
        what="the job to checkpoint, exit 75 and requeue itself",
    )
    # the batch output file can lag behind the job's state: wait for the lines, not just the restart
    cluster.wait(
        lambda: "SIGUSR1 received" in log() and "requeueing job" in log(),
        timeout=60,
        what="the preemption and requeue lines in the job's output",
    )
    # Slurm holds a requeued batch job for about two minutes before it may start again; let it start
    # sooner, but not within the second its old credential was revoked: slurmd compares whole seconds and
    # kills a relaunch from that second as "Job credential revoked"
    cluster.wait(lambda: cluster.job(job_id).get("JobState") == "PENDING", timeout=120, what="the requeued job to pend")
    time.sleep(REQUEUE_START_DELAY_S)
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    state = cluster.wait(
        lambda: (s := cluster.job(job_id).get("JobState")) in ("COMPLETED", "FAILED", "CANCELLED") and s,
        timeout=400,
        what="the requeued job to finish",
    )
    text = log()
    assert state == "COMPLETED" and cluster.job(job_id)["ExitCode"] == "0:0", (
        f"{text[-3000:]}\n--- scontrol show job\n{cluster.job(job_id)}\n{cluster.log_tail(40)}"
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["resumed_from"].endswith(
        os.sep + "checkpoint-" + text.split("saving checkpoint-")[1].split()[0]
    )
    assert "=== finetune: done ===" in text and summary["final_train_loss"] < summary["first_train_loss"]
