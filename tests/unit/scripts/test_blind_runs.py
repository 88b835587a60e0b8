"""scripts/plan_matrix.py plans a matrix run on CPU as the GPU machine's `--hardware auto` will, and
scripts/draw_blind_runs.py draws the same runs from the same seed and writes them as matrix entries that plan so."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import draw_blind_runs  # noqa: E402
import gpu_validate  # noqa: E402
import plan_matrix  # noqa: E402


def test_a_matrix_run_is_planned_as_its_gpu_machine_plans_it(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_validate, "MODELS", tmp_path / "models")  # the random model's config, here
    entry = plan_matrix.merge(
        yaml.safe_load(plan_matrix.DEFAULT_MATRIX.read_text())["defaults"],
        {"arch": "llama-3.2-1b", "seq": 1024, "batch": 8, "recipe": {"train": {"micro_batch_size": 2}}},
    )
    planned = plan_matrix.plan_entry("one", entry, folder=tmp_path)
    assert planned["fits"] and planned["strategy"] == "ddp" and planned["gpus"] == 1
    assert (planned["micro_batch_size"], planned["gradient_accumulation_steps"]) == (2, 4)
    assert planned["tokens_per_second"] > 0 and 0 < planned["per_gpu_memory_gib"] < 140
    line = plan_matrix.describe(planned)
    assert line.startswith("one: ddp 2 x 4 on 1") and "GiB" in line and "tokens/s" in line


def test_a_matrix_run_is_planned_at_a_probed_hosts_figure(tmp_path, monkeypatch):
    """--host-us: the plan `finetune run` makes on a machine whose host it timed; a faster host, a faster host-bound
    plan (micro-batch 1 of short rows: the host's launches are the step)."""
    monkeypatch.setattr(gpu_validate, "MODELS", tmp_path / "models")
    entry = plan_matrix.merge(
        yaml.safe_load(plan_matrix.DEFAULT_MATRIX.read_text())["defaults"],
        {"arch": "llama-3.2-1b", "seq": 512, "batch": 8, "recipe": {"train": {"micro_batch_size": 1}}},
    )
    floor = plan_matrix.plan_entry("one", entry, folder=tmp_path)
    probed = plan_matrix.plan_entry("one", entry, folder=tmp_path, host_s_per_kernel=30e-6)
    assert floor["host_us"] is None and probed["host_us"] == 30.0
    assert probed["tokens_per_second"] > 1.5 * floor["tokens_per_second"]
    assert plan_matrix.describe(probed).startswith("one at 30.0 us a kernel: ddp 1 x 8 on 1")


def test_draws_follow_the_seed_and_fit_the_card():
    rng_a, rng_b = draw_blind_runs.random.Random(7), draw_blind_runs.random.Random(7)
    first = [draw_blind_runs.draw(rng_a, gpus=g) for g in (1, 1, 2)]
    assert first == [draw_blind_runs.draw(rng_b, gpus=g) for g in (1, 1, 2)]
    for entry in first:
        gpus = entry.get("gpus", 1)
        if entry["recipe"]["adapter"]["type"] == "full":
            assert draw_blind_runs.billions(entry["arch"]) <= draw_blind_runs.FULL_MAX_B[gpus]
        assert (gpus > 1) == ("distributed" in entry["recipe"])


def test_the_script_writes_planned_matrix_entries(tmp_path):
    out = tmp_path / "drawn.yaml"
    env = {"FINETUNE_MODELS": str(tmp_path / "models"), "FINETUNE_VALIDATION_DIR": str(tmp_path / "work")}
    proc = subprocess.run(
        [sys.executable, "scripts/draw_blind_runs.py", "--seed", "3", "--count", "1", "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, **env, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    assert text.startswith("  # drawn by scripts/draw_blind_runs.py --seed 3")
    assert "  # planned: blind3-01: " in text
    runs = yaml.safe_load("runs:\n" + text)["runs"]
    assert list(runs) == ["blind3-01"] and runs["blind3-01"]["recipe"]["adapter"]["type"] in ("lora", "qlora", "full")
