"""`finetune run` through the real CLI (plan, compile, accelerate launch, TRL) for SFT full / LoRA /
QLoRA and DPO LoRA on the tiny model: every output a run promises, finite falling loss, and an
adapter that reloads with peft and generates."""

from __future__ import annotations

import math
import subprocess

import pytest
import yaml

from finetune.rundir import read_metrics
from tests.helpers.paths import ROOT, SAMPLES, TINY_MODEL
from tests.helpers.processes import cli_argv, env
from tests.helpers.recipes import tiny_recipe

pytestmark = pytest.mark.slow

CASES = {
    "sft-lora": {},
    "sft-full": {"adapter": {"type": "full"}, "train": {"lr": 1e-3}},
    "sft-qlora": {"adapter": {"type": "qlora", "compute_dtype": "float32", "storage_dtype": "float32"}},
    "dpo-lora": {
        "method": {"type": "dpo", "beta": 0.1},
        "data": {
            "sources": [{"path": str(SAMPLES / "preference.jsonl"), "format": "preference", "max_samples": 64}],
            "eval_sources": [],
        },
    },
}


def _run(case, tmp_path, request):
    """(RUN_DIR, output) of `finetune run` for `case`; the LoRA case is the session's shared run (the same
    8 steps, checkpoint every 4, keep 1, plus trackers and evaluation), read and never changed here. Only that
    case asks for it: another case's worker would otherwise wait for the shared run to be built first."""
    from finetune.recipe.load import deep_merge

    if case == "sft-lora":
        trained = request.getfixturevalue("trained_cli_run")
        return trained.run_dir, trained.output
    common = {
        "train": {"max_steps": 8, "logging_steps": 1},
        "output": {"save_every": 4, "keep": 1},
        "logging": {"report_to": ["none"]},
        "data": {"allow_paths": [str(ROOT / "data")]},
    }
    recipe = tiny_recipe(**deep_merge(common, CASES[case]))
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        cli_argv(path, run_dir), cwd=tmp_path, env=env(tmp_path / "c"), capture_output=True, text=True, timeout=600
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return run_dir, out


@pytest.mark.parametrize("case", sorted(CASES))
def test_finetune_run_end_to_end(case, tmp_path, request):
    run_dir, out = _run(case, tmp_path, request)
    assert "=== finetune: done ===" in out and "Traceback" not in out
    # no start-up notices of libraries about parts this CPU run does not use (finetune/train/notices.py):
    # DeepSpeed's GPU-detection fallback, and bitsandbytes' CPU 4-bit kernel outside QLoRA
    assert "Setting accelerator to CPU" not in out
    assert case == "sft-qlora" or "gemm_4bit_forward" not in out

    for name in (
        "recipe.resolved.yaml",
        "accelerate.yaml",
        "plan.json",
        "launch.sh",
        "metrics.jsonl",
        "loss.png",
        "summary.json",
        "tokenizer.json",
    ):
        assert (run_dir / name).exists(), name
    rows = read_metrics(run_dir)
    train = [r for r in rows if r.get("loss") is not None]
    for key in ("step", "loss", "learning_rate", "grad_norm", "tokens_per_second", "peak_memory_gib"):
        assert key in train[0], key
    losses = [r["loss"] for r in train]
    assert all(math.isfinite(x) for x in losses)
    assert min(losses[-3:]) < losses[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("checkpoint-*")) == ["checkpoint-8"]
    assert (run_dir / "checkpoints" / "checkpoint-8" / "finetune_complete.json").exists()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run_dir)
    if case == "sft-full":
        model = AutoModelForCausalLM.from_pretrained(run_dir)
    else:
        from peft import PeftModel

        assert (run_dir / "adapter_model.safetensors").stat().st_size > 0
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY_MODEL), run_dir)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "abc"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out_ids = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out_ids.shape[-1] > ids["input_ids"].shape[-1]
