"""SIGTERM / SIGUSR1 to the launcher of a 2-process gloo run: every rank saves one checkpoint at the
next step boundary, the command exits 75, and running it again resumes from that checkpoint (both signals
in one chain of runs: one launch fewer than a run per signal). Then Ctrl-C, SIGHUP and a killed launcher."""

from __future__ import annotations

import re
import signal

import pytest

from finetune.errors import EXIT_PREEMPTED
from finetune.rundir import read_rank_error
from tests.helpers.processes import checkpoints, cli_argv, losses, run, start, wait_for
from tests.helpers.recipes import cpu_preset, write_recipe

pytestmark = pytest.mark.slow
STEPS = 60


def _preempt(proc, sig, run_dir, *, after_step):
    """Wait until the run logged `after_step`, send `sig` to the launcher, check the checkpointed exit and
    return (output, the step of the one checkpoint the signal added)."""
    before = set(checkpoints(run_dir))
    assert wait_for(
        lambda: (run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= after_step, proc=proc
    ), proc.communicate()[0][-3000:]
    proc.send_signal(sig)  # the CLI process is the launcher: it forwards the signal to every rank
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_PREEMPTED, out[-4000:]
    assert "preempted: a checkpoint was saved" in out
    saved = checkpoints(run_dir)
    added = set(saved) - before
    assert len(added) == 1 and all(saved.values()), saved
    step = int(next(iter(added)).split("-")[1])
    assert after_step <= step < STEPS
    assert not (run_dir / "summary.json").exists()
    # both ranks stopped through our path (exit 75), neither was killed by the launcher
    assert out.count(f"stopped by {sig.name}") + out.count("stopped by a preemption signal") == 2, out[-4000:]
    return out, step


def test_sigterm_then_sigusr1_save_on_every_rank_exit_75_and_resume(tmp_path):
    """SIGTERM stops a fresh run, SIGUSR1 stops the run that resumed from it; each time every rank saves one
    checkpoint and exits 75, and the next run resumes from exactly that checkpoint and finishes the rest."""
    preset = cpu_preset(tmp_path / "cpu2.yaml", procs=2)
    # 2 ranks x micro-batch 4 = the global batch of 8; no periodic saves: the only checkpoints are the signals'
    recipe = write_recipe(
        tmp_path / "recipe.yaml",
        hardware=str(preset),
        train={"epochs": None, "max_steps": STEPS, "micro_batch_size": 4},
        output={"save_every": None, "keep": 2},
    )
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    _, first = _preempt(start(cli_argv(recipe, run_dir), cache=cache), signal.SIGTERM, run_dir, after_step=3)
    out, second = _preempt(start(cli_argv(recipe, run_dir), cache=cache), signal.SIGUSR1, run_dir, after_step=first + 3)
    assert re.search(rf"resuming from \S*checkpoint-{first}\b", out), out[-3000:]

    again = run(cli_argv(recipe, run_dir), cache=cache)
    text = again.stdout + again.stderr
    assert again.returncode == 0, text[-4000:]
    assert re.search(rf"resuming from \S*checkpoint-{second}\b", text), text[-3000:]
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))


def test_preemption_callback_restores_the_handlers_it_replaced():
    from finetune.train.signals import PREEMPT_SIGNALS, PreemptionCallback

    def host_handler(signum, frame):  # a program that embeds run_rank has its own handler
        pass

    before = {sig: signal.signal(sig, host_handler) for sig in PREEMPT_SIGNALS}
    try:
        callback = PreemptionCallback()
        assert all(signal.getsignal(sig) == callback._handle for sig in PREEMPT_SIGNALS)
        callback.restore()
        assert all(signal.getsignal(sig) is host_handler for sig in PREEMPT_SIGNALS)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_stop_whose_exception_was_swallowed_before_training_still_stops_the_run():
    """The rank's first handler raises StoppedBeforeTraining; raised inside a finalizer (a __del__, a weakref
    callback) Python only reports it. The trainer's handler, installed next, takes the request over."""
    import gc

    from finetune.train.__main__ import _EarlyStop
    from finetune.train.signals import PREEMPT_SIGNALS, PreemptionCallback

    handle = _EarlyStop()
    before = {sig: signal.signal(sig, handle) for sig in PREEMPT_SIGNALS}

    class Finalized:
        def __del__(self):  # the signal's handler runs here: its exception goes nowhere
            handle(signal.SIGTERM, None)

    try:
        fresh = PreemptionCallback()  # nothing requested yet
        fresh.restore()
        assert fresh.received is None
        Finalized()
        gc.collect()
        assert handle.stopped == ["SIGTERM"]
        callback = PreemptionCallback()
        callback.restore()
        assert callback.received == signal.SIGTERM and callback.signal_name == "SIGTERM"
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_a_signal_after_training_began_is_not_a_stop_before_training():
    """The trainer's handlers are put back to the rank's early one as the rank ends. A signal then (torchrun's SIGTERM
    to the surviving rank of a dead one, while it unwinds its own training error) must not replace that error with
    "stopped before training started" and exit 75: once training began, the early handler leaves the outcome alone."""
    from finetune.train.__main__ import _EarlyStop
    from finetune.train.signals import PREEMPT_SIGNALS, PreemptionCallback

    handle = _EarlyStop()
    before = {sig: signal.signal(sig, handle) for sig in PREEMPT_SIGNALS}
    try:
        callback = PreemptionCallback()
        callback.on_train_begin(None, None, None)
        callback.restore()
        assert signal.getsignal(signal.SIGTERM) is handle
        handle(signal.SIGTERM, None)  # raises StoppedBeforeTraining before training began
        assert handle.stopped == [] and callback.received is None
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


