"""scripts/probe_layer_profile.py times the host probe's micro-batch at each depth three ways and tables its
operators, on CPU here (its figures mean something on a GPU only)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT


@pytest.mark.slow  # a process that builds and trains the probe's models
def test_each_depth_is_timed_three_ways_and_profiled(tmp_path):
    out = tmp_path / "probe"
    cmd = [sys.executable, str(ROOT / "scripts/probe_layer_profile.py"), "--out", str(out), "--device", "cpu"]
    subprocess.run(
        [*cmd, "--depths", "1", "2", "--liger", "off", "--profile"], check=True, capture_output=True, timeout=300
    )
    timings = json.loads((out / "timings.json").read_text())
    assert timings["layer"]["adapter"] == "lora" and timings["liger"] is False
    for way in ("collector_on", "collector_frozen", "collector_off"):
        seconds = timings["seconds_per_micro_batch"][way]
        assert set(seconds) == {"1", "2"} and all(s > 0 for s in seconds.values())
    ops = json.loads((out / "profile.json").read_text())["ops"]
    # the deeper model runs more of a layer's operators: twice the linears' calls
    assert ops["2"]["aten::linear"]["calls"] > ops["1"]["aten::linear"]["calls"]
    assert "aten::linear" in (out / "profile-2.txt").read_text()
