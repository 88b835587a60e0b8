"""scripts/make_random_model.py's tokenizer: saved as transformers loads it for the model type, so the planner's
count (tokenizer.json through `tokenizers`, finetune/data/lengths.py) and the run's (AutoTokenizer) agree."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.paths import ROOT

TEXT = "Hello world, this is a test.\nAnother line   with  spaces and 1234 numbers!"


@pytest.mark.parametrize("model", ["qwen2.5-7b", "llama-3.1-8b"])
def test_random_model_tokenizer_counts_as_the_run_does(tmp_path, model):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    config = ROOT / "tests" / "data" / "hub_configs" / model / "config.json"
    script = ROOT / "scripts" / "make_random_model.py"
    subprocess.run([sys.executable, str(script), str(config), str(tmp_path), "--config-only"], check=True)
    run = AutoTokenizer.from_pretrained(str(tmp_path))
    planner = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert len(run(TEXT, add_special_tokens=False)["input_ids"]) == len(planner.encode(TEXT).ids)
    assert run.chat_template and run.eos_token == "<|end|>"