# --- Ctrl-C, SIGHUP, a killed launcher (one process: the CLI, accelerate's launcher, one rank) ---


def _long_run(tmp_path):
    recipe = write_recipe(
        tmp_path / "recipe.yaml", train={"epochs": None, "max_steps": 400}, output={"save_every": None}
    )
    run_dir = tmp_path / "run"
    proc = start(cli_argv(recipe, run_dir), cache=tmp_path / "cache")
    assert wait_for(lambda: (run_dir / "metrics.jsonl").exists() and max(losses(run_dir), default=0) >= 2, proc=proc), (
        proc.communicate()[0][-3000:]
    )
    return proc, run_dir


def _no_rank_left(run_dir, timeout=60):
    import time

    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [
            p
            for p in psutil.process_iter(["cmdline"])
            if str(run_dir) in " ".join(p.info["cmdline"] or [])
            and "finetune.train" in " ".join(p.info["cmdline"] or [])
        ]
        if not left:
            return True
        time.sleep(0.5)
    return False


def test_ctrl_c_once_saves_a_checkpoint_and_exits_130(tmp_path):
    proc, run_dir = _long_run(tmp_path)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 130, out[-4000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    saved = checkpoints(run_dir)
    assert len(saved) == 1 and all(saved.values()), saved
    assert f"interrupted: a checkpoint was saved ({next(iter(saved))})" in out and "resume" in out


def test_ctrl_c_twice_stops_at_once(tmp_path):
    proc, run_dir = _long_run(tmp_path)
    import time

    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)  # two key presses (signals sent together are delivered to the handler once)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-4000:]
    assert "second Ctrl-C" in out and "Traceback" not in out, out[-4000:]
    assert "a checkpoint was saved" not in out or all(checkpoints(run_dir).values())
    assert _no_rank_left(run_dir, timeout=10)


def test_sighup_to_the_cli_process_group_saves_and_leaves_no_orphan(tmp_path):
    """A closed terminal sends SIGHUP to the CLI's process group (the ranks live in sessions of their own)."""
    import os

    proc, run_dir = _long_run(tmp_path)
    os.killpg(proc.pid, signal.SIGHUP)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_PREEMPTED, out[-4000:]
    assert "stopped by SIGHUP" in out and "preempted: a checkpoint was saved" in out, out[-4000:]
    assert all(checkpoints(run_dir).values()) and checkpoints(run_dir)
    assert _no_rank_left(run_dir)


def test_kill9_of_the_cli_alone_stops_its_ranks_with_a_checkpoint(tmp_path):
    """SIGKILL to the CLI only: the pipe the rank prints to closes at once, while the rank learns of the
    death only when the SIGTERMs of the parent-death chain (CLI -> accelerate -> rank) arrive. _long_run
    returns as a step's metrics row appears, just before the rank prints that step's line, so the kill
    often lands in between: the line must go to the rank's log instead of failing the rank."""
    proc, run_dir = _long_run(tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    assert _no_rank_left(run_dir, timeout=120), "a rank kept training after its launcher was killed"
    saved = checkpoints(run_dir)
    assert len(saved) == 1 and all(saved.values()), (saved, _rank_log(run_dir))
    step = int(next(iter(saved)).split("-")[1])
    assert step >= 2
    err = read_rank_error(run_dir)
    assert err.get("exit_code") == EXIT_PREEMPTED, (err, _rank_log(run_dir))
    assert f"stopped by SIGTERM at step {step}; checkpoint-{step} is saved" in err["message"], err
    assert f"checkpoint checkpoint-{step} complete" in _rank_log(run_dir)


def test_a_print_after_the_console_closed_goes_to_the_rank_log(tmp_path):
    """The window a kill -9 of the CLI opens, made certain: the pipe's reader is gone and no signal has
    come yet. The rank's next print lands in its log instead of raising BrokenPipeError."""
    import os
    import subprocess
    import sys

    from tests.helpers.paths import ROOT
    from tests.helpers.processes import env

    log = tmp_path / "rank-0.log"
    code = (
        "import sys\nfrom finetune.train.signals import PreemptionCallback\n"
        f"callback = PreemptionCallback(log_path={str(log)!r})\n"
        "print('ready', flush=True)\nsys.stdin.read()\n"  # until the reader below has gone
        "print('step 2 line', flush=True)\ncallback.restore()\nprint('after restore', file=sys.stderr)\n"
    )
    read, write = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=write, stderr=write, cwd=ROOT, env=env()
    )
    os.close(write)
    with os.fdopen(read, "rb") as console:  # what the imports print, until the callback is in place
        assert any(line == b"ready\n" for line in console)
    child.stdin.close()  # the console's read end is closed now: let the child print
    assert child.wait(timeout=60) == 0
    text = log.read_text()
    assert "step 2 line" in text and "after restore" in text, text


