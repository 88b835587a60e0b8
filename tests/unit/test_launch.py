"""finetune/launch.py's choices that depend on the machine it runs on."""

from __future__ import annotations

import os

import pytest

from finetune.compile.spec import LaunchSpec
from finetune.launch import cpu_threads_per_process, host_threads, with_host_threads
from finetune.plan.offload_time import host_threads_per_rank
from finetune.registry import get_preset
from finetune.registry.detect import usable_cores


def test_cpu_ranks_take_the_callers_thread_count_or_split_the_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads_per_process(2) == 3
    for unset in ("", "0", "many"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert cpu_threads_per_process(2) == max(1, usable_cores() // 2)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert cpu_threads_per_process(10_000) == 1


def _spec(strategy: str, *, device: str = "cuda", procs: int = 4) -> LaunchSpec:
    return LaunchSpec(
        run_dir="run",
        strategy=strategy,
        device=device,
        num_nodes=1,
        procs_per_node=procs,
        world_size=procs,
        main_port=0,
        module="finetune.train",
        module_args=[],
        config_file="run/accelerate.yaml",
    )


@pytest.mark.parametrize("strategy", ["zero3-offload", "zero3-optim-offload", "fsdp2-offload", "zero3-nvme"])
def test_ranks_that_step_the_optimizer_on_the_host_get_the_cores_split_between_them(monkeypatch, strategy):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert host_threads(_spec(strategy)) == max(1, usable_cores() // 4)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert host_threads(_spec(strategy)) == 5


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "zero3", "zero2"])
def test_gpu_ranks_of_the_other_tiers_keep_accelerates_one_thread(strategy):
    assert host_threads(_spec(strategy)) is None
    assert host_threads(_spec(strategy, device="cpu", procs=1)) == cpu_threads_per_process(1)


def test_the_planner_assumes_the_split_the_launcher_makes():
    server = get_preset("server-8xh100")
    assert host_threads_per_rank(server, "zero3-offload") == server.host_cpu_cores // 8
    assert host_threads_per_rank(server, "fsdp2") == 1


@pytest.mark.parametrize("strategy", ["zero3-optim-offload", "fsdp2-offload"])
def test_the_host_threads_reach_deepspeeds_ranks_too(monkeypatch, strategy):
    """accelerate's DeepSpeed launch copies the environment but ignores --num_cpu_threads_per_process (a
    zero3-optim-offload row ran on one thread per rank): the launch sets OMP_NUM_THREADS itself."""
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    argv = ["python", "-m", "accelerate.commands.launch", "--config_file", "run/accelerate.yaml", "-m", "x"]
    out, env = with_host_threads(_spec(strategy), argv, {"PATH": "/bin"})
    assert out[out.index("--num_cpu_threads_per_process") + 1] == "6" and env["OMP_NUM_THREADS"] == "6"
    assert out[out.index("--config_file") + 1] == "run/accelerate.yaml" and env["PATH"] == "/bin"
    assert with_host_threads(_spec("fsdp2"), argv, {"PATH": "/bin"}) == (argv, {"PATH": "/bin"})


def test_a_signal_the_kernel_gives_another_thread_still_stops_the_launch_at_once(tmp_path):
    """Python runs signal handlers in the main thread only; when the kernel delivers SIGTERM to another
    thread of `finetune` (here: sent to one on purpose), the launch must still forward it to the ranks
    then, not once the launcher has exited by itself."""
    import signal
    import sys
    import threading
    import time

    from finetune.errors import EXIT_PREEMPTED
    from finetune.launch import _run

    idle = threading.Event()
    bystander = threading.Thread(target=idle.wait, daemon=True)
    bystander.start()
    timer = threading.Timer(1.0, signal.pthread_kill, args=(bystander.ident, signal.SIGTERM))
    timer.start()
    started = time.monotonic()
    try:
        code = _run(
            [sys.executable, "-c", "import time; time.sleep(60)"],
            env=dict(os.environ),
            log_path=tmp_path / "launch.log",
            stream=False,
        )
    finally:
        timer.cancel()
        idle.set()
    assert code == EXIT_PREEMPTED
    assert time.monotonic() - started < 30, "the signal was forwarded only after the launcher exited by itself"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux) to stand for a full disk")
def test_a_full_disk_under_the_launch_log_loses_no_line_and_no_exit_code(capfd):
    """The launcher copies the ranks' output to RUN_DIR/logs and to the console. When the log's disk is full
    (/dev/full fails every write with ENOSPC) the console still gets every line and the ranks' exit code comes
    back: nothing is left buffered for the log's close to fail on (which ended a disk-full run as an
    'internal error' instead of the rank's own message and code)."""
    import sys
    from pathlib import Path

    from finetune.launch import _run

    code = "import sys; print('x' * 100000); print('last line'); sys.exit(4)"
    rc = _run([sys.executable, "-c", code], env=dict(os.environ), log_path=Path("/dev/full"), stream=True)
    assert rc == 4
    assert "last line" in capfd.readouterr().out
