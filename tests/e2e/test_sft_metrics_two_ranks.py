"""train.deferred_metrics on two ranks (gloo): the once-per-log gather of the deferred metric sums logs
what TRL's per-micro-batch gathers log, through the real CLI and launcher: the train rows of metrics.jsonl
(loss, entropy, mean_token_accuracy, num_tokens) and the eval rows, which go through the same gather."""

from __future__ import annotations

import pytest

from finetune.rundir import read_metrics
from tests.helpers.paths import QUICKSTART_DATA
from tests.helpers.processes import cli_argv, run
from tests.helpers.recipes import cpu_preset, write_recipe

pytestmark = pytest.mark.slow
EVAL = ("eval_loss", "eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens")
TRAIN = ("loss", "entropy", "mean_token_accuracy", "num_tokens")


def _metrics(tmp_path, *, deferred: bool) -> tuple[list[dict], list[dict]]:
    name = "deferred" if deferred else "trl"
    preset = cpu_preset(tmp_path / "two-cpu-procs.yaml", procs=2)
    recipe = write_recipe(
        tmp_path / f"{name}.yaml",
        hardware=str(preset),
        # micro-batch 2 on each of 2 ranks: 2 accumulation steps per optimizer step
        train={"epochs": None, "max_steps": 3, "micro_batch_size": 2, "eval_steps": 1, "deferred_metrics": deferred},
        # 16 examples: 4 full batches of 2 on each rank, none padded by duplicates
        data={"eval_sources": [{"path": str(QUICKSTART_DATA / "eval.jsonl"), "max_samples": 16}]},
        output={"save_every": None},
    )
    done = run(cli_argv(recipe, tmp_path / name), cache=tmp_path / "cache")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = read_metrics(tmp_path / name)
    train = [{k: r[k] for k in TRAIN} for r in rows if "loss" in r]
    return train, [{k: r[k] for k in EVAL} for r in rows if "eval_loss" in r]


def test_two_ranks_log_what_trl_logs(tmp_path):
    (my_train, mine), (trl_train, trl) = _metrics(tmp_path, deferred=True), _metrics(tmp_path, deferred=False)
    assert [r["loss"] for r in my_train] == [r["loss"] for r in trl_train] and len(my_train) == 3
    for a, b in zip(my_train, trl_train, strict=True):
        assert a["num_tokens"] == b["num_tokens"] > 0
        for key in ("entropy", "mean_token_accuracy"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (key, a, b)
    assert len(mine) == len(trl) >= 3 and mine[-1]["eval_num_tokens"] > 0
    for a, b in zip(mine, trl, strict=True):
        assert a["eval_num_tokens"] == b["eval_num_tokens"]
        for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
            # the ranks' sums are added in another order: equal up to float rounding
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (key, a, b)
