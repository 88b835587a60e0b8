"""Two "nodes" on loopback: two `finetune run` launcher processes with node ranks 0 and 1 and the
same rendezvous address train one model together (gloo), as on a real two-node cluster."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT
from tests.helpers.processes import env
from tests.helpers.recipes import cpu_preset, write_recipe

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_train_one_model(tmp_path):
    preset = cpu_preset(
        tmp_path / "two-cpu-nodes.yaml", procs=1, nodes=2, inter_node_fabric="ethernet", inter_node_bandwidth_gbps=1
    )
    recipe = write_recipe(
        tmp_path / "recipe.yaml",
        hardware=str(preset),
        train={"epochs": None, "max_steps": 4},
        output={"save_every": None},
    )
    port = str(_free_port())

    # without a node rank, a multi-node run prints what to run on each node and starts nothing
    shown = subprocess.run(
        [sys.executable, "-m", "finetune.cli", "run", str(recipe), "--output", str(tmp_path / "n0")],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert "--node-rank 1" in shown.stdout and "job.sbatch" in shown.stdout
    assert not (tmp_path / "n0" / "summary.json").exists()

    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "finetune.cli",
                "run",
                str(recipe),
                "--output",
                str(tmp_path / f"n{rank}"),
                "--node-rank",
                str(rank),
                "--main-address",
                "127.0.0.1",
                "--main-port",
                port,
            ],
            cwd=ROOT,
            env=env(tmp_path / "cache"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]

    plan = json.loads((tmp_path / "n0" / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["num_nodes"] == 2
    summary = json.loads((tmp_path / "n0" / "summary.json").read_text())  # node 0 holds global rank 0
    assert summary["steps"] == 4
    assert (tmp_path / "n0" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "n1" / "summary.json").exists()  # one model, written once
