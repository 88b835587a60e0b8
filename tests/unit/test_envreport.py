"""`finetune --version` and `finetune env`: the stack for a bug report, never a secret."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version

import finetune
from finetune.envreport import relevant_env
from tests.helpers.paths import ROOT

CANARY = "hf_CANARYenvToken0123456789"


def _cli(*args, env=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "finetune.cli", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_version():
    proc = _cli("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"finetune {finetune.__version__}"


def test_env_reports_the_stack_and_hides_secrets():
    proc = _cli("env", env={"HF_TOKEN": CANARY, "WANDB_API_KEY": CANARY, "CUDA_VISIBLE_DEVICES": "0,1"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"- transformers: {version('transformers')}" in out and f"- torch: {version('torch')}" in out
    assert f"- python: {sys.version.split()[0]}" in out
    assert "- --hardware auto: " in out and "CUDA available to torch: " in out
    assert "HF_TOKEN=set (value hidden)" in out and "WANDB_API_KEY=set (value hidden)" in out
    assert "CUDA_VISIBLE_DEVICES=0,1" in out
    assert CANARY not in out + proc.stderr
    report = json.loads(_cli("env", "--json", env={"HF_TOKEN": CANARY}).stdout)
    assert report["packages"]["trl"] == version("trl") and CANARY not in json.dumps(report)


def test_relevant_env_filters_and_masks():
    shown = relevant_env(
        {"HOME": "/root", "NCCL_DEBUG": "INFO", "MLFLOW_TRACKING_PASSWORD": "x", "HF_HUB_OFFLINE": "1"}
    )
    assert shown == {"HF_HUB_OFFLINE": "1", "MLFLOW_TRACKING_PASSWORD": "set (value hidden)", "NCCL_DEBUG": "INFO"}
