"""`finetune eval`: a small local lm-eval task (a task YAML and a jsonl written here, no network) on a
tiny model trained in this session, base and trained side by side; the results land in summary.json,
eval/, metrics.jsonl and the model card."""

from __future__ import annotations

import json
import shutil

import pytest
from trained_run import trained_run

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is the `eval` extra")

from finetune.errors import FinetuneError  # noqa: E402
from finetune.evaluation import EvalError, evaluate, render_table  # noqa: E402

WORDS = ["esqdmo", "imhi", "eqvtqx", "qbfkzx", "mpqy", "abc", "hello", "cat"]


def write_task(directory):
    """A multiple-choice task: which continuation of `word ->` is the word in capitals."""
    directory.mkdir()
    data = directory / "upper.jsonl"
    data.write_text("".join(json.dumps({"word": w, "choices": [w.upper(), w[::-1], w + w], "label": 0}) + "\n"
                            for w in WORDS))
    (directory / "tiny_upper.yaml").write_text(
        "task: tiny_upper\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{word}} ->"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return directory


@pytest.mark.slow
def test_local_task_base_and_trained_side_by_side(tmp_path, tmp_path_factory):
    run = tmp_path / "run"
    shutil.copytree(trained_run(tmp_path_factory.getbasetemp() / "trained"), run)
    tasks = write_task(tmp_path / "tasks")
    entry = evaluate(run, "tiny_upper", include_path=tasks, limit=6, batch_size=4)

    acc = entry["results"]["tiny_upper"]["acc,none"]
    assert set(entry["results"]["tiny_upper"]) == {"acc,none"}
    assert 0 <= acc["base"] <= 1 and 0 <= acc["trained"] <= 1
    assert entry["limit"] == 6 and entry["tasks"] == ["tiny_upper"]
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

    card = ModelCard(render_model_card(load_recipe(run / "recipe.resolved.yaml", allow_resolved=True),
                                       run_dir=run, repo_id="acme/tiny", kind="adapter"))
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
