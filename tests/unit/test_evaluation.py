"""`finetune eval`: the small local lm-eval task shipped in data/lm-eval (a task YAML and a jsonl, no
network) on a tiny model trained in this session, base and trained side by side; the results land in summary.json,
eval/, metrics.jsonl and the model card."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers.paths import ROOT

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the `eval` extra")

from finetune.errors import FinetuneError  # noqa: E402
from finetune.evaluation import EvalError, evaluate, render_table  # noqa: E402


@pytest.mark.slow
def test_local_task_base_and_trained_side_by_side(tmp_path, trained_run, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    monkeypatch.chdir(ROOT)  # the shipped task's data path is relative to the repository root
    entry = evaluate(
        run, "tiny_upper", include_path=ROOT / "data" / "lm-eval", limit=6, batch_size=4, apply_chat_template=True
    )

    acc = entry["results"]["tiny_upper"]["acc,none"]
    assert set(entry["results"]["tiny_upper"]) == {"acc,none"}
    assert 0 <= acc["base"] <= 1 and 0 <= acc["trained"] <= 1
    assert entry["limit"] == 6 and entry["tasks"] == ["tiny_upper"] and entry["chat_template"] is True
    for label in ("base", "trained"):  # lm-eval's own results, per model
        saved = json.loads((run / "eval" / f"{label}.json").read_text())
        assert saved["results"]["tiny_upper"]["acc,none"] == acc[label]
        assert saved["n-samples"]["tiny_upper"]["effective"] == 6
    summary = json.loads((run / "summary.json").read_text())
    assert summary["lm_eval"] == json.loads(json.dumps(entry)) and summary["steps"] == 8  # the rest is kept
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last == {"step": 8, "lm_eval/tiny_upper/acc,none": acc["trained"]}
    assert "tiny_upper acc,none" in render_table(entry)

    from huggingface_hub import ModelCard

    from finetune.modelcard import render_model_card
    from finetune.recipe import load_recipe

    card = ModelCard(
        render_model_card(
            load_recipe(run / "recipe.resolved.yaml", allow_resolved=True),
            run_dir=run,
            repo_id="acme/tiny",
            kind="adapter",
        )
    )
    found = {(r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert found[("tiny_upper", "acc")] == round(acc["trained"], 4)


def test_errors_before_any_model_loads(tmp_path, capsys):
    from finetune.cli import main

    with pytest.raises(FinetuneError, match="no adapter"):
        evaluate(tmp_path, "tiny_upper")
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(EvalError, match="not a directory"):
        evaluate(tmp_path, "tiny_upper", include_path=tmp_path / "missing")
    assert main(["eval", str(tmp_path), "--tasks", " , "]) == 2
    assert "no tasks given" in capsys.readouterr().err
