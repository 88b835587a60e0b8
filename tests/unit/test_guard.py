"""The output directory: finetune writes only into directories it made, never into the model's or the
data's; one run per directory at a time (a lock that survives kill -9); a finished run is recognised;
resume and rerun checks (recipe and data content) run before any file is written."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time

import pytest

from finetune import rundir
from finetune.cli import main
from finetune.errors import FinetuneError
from finetune.guard import LOCK_STALE_S, RunLock
from tests.helpers.paths import TINY_MODEL, TRAIN
from tests.helpers.processes import checkpoints, cli_argv, kill_tree, losses, run, start, wait_for
from tests.helpers.recipes import write_recipe
from tests.helpers.run_dirs import tree_hashes
from tests.helpers.trained_run import TWO_STEPS_NO_CHECKPOINT


def test_a_foreign_directory_is_refused_and_left_untouched(tmp_path, capsys):
    user = tmp_path / "mine"
    (user / "checkpoints" / "checkpoint-500").mkdir(parents=True)
    for name in (
        "config.json",
        "model.safetensors",
        "metrics.jsonl",
        "summary.json",
        "checkpoints/checkpoint-500/optimizer.pt",
    ):
        (user / name).write_text(f"the user's {name}")
    before = tree_hashes(user)
    recipe = write_recipe(tmp_path / "recipe.yaml")
    assert main(["run", str(recipe), "--output", str(user)]) == 2
    err = capsys.readouterr().err
    assert "not made by finetune" in err and "fix:" in err and "output.dir" in err, err
    assert tree_hashes(user) == before


def test_the_output_can_never_be_the_model_or_the_data_directory(tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model)
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(TRAIN, data / "train.jsonl")
    recipe = write_recipe(
        tmp_path / "recipe.yaml",
        model={"name": str(model)},
        data={"sources": [{"path": str(data / "train.jsonl"), "max_samples": 32}]},
    )
    before = tree_hashes(tmp_path)
    for output, what in ((model, "the model's directory"), (data, "a data file"), (tmp_path, "the model's")):
        assert main(["run", str(recipe), "--output", str(output), "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert what in err and "fix:" in err, err
    assert tree_hashes(tmp_path) == before


def test_an_empty_directory_is_taken_and_marked(tmp_path, capsys):
    out = tmp_path / "empty"
    out.mkdir()
    recipe = write_recipe(tmp_path / "recipe.yaml")
    assert main(["run", str(recipe), "--output", str(out), "--dry-run"]) == 0
    assert (out / rundir.OWNER).is_file() and (out / rundir.RESOLVED_RECIPE).is_file()
    assert not (out / rundir.lock_file(0)).exists()  # released
    assert main(["run", str(recipe), "--output", str(out), "--dry-run"]) == 0  # ours now


def test_lock_names_the_holder_and_is_taken_over_when_it_is_gone(tmp_path):
    held = RunLock(tmp_path).acquire()
    with pytest.raises(FinetuneError) as info:
        RunLock(tmp_path).acquire()
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in info.value.render()
    held.release()
    # a holder killed with -9 on this host: its pid is gone
    (tmp_path / rundir.lock_file(0)).write_text(json.dumps({"pid": 2**22 + 7, "host": socket.gethostname()}))
    lock = RunLock(tmp_path).acquire()
    assert "is gone" in lock.note
    lock.release()
    # another node sharing the filesystem: alive while its heartbeat is fresh, stale after LOCK_STALE_S
    path = tmp_path / rundir.lock_file(0)
    path.write_text(json.dumps({"pid": 1, "host": "other-node"}))
    with pytest.raises(FinetuneError, match="other-node"):
        RunLock(tmp_path).acquire()
    old = time.time() - LOCK_STALE_S - 5
    os.utime(path, (old, old))
    lock = RunLock(tmp_path).acquire()
    assert "no heartbeat from other-node" in lock.note
    lock.release()
    # nodes of one run hold their own locks
    with RunLock(tmp_path, node_rank=0), RunLock(tmp_path, node_rank=1):
        pass


@pytest.mark.slow
def test_a_second_run_into_the_same_directory_is_refused_and_a_killed_ones_lock_is_taken_over(tmp_path):
    recipe = write_recipe(
        tmp_path / "recipe.yaml", train={"epochs": None, "max_steps": 400}, output={"save_every": None}
    )
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    first = start(cli_argv(recipe, run_dir), cache=cache)
    try:
        assert wait_for(
            lambda: max(losses(run_dir), default=0) >= 1 if (run_dir / "metrics.jsonl").exists() else False, proc=first
        )
        second = run(cli_argv(recipe, run_dir), cache=cache)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        assert f"pid {first.pid} on host {socket.gethostname()}" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr + second.stdout
    finally:
        kill_tree(first)
    steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    assert len(steps) == len(set(steps)), "two runs appended to one metrics.jsonl"
    third = run(cli_argv(recipe, run_dir, "--dry-run"), cache=cache)  # the lock of the killed run is stale
    assert third.returncode == 0 and "took over" in third.stdout, third.stdout[-2000:] + third.stderr[-2000:]


@pytest.mark.slow
def test_a_finished_run_is_recognised_and_checks_run_before_any_write(tmp_path):
    data = tmp_path / "train.jsonl"
    shutil.copy(TRAIN, data)
    recipe = write_recipe(
        tmp_path / "recipe.yaml",
        train={"epochs": None, "max_steps": 4},
        data={"sources": [{"path": str(data), "max_samples": 32}]},
        output={"save_every": 2, "keep": 1},
    )
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    first = run(cli_argv(recipe, run_dir), cache=cache)
    assert first.returncode == 0, first.stderr[-3000:]
    assert checkpoints(run_dir) == {"checkpoint-4": True}  # every 2 steps, keep 1
    done = tree_hashes(run_dir)

    again = run(cli_argv(recipe, run_dir), cache=cache)  # identical: nothing to do, nothing touched
    assert again.returncode == 0 and "is complete: it finished at step 4" in again.stdout, again.stdout[-2000:]
    assert tree_hashes(run_dir) == done

    changed = run(cli_argv(recipe, run_dir, "--set", "train.lr=0.01"), cache=cache)
    assert changed.returncode == 2 and "train.lr (0.003 -> 0.01)" in changed.stderr, changed.stderr[-2000:]
    assert "Traceback" not in changed.stderr
    assert tree_hashes(run_dir) == done  # refused before recipe.resolved.yaml, launch.sh, plan.json were rewritten

    rows = data.read_text().splitlines()
    data.write_text("\n".join(rows[1:] + rows[:1]) + "\n")  # same path, same rows, new content
    replaced = run(cli_argv(recipe, run_dir), cache=cache)
    assert replaced.returncode == 2 and "data.sources.0.path (same path, new content" in replaced.stderr, (
        replaced.stderr[-2000:]
    )
    assert tree_hashes(run_dir) == done
    # an interrupted run (no finished.json) is checked the same way by the resume check
    finished = (run_dir / rundir.FINISHED).read_bytes()
    (run_dir / rundir.FINISHED).unlink()
    interrupted = tree_hashes(run_dir)
    resumed = run(cli_argv(recipe, run_dir), cache=cache)
    assert resumed.returncode == 2 and "cannot resume" in resumed.stderr and "new content" in resumed.stderr
    assert tree_hashes(run_dir) == interrupted
    data.write_text("\n".join(rows) + "\n")
    (run_dir / rundir.FINISHED).write_bytes(finished)  # finished again, as the first run left it

    # a longer run continues the finished one from its last checkpoint, naming the safe change
    longer = run(cli_argv(recipe, run_dir, "--set", "train.max_steps=6"), cache=cache)
    out = longer.stdout + longer.stderr
    assert longer.returncode == 0, out[-3000:]
    assert "changed safely: train.max_steps (4 -> 6)" in out and re.search(r"resuming from \S*checkpoint-4", out), out[
        -3000:
    ]
    assert sorted(losses(run_dir)) == list(range(1, 7)) and checkpoints(run_dir) == {"checkpoint-6": True}
    assert json.loads((run_dir / rundir.FINISHED).read_text())["step"] == 6
    assert not (run_dir / rundir.PREVIOUS).exists()


@pytest.mark.slow
def test_without_checkpoints_a_rerun_never_trains_past_the_end_and_start_over_keeps_the_old_run(tmp_path, two_step_run):
    recipe = write_recipe(tmp_path / "recipe.yaml", **TWO_STEPS_NO_CHECKPOINT)
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    shutil.copytree(two_step_run, run_dir)  # what `finetune run` of this recipe left (built once per session)
    done = tree_hashes(run_dir)
    again = run(cli_argv(recipe, run_dir), cache=cache)
    assert again.returncode == 0 and "is complete" in again.stdout and tree_hashes(run_dir) == done
    grown = run(cli_argv(recipe, run_dir, "--set", "train.max_steps=3"), cache=cache)
    assert grown.returncode == 2 and "kept no checkpoint" in grown.stderr and "--resume never" in grown.stderr
    assert tree_hashes(run_dir) == done
    previous = run_dir / rundir.PREVIOUS
    fresh = run(cli_argv(recipe, run_dir, "--resume", "never", "--set", "train.max_steps=3"), cache=cache)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert sorted(losses(run_dir)) == [1, 2, 3] and not previous.exists()


def test_a_new_run_sets_the_previous_one_aside_instead_of_deleting_it(tmp_path):
    from finetune.api import set_aside_previous

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "checkpoint-4").mkdir(parents=True)
    for name in (rundir.SUMMARY, rundir.METRICS, rundir.FINISHED, "checkpoints/checkpoint-4/model.safetensors"):
        (run_dir / name).write_text(name)
    before = tree_hashes(run_dir)
    set_aside_previous(run_dir, resume="never")
    after = tree_hashes(run_dir / rundir.PREVIOUS)
    assert after == before  # every file kept, by rename (no space needed on a full disk)
    assert not (run_dir / rundir.SUMMARY).exists() and not (run_dir / rundir.FINISHED).exists()
