"""scripts/gpu_queue.py packs jobs onto GPUs: order, waiting for inputs, backfilling, the time budget and
the RAM-disk clean-up, with shell jobs that only echo (no GPU needed: --gpus says how many to pretend)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]


def _queue(tmp_path: Path, jobs: list[dict], *, budget: float, gpus: int, scratch: list[str] = ()) -> dict:
    spec = tmp_path / "jobs.yaml"
    spec.write_text(yaml.safe_dump({"jobs": jobs, "scratch": list(scratch)}))
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_queue.py"),
            str(spec),
            "--results",
            str(tmp_path / "results"),
            "--budget",
            str(budget),
            "--gpus",
            str(gpus),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads((tmp_path / "results" / "queue.json").read_text())


def test_jobs_share_the_gpus_wait_for_inputs_and_respect_the_budget(tmp_path):
    used = tmp_path / "scratch" / "model"
    used.mkdir(parents=True)
    state = _queue(
        tmp_path,
        [
            {"name": "two", "gpus": 2, "est_s": 3, "cmd": "sleep 2; echo $CUDA_VISIBLE_DEVICES", "uses": [str(used)]},
            {"name": "one", "gpus": 1, "est_s": 1, "cmd": "echo $CUDA_VISIBLE_DEVICES"},
            {"name": "all", "gpus": 4, "est_s": 1, "after": ["two"], "cmd": "echo $CUDA_VISIBLE_DEVICES"},
            {"name": "too-long", "gpus": 1, "est_s": 500, "cmd": "echo never"},
            {"name": "cpu", "gpus": 0, "est_s": 1, "after": ["all"], "cmd": "echo cpu:$CUDA_VISIBLE_DEVICES"},
            {"name": "too-big", "gpus": 8, "est_s": 1, "cmd": "echo never"},
            {"name": "fails", "gpus": 1, "est_s": 1, "cmd": "exit 3"},
            {"name": "needs-failed", "gpus": 1, "est_s": 1, "after": ["fails"], "cmd": "echo never"},
            {"name": "needs-needs-failed", "gpus": 0, "est_s": 1, "after": ["needs-failed"], "cmd": "echo never"},
        ],
        budget=30,
        gpus=4,
        scratch=[str(tmp_path / "scratch")],
    )
    done = state["done"]
    assert done["two"]["gpus"] == [0, 1] and done["one"]["gpus"] == [2]  # side by side
    assert done["all"]["gpus"] == [0, 1, 2, 3] and done["all"]["started_s"] >= done["two"]["ended_s"]
    assert done["cpu"]["gpus"] == [] and done.pop("fails")["exit_code"] == 3
    assert all(j["exit_code"] == 0 for j in done.values())
    assert state["input_failed"] == {"needs-failed": "fails", "needs-needs-failed": "needs-failed"}
    assert state["waiting"] == ["too-long"] and state["too_big"] == ["too-big"]
    logs = tmp_path / "results" / "logs"
    assert logs.joinpath("all.log").read_text().splitlines()[-1] == "0,1,2,3"
    assert logs.joinpath("cpu.log").read_text().splitlines()[-1] == "cpu:"  # a CPU job sees no GPU
    assert not used.exists()  # its last user ended: the scratch copy is gone


def test_a_job_waiting_for_running_inputs_is_not_delayed_by_backfill(tmp_path):
    """The 70B runs wait for the checkpoint being written on one GPU: a long job on the idle GPUs would hold
    them past the write, a short one may use them."""
    state = _queue(
        tmp_path,
        [
            {"name": "write", "gpus": 1, "est_s": 3, "cmd": "sleep 3"},
            {"name": "train", "gpus": 4, "est_s": 1, "after": ["write"], "cmd": "true"},
            {"name": "long", "gpus": 1, "est_s": 6, "cmd": "true"},
            {"name": "short", "gpus": 1, "est_s": 1, "cmd": "true"},
        ],
        budget=30,
        gpus=4,
    )
    done = state["done"]
    assert done["short"]["started_s"] < done["write"]["ended_s"]  # fits before the head's start
    assert done["long"]["started_s"] >= done["train"]["started_s"]  # would have delayed it


def test_an_exclusive_job_runs_alone(tmp_path):
    """Host-bound timings (the offload tiers) are measured with nothing else on the machine."""
    state = _queue(
        tmp_path,
        [
            {"name": "before", "gpus": 1, "est_s": 2, "cmd": "sleep 1"},
            {"name": "alone", "gpus": 2, "est_s": 2, "exclusive": True, "cmd": "sleep 1"},
            {"name": "after", "gpus": 1, "est_s": 1, "cmd": "true"},
        ],
        budget=30,
        gpus=4,
    )
    done, alone = state["done"], state["done"]["alone"]
    for other in ("before", "after"):  # "after" may backfill before it, never beside it
        assert done[other]["ended_s"] <= alone["started_s"] or done[other]["started_s"] >= alone["ended_s"]


def test_a_fallback_runs_only_when_the_job_it_stands_in_for_failed(tmp_path):
    state = _queue(
        tmp_path,
        [
            {"name": "fast-way", "gpus": 2, "est_s": 2, "cmd": "sleep 1; exit 1"},
            {"name": "proven-way", "gpus": 2, "est_s": 1, "instead_of": "fast-way", "cmd": "echo fallback"},
            {"name": "works", "gpus": 1, "est_s": 1, "cmd": "echo ok"},
            {"name": "unneeded", "gpus": 1, "est_s": 1, "instead_of": "works", "cmd": "echo never"},
        ],
        budget=30,
        gpus=2,
    )
    done = state["done"]
    assert done["fast-way"]["exit_code"] == 1
    assert done["proven-way"]["exit_code"] == 0 and done["proven-way"]["started_s"] >= done["fast-way"]["ended_s"]
    assert "unneeded" not in done and state["not_needed"] == ["unneeded"]


def test_the_next_sessions_jobs_name_runs_that_exist():
    """scripts/gpu_session.yaml is run on a lent GPU machine, where a misspelt run costs device time."""
    import re

    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_shipped
    import gpu_validate

    spec = yaml.safe_load((ROOT / "scripts" / "gpu_session.yaml").read_text())
    matrix = gpu_validate.load_matrix(ROOT / spec["matrix"])
    names = {j.get("name") for j in spec["jobs"]}
    for job in spec["jobs"]:
        if "run" in job:
            assert job["run"] in matrix, job
            continue
        for name in re.findall(r"gpu_shipped\.py ([\w+-]+)", job["cmd"]):
            assert all(n in gpu_shipped.SHIPPED for n in name.split("+")), job
        for name in re.findall(r"gpu_validate\.py ([\w-]+)", job["cmd"]):
            assert name in matrix or name in gpu_validate.RUNS, job
        assert set(job.get("after", [])) <= names and job.get("instead_of", job["name"]) in names, job
