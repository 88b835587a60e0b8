"""End-to-end training on CPU with the shipped tiny model: SFT full/LoRA/QLoRA, DPO LoRA, resume,
the quickstart, and the entrypoint's exit code on bad data. Each run trains a few steps."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.rundir import read_metrics
from finetune.train.run import run_rank
from finetune.train.trainers import PADDING_FREE_PAIRS_NOTE
from tests.helpers.paths import ROOT, SAMPLES, TINY_MODEL
from tests.helpers.recipes import resolve_recipe, tiny_recipe

pytestmark = pytest.mark.slow


def _metrics(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir)


def _check_outputs(run_dir: Path, summary: dict, *, adapter: bool) -> list[dict]:
    assert (run_dir / "loss.png").stat().st_size > 1000
    assert (run_dir / "tokenizer.json").exists()
    if adapter:
        assert (run_dir / "adapter_model.safetensors").stat().st_size > 0
        assert (run_dir / "adapter_config.json").exists()
    else:
        assert list(run_dir.glob("model*.safetensors"))
    rows = [r for r in _metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, summary["steps"] + 1))
    for row in rows:
        for key in ("loss", "learning_rate", "grad_norm", "tokens_per_second", "peak_memory_gib", "epoch"):
            assert row[key] is not None and math.isfinite(row[key]), (key, row)
    assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["steps"] == summary["steps"] and saved["final_train_loss"] == rows[-1]["loss"]
    peaks = json.loads((run_dir / "memory" / "rank-0.json").read_text())  # rewritten as training goes
    assert peaks["final"] and peaks["step"] == summary["steps"] and peaks["host_rss_peak_gib"] > 0.1
    assert 0.1 < peaks["host_pss_sampled_peak_gib"] <= peaks["host_rss_peak_gib"] + 0.01
    # the logged steps' own peak, without the sample taken as training began
    assert 0.1 < peaks["host_pss_steps_peak_gib"] <= peaks["host_pss_sampled_peak_gib"]
    assert 0.0 < peaks["host_pss_anon_steps_peak_gib"] <= peaks["host_pss_anon_sampled_peak_gib"]
    # rewritten after the final save, whose host peak (a gathered sharded model) the figures then include
    assert peaks["saved_final"] and 0.1 < peaks["host_rss_peak_before_save_gib"] <= peaks["host_rss_peak_gib"]
    assert [p.name for p in (run_dir / "memory").iterdir()] == ["rank-0.json"]  # no temporary left
    return rows


def _generate(model, tokenizer) -> str:
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": "abc"}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > enc["input_ids"].shape[1]
    return tokenizer.decode(out[0])


def test_sft_lora_trains_and_adapter_reloads(tmp_path):
    run_dir = tmp_path / "run"
    summary = run_rank(resolve_recipe(tiny_recipe(), run_dir=run_dir), resume="never")
    _check_outputs(run_dir, summary, adapter=True)
    assert summary["eval_loss_final"] < summary["eval_loss_before"]
    assert any("eval_loss" in r for r in _metrics(run_dir))
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY_MODEL), run_dir)
    assert any("lora_A" in name for name, _ in model.named_parameters())
    _generate(model, AutoTokenizer.from_pretrained(run_dir))


def test_sft_full_trains_and_reloads(tmp_path):
    run_dir = tmp_path / "run"
    summary = run_rank(resolve_recipe(tiny_recipe(adapter="full", train={"lr": 1e-3}), run_dir=run_dir), resume="never")
    _check_outputs(run_dir, summary, adapter=False)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _generate(AutoModelForCausalLM.from_pretrained(run_dir), AutoTokenizer.from_pretrained(run_dir))


def test_sft_qlora_trains_on_cpu_with_4bit_base(tmp_path):
    run_dir = tmp_path / "run"
    recipe = tiny_recipe(adapter={"type": "qlora", "compute_dtype": "float32", "storage_dtype": "float32"})
    summary = run_rank(resolve_recipe(recipe, run_dir=run_dir), resume="never")
    _check_outputs(run_dir, summary, adapter=True)
    from peft import PeftModel
    from transformers import AutoTokenizer

    from finetune.recipe.load import load_recipe
    from finetune.train.model import load_model

    base = load_model(load_recipe(run_dir / "recipe.resolved.yaml", allow_resolved=True))
    assert any(type(m).__name__ == "Linear4bit" for m in base.modules())  # really quantized
    _generate(PeftModel.from_pretrained(base, run_dir), AutoTokenizer.from_pretrained(run_dir))


def test_dpo_lora_trains_padded_and_padding_free_alike(tmp_path, caplog):
    """data.packing with DPO runs each micro-batch's pairs as one padding-free row (finetune/train/dpo_pairs.py):
    the same steps give the same losses as TRL's padded pairs."""
    losses = {}
    for packing in (False, True):
        run_dir = tmp_path / f"packing-{packing}"
        recipe = tiny_recipe(
            method={"type": "dpo", "beta": 0.1},
            data={
                "sources": [{"path": str(SAMPLES / "preference.jsonl"), "format": "preference"}],
                "eval_sources": [],
                "max_length": 32,
                "packing": packing,
            },
        )
        caplog.clear()
        with caplog.at_level("INFO", logger="finetune.train"):
            summary = run_rank(resolve_recipe(recipe, run_dir=run_dir), resume="never")
        assert (PADDING_FREE_PAIRS_NOTE in caplog.text) is packing  # the hooks are attached only when asked
        rows = _check_outputs(run_dir, summary, adapter=True)
        assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-3)  # implicit reference == policy at step 1
        assert any("rewards/margins" in r for r in rows)
        losses[packing] = [r["loss"] for r in rows]
    assert losses[True] == pytest.approx(losses[False], rel=1e-3, abs=1e-4)


