"""`finetune generate` and `finetune.generate()`: adapter and merged models, batched = one by one,
streaming to the console, prompt files, and the interactive chat through a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import finetune
from finetune.inference import GenerateError, read_prompts
from tests.helpers.paths import ROOT

PROMPTS = ["The quick", "Hello world! How", "LoRA"]


@pytest.fixture(scope="module")
def runs(tiny_runs):
    return tiny_runs


def _cli(*args, stdin=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "finetune.cli", "generate", *map(str, args)],
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_batched_equals_one_by_one_and_merged_equals_adapter(runs, tmp_path):
    batched = finetune.generate(runs["lora"], PROMPTS, batch_size=2, max_new_tokens=6)
    single = [finetune.generate(runs["lora"], p, max_new_tokens=6)[0] for p in PROMPTS]
    assert batched == single and all(batched), batched  # the adapter generates tokens, left padding is exact
    base = finetune.generate(runs["base"], PROMPTS, max_new_tokens=6)
    assert base != batched  # the adapter changes what the model says

    from finetune.merging import merge

    merge(runs["lora"], tmp_path / "merged")
    assert finetune.generate(tmp_path / "merged", PROMPTS, max_new_tokens=6) == batched
    with pytest.raises(GenerateError, match="no merged model here"):
        finetune.generate(runs["lora"], "x", merged=True)
    with pytest.raises(GenerateError, match="needs a chat template"):  # this tokenizer has none
        finetune.generate(runs["lora"], [{"role": "user", "content": "hi"}])


def test_prompt_files(tmp_path):
    (tmp_path / "p.jsonl").write_text(
        '{"prompt": "ab"}\n\n{"messages": [{"role": "user", "content": "cd"}, '
        '{"role": "assistant", "content": "CD"}]}\n'
    )
    assert read_prompts(tmp_path / "p.jsonl") == ["ab", [{"role": "user", "content": "cd"}]]
    (tmp_path / "p.txt").write_text("one\n\ntwo\n")
    assert read_prompts(tmp_path / "p.txt") == ["one", "two"]
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(GenerateError, match="line 1 has neither"):
        read_prompts(tmp_path / "bad.jsonl")


@pytest.mark.slow
def test_cli_streams_one_prompt_and_writes_a_file_of_prompts(runs, tmp_path, capsys):
    from finetune.cli import main

    expected = finetune.generate(runs["lora"], "The quick", max_new_tokens=6)[0]
    capsys.readouterr()
    assert main(["generate", str(runs["lora"]), "The quick", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip() == expected  # TextStreamer printed the new tokens (not the prompt)
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS) + "\n")
    assert (
        main(
            [
                "generate",
                str(runs["lora"]),
                "--file",
                str(tmp_path / "p.txt"),
                "--batch-size",
                "2",
                "--max-new-tokens",
                "6",
                "-o",
                str(tmp_path / "out.jsonl"),
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS
    assert [r["completion"] for r in rows] == finetune.generate(runs["lora"], PROMPTS, max_new_tokens=6)


def test_cli_needs_one_source_of_prompts(runs, capsys):
    from finetune.cli import main

    assert main(["generate", str(runs["lora"])]) == 2
    assert "exactly one of PROMPT, --file or --chat (got none)" in capsys.readouterr().err


@pytest.mark.slow
def test_chat_with_a_trained_run_through_stdin(trained_run):
    run_dir = trained_run
    proc = _cli(run_dir, "--chat", "--max-new-tokens", 4, stdin="abc\n/reset\nxyz\n/exit\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("model> ") == 2 and "(history cleared)" in proc.stdout
    assert "Traceback" not in proc.stderr
    # the chat uses the run's chat template: the same reply as a one-message prompt
    reply = finetune.generate(run_dir, "xyz", max_new_tokens=4)[0]
    assert proc.stdout.rstrip().endswith("model> " + reply if reply else "model>")