def test_kill9_of_the_cli_before_training_records_that_nothing_was_trained(tmp_path):
    """Before the trainer's handlers exist (the rank is still importing), the rank's SIGTERM from the
    parent-death chain cannot lead to a checkpoint: no step was trained. The rank says so in the run
    directory (the console is gone) and exits; no rank is left behind."""
    recipe = write_recipe(
        tmp_path / "recipe.yaml", train={"epochs": None, "max_steps": 400}, output={"save_every": None}
    )
    run_dir = tmp_path / "run"
    proc = start(cli_argv(recipe, run_dir), cache=tmp_path / "cache")
    # the rank catches SIGTERM (its entry point's first act) but has not reached training: seconds of imports
    assert wait_for(lambda: _rank_catching_sigterm(run_dir), proc=proc), proc.communicate()[0][-3000:]
    proc.kill()
    proc.communicate(timeout=30)
    assert _no_rank_left(run_dir, timeout=60), "a rank kept going after its launcher was killed"
    assert not checkpoints(run_dir) and not (run_dir / "metrics.jsonl").exists()
    err = read_rank_error(run_dir)
    assert err.get("exit_code") == EXIT_PREEMPTED, err
    assert err["message"].startswith(
        "stopped by SIGTERM before training started: no step was trained, so there was nothing to checkpoint"
    ), err
    assert "it starts from step 0" in err["message"], err


def _rank_catching_sigterm(run_dir) -> bool:
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd[1:3] != ["-m", "finetune.train"] or str(run_dir) not in " ".join(cmd):  # the rank, not accelerate
            continue
        try:
            status = open(f"/proc/{p.pid}/status").read()
        except OSError:
            continue
        caught = int(next(ln for ln in status.splitlines() if ln.startswith("SigCgt:")).split()[1], 16)
        return bool(caught & (1 << (signal.SIGTERM - 1)))
    return False


def _rank_log(run_dir):
    """What the rank printed after the console was gone."""
    path = run_dir / "logs" / "rank-0.log"
    return path.read_text() if path.is_file() else ""


def test_sigterm_before_training_claims_no_checkpoint(tmp_path):
    recipe = write_recipe(
        tmp_path / "recipe.yaml", train={"epochs": None, "max_steps": 400}, output={"save_every": None}
    )
    run_dir = tmp_path / "run"
    proc = start(cli_argv(recipe, run_dir), cache=tmp_path / "cache")
    assert wait_for(lambda: (run_dir / "launch.sh").is_file(), proc=proc)  # compiled, not yet training
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_PREEMPTED, out[-4000:]
    saved = checkpoints(run_dir)
    if not saved:
        assert "a checkpoint was saved" not in out, out[-3000:]
        assert "before a new checkpoint was written" in out or "no training process was running" in out, out[-3000:]
    assert "Traceback" not in out, out[-4000:]


def test_a_signal_after_training_finished_reports_the_run_complete(tmp_path, monkeypatch, caplog):
    """The window a CPU run of the preemption script hit: SIGTERM arrived after the run wrote its model and
    finished.json, the ranks exited 75 and the command said "preempted before a new checkpoint was written
    ... it starts from step 0". The launch here really trains to the end; only the late signal's exit code
    is given to finetune.api, which must report the run complete (exit 0) and a rerun find nothing to do."""
    import logging

    from finetune import api, launch
    from finetune.errors import EXIT_PREEMPTED
    from finetune.rundir import read_finished

    real = launch.run_with_oom_retries

    def signalled_after_the_end(*args, **kwargs):
        code, spec = real(*args, **kwargs)
        assert code == 0
        return EXIT_PREEMPTED, spec

    monkeypatch.setattr(launch, "run_with_oom_retries", signalled_after_the_end)
    recipe = write_recipe(tmp_path / "recipe.yaml", hardware=str(cpu_preset(tmp_path / "cpu.yaml")))
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="finetune.api"):
        result = api.run(recipe, output=run_dir)
    assert result.exit_code == 0 and read_finished(run_dir)
    assert "stopped by a signal after training finished" in caplog.text and "preempted" not in caplog.text
    monkeypatch.setattr(launch, "run_with_oom_retries", real)
    again = run(cli_argv(recipe, run_dir), cache=tmp_path / "cache")
    assert again.returncode == 0 and "is complete" in again.stdout + again.stderr
