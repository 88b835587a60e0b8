"""`finetune plan --measure` on CPU: a few real steps of the quickstart recipe through the real CLI,
launcher and trainer; measured vs predicted peak (host RSS on the cpu preset) and steady tokens/s."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from finetune.api import plan
from finetune.measurement import read_measurement, render_measurement, steady_rate
from finetune.plan.choose import HEADROOM
from finetune.rundir import CHECKPOINTS, METRICS, memory_file
from tests.helpers.paths import ROOT
from tests.helpers.processes import env

QUICKSTART = ROOT / "recipes" / "quickstart.yaml"


def test_steady_rate_skips_the_warm_up_steps():
    # (step, seconds, cumulative tokens): a slow first step, then 100 tokens/s
    points = [(1, 5.0, 100), (2, 6.0, 200), (3, 7.0, 300), (4, 8.0, 400)]
    assert steady_rate(points, warmup=2) == pytest.approx(100.0)
    assert steady_rate(points, warmup=4) is None  # one point is no rate


@pytest.mark.slow
def test_plan_measure_on_the_quickstart_recipe(tmp_path):
    keep = tmp_path / "measured"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "finetune.cli",
            "plan",
            str(QUICKSTART),
            "--measure",
            "--steps",
            "4",
            "--keep",
            str(keep),
            "--json",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in out + proc.stderr
    result = json.loads(out.strip().splitlines()[-1])
    planned = plan(str(QUICKSTART))
    # the planned setting ran: quickstart's micro-batch 16, predicted peak and tokens/s from the planner
    assert (
        f"micro-batch {planned.micro_batch_size} x accumulation {planned.gradient_accumulation_steps}"
        in result["setting"]
    )
    assert result["predicted_gib"] == pytest.approx(planned.per_gpu_memory_gib, abs=1e-3)
    assert result["predicted_tokens_per_s"] == pytest.approx(planned.tokens_per_second, rel=1e-3)
    assert result["peak_kind"] == "host RSS peak" and result["device"] == "cpu"
    assert result["measured_peak_gib"] > 0.1 and result["tokens_per_s"] > 0 and result["fits"]
    assert result["usable_gib"] == pytest.approx(HEADROOM * 16)  # the cpu preset: 16 GiB per process
    # what was printed: per-rank measured vs predicted, the ratios, the headroom verdict, the label
    for text in (
        "host RSS peak GiB",
        "predicted/measured",
        "tokens/s (steady, after step 2)",
        "fits",
        "cpu preset: the peak is the process's host RSS",
    ):
        assert text in out, out[-3000:]
    # the run: 4 steps logged one by one, no checkpoint, no model saved, nothing evaluated
    rows = [json.loads(line) for line in (keep / METRICS).read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert not any("eval_loss" in r for r in rows)
    assert not (keep / CHECKPOINTS).exists() or not any((keep / CHECKPOINTS).iterdir())
    assert not list(keep.glob("*.safetensors"))
    assert (keep / memory_file(0)).is_file()

    # the verdict on the same measured files against a device whose usable memory is below the peak
    tight = read_measurement(
        keep,
        plan=planned,
        steps=4,
        usable_gib=result["measured_peak_gib"] * 0.9,
        device_gib=result["measured_peak_gib"],
    )
    assert not tight.fits and "DOES NOT FIT" in render_measurement(tight)


def test_measuring_profiles_only_a_kept_run(tmp_path):
    from finetune.api import _measuring
    from finetune.launch import with_setting
    from finetune.recipe.load import load_recipe

    recipe = with_setting(load_recipe(QUICKSTART), logging={"profile_steps": (2, 3)})
    kept = _measuring(recipe, steps=4, run_dir=tmp_path, kept=True)
    assert kept.logging.profile_steps == (2, 3) and kept.train.max_steps == 4
    assert kept.output.save_every is None and kept.hub.repo is None
    # a temporary run dir is removed afterwards: a profile there would be work nobody reads
    assert _measuring(recipe, steps=4, run_dir=tmp_path, kept=False).logging.profile_steps is None
