"""Publishing through the real CLI: a run with a `hub:` section pushes at the end; merge and push
--merged work on what `finetune run` left. The Hub is tests/fakehub.py on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from finetune import rundir
from finetune.modelcard import parse_front_matter
from tests.helpers.fakehub import FakeHub
from tests.helpers.paths import ROOT
from tests.helpers.recipes import tiny_recipe

pytestmark = pytest.mark.slow
CANARY = "hf_CANARYe2eToken0987654321fedcba"


def _cli(*args, env, cwd):
    return subprocess.run(
        [sys.executable, "-m", "finetune.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_run_pushes_then_merge_and_push_merged(tmp_path):
    hub = FakeHub().start()
    try:
        env = {
            **os.environ,
            "HF_ENDPOINT": hub.url,
            "HF_TOKEN": CANARY,
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        recipe = tiny_recipe(
            hub={"repo": "acme/tiny-lora"}, logging={"report_to": ["none"]}, data={"allow_paths": [str(ROOT / "data")]}
        )
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe))
        run_dir = tmp_path / "run"
        proc = _cli("run", str(path), "--output", str(run_dir), env=env, cwd=tmp_path)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-3000:]
        assert "pushed to" in out

        files = hub.files("acme/tiny-lora")
        assert {
            "adapter_model.safetensors",
            "adapter_config.json",
            "README.md",
            "recipe.resolved.yaml",
            "loss.png",
        } <= set(files)
        assert not any(name.startswith("checkpoints/") for name in files)
        assert files["adapter_model.safetensors"] == (run_dir / "adapter_model.safetensors").read_bytes()
        card = parse_front_matter(files["README.md"].decode())
        assert card["library_name"] == "peft" and "sft" in card["tags"]
        assert hub.repos["acme/tiny-lora"].private is True

        # the push is recorded; a rerun has nothing to do and pushes nothing
        record = json.loads((run_dir / rundir.PUSHED).read_text())
        assert record["repo"] == "acme/tiny-lora" and record["url"], record
        head = hub.repos["acme/tiny-lora"].heads["main"]
        again = _cli("run", str(path), "--output", str(run_dir), env=env, cwd=tmp_path)
        assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr[-2000:]
        assert "dry run" not in again.stdout and hub.repos["acme/tiny-lora"].heads["main"] == head
        # a push stopped before it reached the Hub (a signal, a lost connection), so no record was
        # written: the rerun trains nothing and pushes
        (run_dir / rundir.PUSHED).unlink()
        del hub.repos["acme/tiny-lora"]
        trained = (run_dir / rundir.METRICS).read_bytes()
        again = _cli("run", str(path), "--output", str(run_dir), env=env, cwd=tmp_path)
        assert again.returncode == 0, again.stdout + again.stderr[-2000:]
        assert "did not finish: pushing it" in again.stdout and "pushed to" in again.stdout, again.stdout
        assert hub.files("acme/tiny-lora")["adapter_model.safetensors"] == files["adapter_model.safetensors"]
        assert (run_dir / rundir.PUSHED).is_file() and (run_dir / rundir.METRICS).read_bytes() == trained

        from finetune.cli import main

        merged = tmp_path / "merged"
        assert main(["merge", str(run_dir), "-o", str(merged)]) == 0  # no Hub involved: in this process
        assert list(merged.glob("*.safetensors")) and (merged / "config.json").exists()

        proc = _cli("push", str(run_dir), "--repo", "acme/tiny-merged", "--merged", "--public", env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        merged_files = hub.files("acme/tiny-merged")
        assert "config.json" in merged_files and any(n.endswith(".safetensors") for n in merged_files)
        assert hub.repos["acme/tiny-merged"].private is False

        # the token never lands in the run directory or the output
        assert CANARY not in out
        for file in run_dir.rglob("*"):
            if file.is_file():
                assert CANARY.encode() not in file.read_bytes(), file
    finally:
        hub.stop()