def test_resume_continues_from_the_last_complete_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    path = resolve_recipe(tiny_recipe(output={"save_every": 2, "keep": 2}), run_dir=run_dir)
    run_rank(path, resume="never")
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())
    assert ckpts == ["checkpoint-4", "checkpoint-6"]  # keep: 2
    # simulate a run killed while writing its last checkpoint
    (run_dir / "checkpoints" / "checkpoint-6" / "trainer_state.json").unlink()
    before = [r for r in _metrics(run_dir) if "loss" in r]
    summary = run_rank(path, resume="auto")
    assert summary["resumed_from"].endswith("checkpoint-4")
    assert summary["steps"] == 6
    rows = [r for r in _metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # steps 5-6 re-run, nothing from 0
    assert rows[:4] == before[:4]


def test_quickstart_learns(tmp_path):
    summary = run_rank(resolve_recipe(ROOT / "recipes" / "quickstart.yaml", run_dir=tmp_path / "qs"), resume="never")
    assert summary["task_eval_before"]["exact_match"] <= 0.05
    assert summary["task_eval_after"]["exact_match"] >= 0.8
    assert summary["eval_loss_final"] < summary["eval_loss_before"] / 4


def test_entrypoint_bad_data_exits_2_naming_file_and_row(tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = (ROOT / "data" / "quickstart" / "train.jsonl").read_text().splitlines()[:3]
    bad.write_text("\n".join(good + ['{"messages": oops}']) + "\n")
    path = resolve_recipe(
        tiny_recipe(data={"sources": [{"path": str(bad)}], "eval_sources": []}), run_dir=tmp_path / "run"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "finetune.train", str(path)], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{bad}: row 4: not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()  # failed before any model or trainer


def test_entrypoint_refuses_a_recipe_that_is_not_resolved(tmp_path):
    import yaml

    from finetune.train.__main__ import main

    plain = tmp_path / "recipe.yaml"
    plain.write_text(yaml.safe_dump(tiny_recipe()))
    assert main([str(plain)]) == 2
    with pytest.raises(Exception, match="not a resolved recipe"):
        run_rank(plain, resume="never")


def test_nonfinite_loss_stops_naming_step_and_rank(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.errors import TrainingFailed

    # a model with one NaN weight: the very first loss is NaN
    broken = tmp_path / "nan-model"
    shutil.copytree(TINY_MODEL, broken)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    model.save_pretrained(broken)
    recipe = tiny_recipe(model={"name": str(broken)}, adapter="full", data={"eval_sources": []})
    with pytest.raises(TrainingFailed) as info:
        run_rank(resolve_recipe(recipe, run_dir=tmp_path / "run"), resume="never")
    text = info.value.render()
    assert "non-finite loss=nan" in text and "at step 1 (rank 0 of 1)" in text, text
    # the NaN weight is the final norm's, so every gradient is NaN (the head is tied): the message names the span
    assert re.search(
        r"(\d+) of \1 trained tensors non-finite, from model\.embed_tokens\.weight to model\.norm\.weight", text
    ), text
    assert info.value.exit_code == 4


def test_bf16_lora_without_input_casts_and_profile_window(tmp_path):
    """bf16 autocast LoRA with peft's fp32 input casts off (finetune's default) trains, metrics rows carry
    cumulative tokens and time, and logging.profile_steps writes the profiler's outputs for that window."""
    run_dir = tmp_path / "run"
    recipe = tiny_recipe(
        model={"dtype": "bfloat16"},
        data={"packing": True},
        train={"precision": "bf16", "max_steps": 5},
        logging={"profile_steps": [2, 4]},
    )
    summary = run_rank(resolve_recipe(recipe, run_dir=run_dir), resume="never")
    rows = [r for r in _metrics(run_dir) if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"] and summary["steps"] == 5
    assert rows[-1]["tokens_seen"] > rows[0]["tokens_seen"] > 0 and rows[-1]["elapsed_s"] > 0
    profile = run_dir / "profile"
    assert (profile / "rank-0.trace.json.gz").stat().st_size > 1000
    assert "aten::mm" in (profile / "rank-0.txt").read_text()
    assert json.loads((profile / "rank-0.json").read_text())["steps"] == 2
