"""Hostile recipes and data files: exit 2 naming the key or file (and row) and a fix, never a traceback
or "internal error". Duplicate keys, coerced numbers, peer-tool key names, a batch larger than the
data, broken data files, huge rows, `/` as the current directory, a killed token-cache write."""

from __future__ import annotations

import json
import os
import time

import pytest

from finetune.cli import main
from finetune.recipe.paths import allowed_roots
from finetune.train import cache
from tests.helpers.paths import TINY_MODEL
from tests.helpers.recipes import write_recipe


def _validate(capsys, recipe) -> str:
    rc = main(["validate", str(recipe)])
    captured = capsys.readouterr()
    assert rc == 2, captured.out + captured.err
    err = captured.err
    assert "fix:" in err and "Traceback" not in err and "internal error" not in err, err
    return err


RECIPE_HEAD = f"model: {{name: {TINY_MODEL}}}\ndata: {{path: data.jsonl, format: text}}\n"


@pytest.mark.parametrize(
    "text,needles",
    [
        (RECIPE_HEAD + "train: {lr: 0.001}\ntrain: {max_steps: 3}\n", ["duplicate key 'train'", "line 4"]),
        (RECIPE_HEAD + "train:\n  lr: 0.001\n  lr: 0.002\n", ["duplicate key 'lr'"]),
        (RECIPE_HEAD + "train: {max_steps: true}\n", ["train.max_steps", "not true"]),
        (RECIPE_HEAD + 'train: {max_steps: "60"}\n', ["train.max_steps", "without quotes"]),
        (RECIPE_HEAD + "train: {max_steps: 0x10}\n", ["train.max_steps", "'0x10'"]),
        (RECIPE_HEAD + "train: {max_steps: 1e30}\n", ["train.max_steps", "whole number"]),
        (RECIPE_HEAD + "train: {learning_rate: 0.001}\n", ["train.learning_rate", "train.lr"]),
        (RECIPE_HEAD + "adapter: {rank: 8}\n", ["adapter.rank", "adapter.r"]),
        (RECIPE_HEAD + "train: {max_seq_length: 512}\n", ["data.max_length"]),
        (RECIPE_HEAD + "train: {global_batch_size: 4000}\n", ["train.global_batch_size", "at most 4"]),
    ],
)
def test_recipes_are_taken_literally(tmp_path, capsys, text, needles):
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(4)))
    (tmp_path / "recipe.yaml").write_text(text)
    err = _validate(capsys, tmp_path / "recipe.yaml")
    for needle in needles:
        assert needle in err, err


def test_yaml_floats_and_plain_numbers_still_load(tmp_path, capsys):
    (tmp_path / "data.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    (tmp_path / "recipe.yaml").write_text(RECIPE_HEAD + "train: {lr: 2e-4, max_steps: 60, global_batch_size: 1}\n")
    assert main(["validate", str(tmp_path / "recipe.yaml")]) == 0, capsys.readouterr().err


BAD_FILES = {
    "latin1.jsonl": (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', ["row 2", "not UTF-8"]),
    "deep.json": (b"[" * 200_000 + b"]" * 200_000, ["nested too deeply"]),
    "deep.jsonl": (b'{"text": ' + b"[" * 200_000 + b"]" * 200_000 + b"}\n", ["row 1", "nested too deeply"]),
    "corrupt.parquet": (b"PAR1" + os.urandom(300), ["parquet"]),
    "quote.csv": (b'text\n"an unterminated quote\nmore\n', ["csv"]),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_broken_data_files_name_the_file_and_row(tmp_path, capsys, name):
    content, needles = BAD_FILES[name]
    (tmp_path / name).write_bytes(content)
    recipe = write_recipe(
        tmp_path / "recipe.yaml",
        data={"sources": [{"path": str(tmp_path / name), "format": "text"}]},
        train={"global_batch_size": 1, "micro_batch_size": 1},
    )
    err = _validate(capsys, recipe)
    assert name in err, err
    for needle in needles:
        assert needle in err, err


def test_a_directory_named_like_a_data_file(tmp_path, capsys):
    (tmp_path / "x.jsonl").mkdir()
    recipe = write_recipe(tmp_path / "recipe.yaml", data={"sources": [{"path": str(tmp_path / "x.jsonl")}]})
    assert "is a directory" in _validate(capsys, recipe)


def test_a_huge_row_is_dropped_without_being_tokenized():
    from finetune.train.preflight import min_tokens

    row = {"messages": [{"role": "user", "content": "x" * 10_000_000}, {"role": "assistant", "content": "y"}]}
    assert min_tokens(row, longest_token=16) > 600_000  # far over any max_length: never tokenized
    assert min_tokens({"text": "short"}, longest_token=16) == 0


def test_the_filesystem_root_as_current_directory_allows_nothing_extra(tmp_path):
    roots = allowed_roots(tmp_path, cwd=tmp_path.anchor)
    assert all(root != type(root)("/") for root in roots)
    assert tmp_path.resolve() in roots


def test_a_killed_token_cache_write_leaves_no_temporary_directory(tmp_path):
    stale = tmp_path / ".tmp-abc-123"
    (stale / "data").mkdir(parents=True)
    old = time.time() - cache.STALE_TMP_S - 60
    os.utime(stale, (old, old))
    fresh = tmp_path / ".tmp-def-456"  # a writer still at work
    fresh.mkdir()

    class Exploding:
        def save_to_disk(self, path):
            os.makedirs(path)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cache.save_entry(tmp_path, "key", Exploding(), {})
    assert not stale.exists() and fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-def-456"]


def test_a_huge_row_goes_through_preflight_as_too_long(tmp_path):
    import resource

    from transformers import AutoTokenizer

    from finetune.train.preflight import _tokenize

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    rows = [
        {
            "messages": [{"role": "user", "content": c}, {"role": "assistant", "content": "ok"}],
            "_file": "f.jsonl",
            "_row": i + 1,
        }
        for i, c in enumerate(["hi", "word " * 2_000_000, "yo"])
    ]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ds = _tokenize(rows, tokenizer, method="sft", assistant_only_loss=True, max_length=32)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert ds["_length"][1] > 32 and ds["_length"][0] <= 32 and ds["_row"] == [1, 2, 3]
    assert len(ds["input_ids"][1]) == 0 and grown_mib < 500, grown_mib
