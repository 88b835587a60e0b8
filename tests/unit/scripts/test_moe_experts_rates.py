"""scripts/moe_experts_rates.py, run on the CPU on a small Mixtral-shaped config: it finds the experts module
transformers builds, routes the tokens top-k, times forward + backward with the experts frozen and trained, and
writes the cases (Liger's fused MoE needs a GPU and liger-kernel, so it is left out here with a message)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_script_times_transformers_experts_on_a_small_config(tmp_path):
    config = json.loads((ROOT / "tests/data/hub_configs/mixtral-8x7b/config.json").read_text())
    config.update(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "rates.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "moe_experts_rates.py"),
            str(tmp_path / "config.json"),
            "--tokens",
            "64",
            "--iters",
            "1",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    cases = json.loads(out.read_text())["cases"]
    transformers_cases = [c for c in cases if c["impl"] == "transformers"]
    assert [c["weights_trainable"] for c in transformers_cases] == [False, True]
    for case in transformers_cases:
        assert case["experts"] == 8 and case["top_k"] == 2 and case["tokens"] == 64
        assert case["seconds"] > 0 and case["tflops"] >= 0
