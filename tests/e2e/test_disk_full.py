"""A full disk, on a small tmpfs (needs root to mount; skipped with the reason otherwise): a launch whose
outputs cannot fit is refused before anything is written; a disk that fills mid-run stops before the next
checkpoint with a clear error and keeps the last complete one; a final save that does not fit goes to the
rescue directory; a rerun on a full disk removes nothing."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from finetune import rundir
from finetune.checkpoints.marker import verify
from finetune.cli import main
from finetune.errors import EXIT_TRAINING_FAILED
from finetune.prelaunch import check_safetensors
from tests.helpers.processes import checkpoints, cli_argv, env, losses, run, start, wait_for
from tests.helpers.recipes import write_recipe
from tests.helpers.run_dirs import tree_hashes
from tests.helpers.trained_run import TWO_STEPS_NO_CHECKPOINT

pytestmark = pytest.mark.slow
SIZE_MIB = 40


@pytest.fixture
def disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={SIZE_MIB}m", "tmpfs", str(mount)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30, check=False)


def fill(mount, *, leave: int = 0) -> None:
    """Take the filesystem's free space, leaving `leave` bytes."""
    free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
    try:  # the write, or the flush when the file closes, meets the full disk: that is the point
        with open(mount / f"filler-{len(list(mount.glob('filler-*')))}", "wb") as fh:
            fh.write(b"\0" * max(0, free - leave))
    except OSError:
        pass


def test_a_launch_that_cannot_fit_is_refused_before_anything_is_written(disk, tmp_path, capsys):
    recipe = write_recipe(tmp_path / "recipe.yaml")
    fill(disk, leave=1 << 20)
    assert main(["run", str(recipe), "--output", str(disk / "run")]) == 2
    err = capsys.readouterr().err
    assert "not enough free disk" in err and "fix:" in err, err
    assert not (disk / "run").exists()


def test_a_disk_filling_mid_run_stops_before_the_next_checkpoint_and_keeps_the_last(disk, tmp_path):
    recipe = write_recipe(
        tmp_path / "recipe.yaml", train={"epochs": None, "max_steps": 400}, output={"save_every": 2, "keep": 1}
    )
    run_dir = disk / "run"
    proc = start(cli_argv(recipe, run_dir), cache=tmp_path / "cache")
    assert wait_for(lambda: checkpoints(run_dir).get("checkpoint-2") is True, proc=proc)
    fill(disk)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_TRAINING_FAILED, out[-4000:]
    assert "disk full" in out and "internal error" not in out and "Traceback" not in out, out[-4000:]
    assert "fix:" in out
    newest = max((n for n, ok in checkpoints(run_dir).items() if ok), key=lambda n: int(n.split("-")[1]))
    assert verify(run_dir / "checkpoints" / newest)[0] is not None


def test_a_final_save_that_does_not_fit_goes_to_the_rescue_directory(disk, tmp_path):
    # steps enough (~2 s on 2 cores) that the disk is full before the final save even when this process waits
    # for a core while the run trains (12 steps took 0.6 s and once finished before the filler ran)
    recipe = write_recipe(
        tmp_path / "recipe.yaml", train={"epochs": None, "max_steps": 48}, output={"save_every": None}
    )
    run_dir, rescue = disk / "run", tmp_path / "rescue"
    proc = subprocess.Popen(
        cli_argv(recipe, run_dir),
        env={**env(tmp_path / "cache"), rundir.RESCUE_ENV: str(rescue)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert wait_for(lambda: (run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= 1, proc=proc)
    fill(disk, leave=512 << 10)  # room for metrics rows, not for the final save's margin
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 4, out[-4000:]
    saved = list(rescue.glob("finetune-rescue-*/adapter_model.safetensors"))
    assert saved and "was saved to" in out and str(saved[0].parent) in out, out[-4000:]
    check_safetensors(saved[0])  # a complete file
    assert "Traceback" not in out


def test_a_rerun_on_a_full_disk_removes_nothing(disk, tmp_path, two_step_run):
    recipe = write_recipe(tmp_path / "recipe.yaml", **TWO_STEPS_NO_CHECKPOINT)
    run_dir, cache = disk / "run", tmp_path / "cache"
    shutil.copytree(two_step_run, run_dir)  # a finished run of this recipe on the disk (built once per session)
    fill(disk, leave=1 << 20)
    before = tree_hashes(run_dir)
    again = run(cli_argv(recipe, run_dir, "--resume", "never"), cache=cache)
    assert again.returncode == 2 and "not enough free disk" in again.stderr, again.stderr[-2000:]
    assert tree_hashes(run_dir) == before
    same = run(cli_argv(recipe, run_dir), cache=cache)
    assert same.returncode == 0 and "is complete" in same.stdout and tree_hashes(run_dir) == before
