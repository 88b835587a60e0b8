"""The launcher, end to end on CPU (gloo): the exact accelerate argv the compiler produces, run
through finetune.launch, with a small probe module standing in for the training entry point."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from finetune.compile import compile_run
from finetune.errors import EXIT_PREEMPTED, FinetuneError
from finetune.launch import NodeInstructions, launch
from finetune.plan.types import Plan
from finetune.recipe import load_recipe
from finetune.registry import get_model, get_preset
from tests.helpers.paths import ROOT

PROBE = "tests.helpers.dist_probe"
RECIPE = {
    "model": {"name": "tiny-llama", "dtype": "float32"},
    "data": {"path": "d.jsonl"},
    "train": {"precision": "fp32", "global_batch_size": 8},
    "hardware": "cpu",
}


def cpu_run(run_dir: Path, *, nodes: int, procs: int):
    preset = get_preset("cpu").model_copy(
        update={"gpus_per_node": procs, "nodes": nodes, "name": f"cpu-{nodes}x{procs}"}
    )
    world = nodes * procs
    plan = Plan(
        model="tiny-llama",
        hardware=preset.name,
        adapter="lora",
        method="sft",
        strategy="ddp",
        fits=True,
        micro_batch_size=2,
        gradient_accumulation_steps=8 // (2 * world),
        activation_checkpointing=False,
        per_gpu_memory_gib=0.3,
        world_size=world,
        num_nodes=nodes,
        gpus_per_node=procs,
        seq_len=64,
        global_batch_size=8,
        tokens_per_step=512,
        step_time_s=0.1,
        tokens_per_second=1.0,
        mfu=0.1,
        why="test",
        device="cpu",
    )
    return compile_run(
        load_recipe(RECIPE),
        plan,
        run_dir=run_dir,
        arch=get_model("tiny-llama"),
        preset=preset,
        module=PROBE,
        main_port=free_port(),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _importable_probe(monkeypatch):
    # the ranks import tests.helpers.dist_probe from the repository root
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.chdir(ROOT)


def ranks(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "probe").glob("rank*.json"))]


def launcher_cmd(run_dir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "finetune.launch", str(run_dir), *args]


@pytest.mark.slow
def test_two_processes_one_node(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    spec = cpu_run(run_dir, nodes=1, procs=2)
    monkeypatch.setenv("PROBE_MARK", "from-caller")
    rc = launch(run_dir, extra_args=["--extra", "1"], stream=False)
    assert rc == 0, (run_dir / "logs" / "launch-node0.log").read_text()[-3000:]
    seen = ranks(run_dir)
    assert [r["rank"] for r in seen] == [0, 1]
    for r in seen:
        assert r["world_size"] == 2 and r["backend"] == "gloo"
        assert r["distributed_type"].endswith("MULTI_CPU")
        assert r["allreduce_sum"] == 3.0  # ranks 1 + 2: they really talked to each other
        assert r["argv"] == [spec.module_args[0], "--extra", "1"]
        assert r["env"]["ACCELERATE_USE_CPU"] == "true"
        assert r["env"]["PROBE_MARK"] == "from-caller"  # the caller's environment reaches ranks
    assert "accelerate.commands.launch" in (run_dir / "logs" / "launch-node0.log").read_text()


@pytest.mark.slow
def test_one_process_plain_cpu(tmp_path):
    run_dir = tmp_path / "run"
    spec = cpu_run(run_dir, nodes=1, procs=1)
    assert "--multi_gpu" not in spec.argv() and "--main_process_port" not in spec.argv()
    assert launch(run_dir, stream=False) == 0
    (only,) = ranks(run_dir)
    assert (only["rank"], only["world_size"]) == (0, 1) and only["env"]["ACCELERATE_USE_CPU"].lower() == "true"


@pytest.mark.slow
def test_two_nodes_on_loopback(tmp_path):
    run_dir = tmp_path / "run"
    spec = cpu_run(run_dir, nodes=2, procs=1)
    # without a node rank nothing starts: the per-node commands come back for printing
    instructions = launch(run_dir)
    assert isinstance(instructions, NodeInstructions)
    assert len(instructions.commands) == 2 and instructions.sbatch == spec.files["job.sbatch"]
    assert not (run_dir / "probe").exists()
    with pytest.raises(FinetuneError, match="address"):
        launch(run_dir, node_rank=1)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            launcher_cmd(run_dir, "--node-rank", str(k), "--main-address", "127.0.0.1", "--main-port", port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k in (1, 0)
    ]  # the non-main node first: it waits for the rendezvous
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    seen = ranks(run_dir)
    assert [(r["rank"], r["node_rank"]) for r in seen] == [(0, 0), (1, 1)]
    assert all(r["world_size"] == 2 and r["allreduce_sum"] == 3.0 for r in seen)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_signal_reaches_every_rank(tmp_path, sig):
    run_dir = tmp_path / "run"
    cpu_run(run_dir, nodes=1, procs=2)
    proc = subprocess.Popen(
        launcher_cmd(run_dir, "--", "--wait-signal"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    probe = run_dir / "probe"
    deadline = time.monotonic() + 120
    while not (probe.is_dir() and len(list(probe.glob("ready*"))) == 2):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "ranks never became ready"
        time.sleep(0.1)
    proc.send_signal(sig)  # what Slurm (or a user's kill) does to the launcher
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == EXIT_PREEMPTED, out
    seen = ranks(run_dir)
    assert [r["rank"] for r in seen] == [0, 1], out
    assert all(r["signal"] == sig.name for r in seen), seen


def test_single_node_rejects_node_rank(tmp_path):
    cpu_run(tmp_path / "run", nodes=1, procs=1)
    with pytest.raises(FinetuneError, match="single-node"):
        launch(tmp_path / "run", node_rank=1)
    with pytest.raises(FinetuneError, match="no compiled launch"):
        launch(tmp_path / "elsewhere")
