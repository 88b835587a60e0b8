"""Property-based bad input: mutated recipes and datasets thrown at `finetune validate` and
`finetune run --dry-run` (in-process through finetune.cli.main, plus a few real subprocesses).
Every case ends with exit 0 (the mutation happened to be valid: the schema accepts the same dict),
2 (bad input) or, for run only, 3 (valid but does not fit); an error is one paragraph starting with
`error:`, never a traceback or an internal error, and a refused run leaves no run directory."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from finetune.cli import main
from finetune.errors import FinetuneError
from finetune.recipe.load import load_recipe
from tests.helpers.paths import ROOT

TINY_MODEL = ROOT / "data" / "tiny-llama"
ROWS = [
    {"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": w.upper()}]}
    for w in ("abc", "dog", "sun", "map", "kit", "fox")
]
BASE = {
    "model": {"name": str(TINY_MODEL), "dtype": "float32"},
    "adapter": {"type": "lora", "r": 8},
    "data": {"path": "data.jsonl", "format": "messages", "max_length": 32},
    "train": {"max_steps": 2, "global_batch_size": 2, "micro_batch_size": 2, "precision": "fp32"},
    "hardware": "cpu",
    "logging": {"report_to": ["none"]},
}
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))

leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(["", "🦙" * 5, "../../../../etc/passwd", "auto", "-1", "1e400", "null", "ａｕｔｏ"]),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


def _paths(tree, prefix=()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield prefix + (key,)
            yield from _paths(value, prefix + (key,))


@st.composite
def mutated_recipes(draw):
    recipe = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(recipe))
        path = draw(st.sampled_from(paths)) if paths else ("model",)
        parent = recipe
        for key in path[:-1]:
            parent = parent[key]
        op = draw(st.sampled_from(["replace", "delete", "unknown_key", "wrap_list", "nest"]))
        if op == "replace":
            parent[path[-1]] = draw(leaf)
        elif op == "delete":
            del parent[path[-1]]
        elif op == "unknown_key":
            target = parent[path[-1]] if isinstance(parent[path[-1]], dict) else parent
            target[draw(st.sampled_from(["lr", "learning_rate", "epoch", "modle", "säve", "x" * 200]))] = draw(leaf)
        elif op == "wrap_list":
            parent[path[-1]] = [parent[path[-1]]]
        else:
            parent[path[-1]] = {path[-1]: parent[path[-1]]}
    return recipe


def _workdir() -> Path:
    work = Path(tempfile.mkdtemp(prefix="fuzz-"))
    (work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return work


def _check_error(rc: int, err: str, *, allowed=(0, 2)) -> None:
    assert rc in allowed, (rc, err)
    assert "Traceback" not in err and "internal error" not in err, err
    if rc != 0:
        assert err.startswith("error: ") and "\n\n" not in err.strip(), err


def _schema_accepts(raw: dict, work: Path) -> bool:
    try:
        recipe = load_recipe(raw)
        recipe._source_dir = str(work)
        from finetune.data.check import check_data

        check_data(recipe)
    except FinetuneError:
        return False
    return True


@FUZZ
@given(recipe=mutated_recipes())
def test_fuzz_recipe_validate(recipe, capsys):
    work = _workdir()
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, allow_unicode=True))
    rc = main(["validate", str(path)])
    err = capsys.readouterr().err
    _check_error(rc, err)
    assert (rc == 0) == _schema_accepts(recipe, work), (rc, err, recipe)


@settings(FUZZ, max_examples=20)
@given(recipe=mutated_recipes())
def test_fuzz_recipe_run_dry_run_leaves_nothing_on_failure(recipe, capsys):
    work = _workdir()
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, allow_unicode=True))
    run_dir = work / "run"
    rc = main(["run", str(path), "--dry-run", "--output", str(run_dir)])
    err = capsys.readouterr().err
    _check_error(rc, err, allowed=(0, 2, 3))
    if rc == 0:
        assert (run_dir / "recipe.resolved.yaml").is_file()
    else:
        assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())


# (row mutation, the exit code it must give): empty lines and huge rows are valid input at this
# stage (over-long rows are counted against data.max_too_long_fraction in the ranks' preflight)
ROW_MUTATIONS = {
    "missing_column": (lambda r: {"conversation": r["messages"]}, 2),
    "wrong_role": (lambda r: {"messages": [{"role": "wizard", "content": "x"}, r["messages"][1]]}, 2),
    "not_an_object": (lambda r: [r], 2),
    "content_not_text": (lambda r: {"messages": [{"role": "user", "content": 7}, r["messages"][1]]}, 2),
    "messages_not_list": (lambda r: {"messages": "hello"}, 2),
    "empty_messages": (lambda r: {"messages": []}, 2),
    "huge_row": (lambda r: {"messages": [{"role": "user", "content": "a" * 200_000}, r["messages"][1]]}, 0),
}
LINE_MUTATIONS = {
    "invalid_json": ('{"messages": [', 2),
    "empty_line": ("   ", 0),
    "unicode_garbage": ("\ufeff🦙\x00", 2),
}


@settings(FUZZ, max_examples=30)
@given(
    kind=st.sampled_from(sorted(ROW_MUTATIONS) + sorted(LINE_MUTATIONS)),
    where=st.integers(0, len(ROWS) - 1),
    command=st.sampled_from(["validate", "run"]),
)
def test_fuzz_dataset(kind, where, command, capsys):
    work = _workdir()
    lines = [json.dumps(r) for r in ROWS]
    if kind in ROW_MUTATIONS:
        mutate, expected = ROW_MUTATIONS[kind]
        lines[where] = json.dumps(mutate(ROWS[where]))
    else:
        text, expected = LINE_MUTATIONS[kind]
        lines[where] = text
    (work / "data.jsonl").write_text("\n".join(lines) + "\n")
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(BASE))
    run_dir = work / "run"
    argv = ["validate", str(path)] if command == "validate" else ["run", str(path), "--dry-run", "-o", str(run_dir)]
    rc = main(argv)
    err = capsys.readouterr().err
    _check_error(rc, err)
    assert rc == expected, (kind, rc, err)
    if rc == 2:
        assert f"{work / 'data.jsonl'}" in err and f"row {where + 1}" in err, err
        assert not run_dir.exists()


def _cli(*args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "-m", "finetune.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )


def test_real_process_validate_unknown_key(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**BASE, "trian": {"lr": 1}}))
    proc = _cli("validate", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "trian" in proc.stderr and "train" in proc.stderr  # did-you-mean


@pytest.mark.slow
def test_real_process_run_rank_preflight_failure_leaves_no_run_dir(tmp_path):
    """Too many over-long examples are found by the ranks' tokenizer preflight: exit 2 and the
    run directory this run created is removed."""
    work = _workdir()
    (work / "data.jsonl").write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": "a" * 200}, {"role": "assistant", "content": "A"}]})
            + "\n"
            for _ in range(4)
        )
    )
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(BASE))
    run_dir = tmp_path / "run"
    proc = _cli("run", str(path), "-o", str(run_dir))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "longer than data.max_length" in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert not run_dir.exists()
