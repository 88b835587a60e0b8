"""The CLI: exit codes, messages without tracebacks, a plan without heavy imports."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from finetune import strategies
from tests.helpers.paths import ROOT
from tests.helpers.processes import heavy_imports


def finetune(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "finetune.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_a_405b_plan_imports_nothing_heavy():
    # what keeps `finetune plan` well under a second (scripts/bench_plan.py times it): no torch, transformers or
    # CUDA import on its way, from the CLI's entry to the plan of the largest shipped recipe
    code = (
        "import sys, json\n"
        "from finetune.cli import main\n"
        "rc = main(['plan', 'recipes/llama405b-qlora.yaml', '--hardware', 'server-8xh100', '--json'])\n"
        "print(json.dumps({'rc': rc}), file=sys.stderr)\n"
    )
    proc, heavy = heavy_imports(code)
    report = json.loads([line for line in proc.stderr.splitlines() if line.startswith("{")][-1])
    assert report["rc"] == 0, proc.stdout
    assert heavy == []
    plan = json.loads(proc.stdout)
    assert plan["fits"] is True


def test_plan_json_fields_for_70b_lora():
    proc = finetune("plan", "recipes/llama70b-lora.yaml", "--hardware", "server-8xh100", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    for key in (
        "strategy",
        "fits",
        "per_gpu_memory_gib",
        "micro_batch_size",
        "gradient_accumulation_steps",
        "activation_checkpointing",
        "candidates",
    ):
        assert key in plan
    assert plan["strategy"] == "fsdp2" and plan["fits"]
    assert plan["per_gpu_memory_gib"] < 80
    for cand in plan["candidates"]:
        assert {"strategy", "fits", "per_gpu_memory_gib", "step_time_s"} <= set(cand)


def test_405b_full_never_fits_on_gpu_memory_alone():
    proc = finetune(
        "plan", "recipes/llama405b-lora.yaml", "--hardware", "server-8xh100", "--set", "adapter.type=full", "--json"
    )
    plan = json.loads(proc.stdout)
    # it fits only by offloading (the preset has host RAM and NVMe for it), so the plan succeeds
    assert proc.returncode == 0 and plan["fits"] and strategies.offloads(plan["strategy"]), plan["strategy"]
    on_gpu = [c for c in plan["candidates"] if not strategies.offloads(c["strategy"])]
    assert on_gpu and not any(c["fits"] for c in on_gpu)


def test_plan_table_is_readable():
    proc = finetune("plan", "recipes/llama8b-lora.yaml", "--hardware", "workstation-1x4090")
    assert proc.returncode == 0, proc.stderr  # 8B LoRA fits one 24 GB card
    assert "Traceback" not in proc.stderr
    # one GPU: plain DDP (one process) is the chosen row of the table, and the summary says so
    assert re.search(r"^ddp .*<- chosen$", proc.stdout, re.M), proc.stdout
    assert "choice: ddp" in proc.stdout


def test_does_not_fit_exits_3_with_suggestions():
    proc = finetune(
        "compile",
        "recipes/llama70b-full.yaml",
        "--hardware",
        "workstation-1x4090",
        "-o",
        "/tmp/finetune-should-not-exist",
    )
    assert proc.returncode == 3, proc.stderr
    assert "nothing fits" in proc.stderr and "Traceback" not in proc.stderr
    assert not Path("/tmp/finetune-should-not-exist").exists()


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["validate", "recipes/llama8b-lora.yaml", "--set", "train.shceduler=linear"],
            "train.shceduler: unknown key; did you mean train.scheduler?",
        ),
        (["validate", "recipes/nope.yaml"], "file not found"),
        (["plan", "recipes/llama8b-lora.yaml", "--hardware", "server-8xh10"], "server-8xh100"),
        (["validate", "recipes/llama8b-lora.yaml", "--set", "adapter.r=lots"], "adapter.r"),
        (["run"], "error:"),
    ],
)
def test_bad_input_exits_2_without_traceback(args, needle):
    proc = finetune(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_presets_and_models_list():
    proc = finetune("presets")
    assert proc.returncode == 0
    for name in ("cpu", "workstation-1x4090", "server-8xh100", "cluster-4x8xh100", "server-8xmi300x"):
        assert name in proc.stdout
    proc = finetune("models")
    assert proc.returncode == 0 and "llama-3.1-8b" in proc.stdout


def test_api_run_returns_results_and_logs_progress_without_printing(tmp_path, capsys, caplog):
    import logging

    from finetune.api import run
    from finetune.cli import main as cli_main

    with caplog.at_level(logging.INFO, logger="finetune.api"):
        result = run(ROOT / "recipes" / "quickstart.yaml", output=tmp_path / "run", dry_run=True)
    assert capsys.readouterr().out == ""  # the CLI prints; the API returns and logs
    assert result.exit_code == 0 and not result.launched and result.instructions is None
    assert any("strategy ddp" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "run" / "launch.sh").is_file()
    rc = cli_main(["run", str(ROOT / "recipes" / "quickstart.yaml"), "--dry-run", "--output", str(tmp_path / "cli")])
    out = capsys.readouterr().out
    assert rc == 0 and "strategy ddp" in out and f"dry run: launch files are in {tmp_path / 'cli'}" in out
    # once the command is over, the API prints nothing again (main() may run inside a user's process)
    run(ROOT / "recipes" / "quickstart.yaml", output=tmp_path / "after", dry_run=True)
    assert capsys.readouterr().out == ""


def test_plan_says_when_it_planned_without_the_recipes_data(tmp_path):
    """`finetune plan` answers "will it fit" before the data exists, and says that run and validate will refuse it."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "model: {name: meta-llama/Llama-3.1-8B}\nadapter: lora\ndata: {sources: [{path: data/train.jsonl}]}\n"
    )
    proc = finetune("plan", str(recipe), "--hardware", "server-8xh100")
    assert proc.returncode == 0, proc.stderr
    assert f"warning: planned without reading data.sources[0] ({tmp_path}/data/train.jsonl): file not found" in (
        proc.stdout + proc.stderr
    )
