"""The launcher: the only module in finetune that starts processes.

`launch(RUN_DIR)` runs this node's `accelerate launch ... -m finetune.train RUN_DIR/recipe.resolved.yaml`
in its own process group, streams its output (and appends it to RUN_DIR/logs/), and forwards
SIGINT/SIGTERM/SIGUSR1 so the ranks can write a checkpoint before they stop. torchrun (inside
accelerate) starts each rank in a session of its own, so the signal goes to accelerate's
process group and its elastic agent passes it on (the compiled env adds SIGUSR1 to the
signals it forwards, via PET_SIGNALS_TO_HANDLE, and raises its shutdown grace).

    python -m finetune.launch RUN_DIR [--node-rank K --main-address HOST [--main-port P]] [-- ARGS]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from finetune import strategies
from finetune.compile.spec import LaunchSpec
from finetune.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, FinetuneError
from finetune.plan.offload_time import split_cores
from finetune.plan.types import GIB
from finetune.registry.detect import usable_cores
from finetune.rundir import JOB_SBATCH, launch_log

# SIGHUP (the terminal closed) is a preemption too: the ranks save and stop instead of being orphaned
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
OUTPUT_DRAIN_S = 10  # after the launcher exits, how long to keep copying the ranks' output
WAIT_SLICE_S = 0.1  # how soon a signal received by another thread is forwarded
GROUP_WAIT_S = 600  # after a signal, how long to wait for ranks still writing their checkpoint
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


@dataclass
class NodeInstructions:
    """Returned instead of an exit code for a multi-node run without a node rank."""

    text: str  # human-readable: what to run on each node, and the Slurm script
    commands: list[list[str]]  # per-node accelerate argv, main address as a placeholder
    sbatch: str | None  # path of job.sbatch

    def __str__(self) -> str:
        return self.text


def load_spec(spec_or_run_dir: LaunchSpec | str | Path) -> LaunchSpec:
    if isinstance(spec_or_run_dir, LaunchSpec):
        return spec_or_run_dir
    return LaunchSpec.load(spec_or_run_dir)


def executable_argv(argv: list[str]) -> list[str]:
    """`accelerate launch ...` run by this interpreter, so the same environment is used."""
    if argv[:2] == ["accelerate", "launch"]:
        return [sys.executable, "-m", "accelerate.commands.launch", *argv[2:]]
    return list(argv)


def launch_env(spec: LaunchSpec) -> dict[str, str]:
    env = dict(spec.env_defaults)  # preset defaults ...
    env.update(os.environ)  # ... that the caller's environment overrides ...
    env.update(spec.env)  # ... except what the launch itself depends on
    return env


def launch(
    spec_or_run_dir: LaunchSpec | str | Path,
    *,
    node_rank: int | None = None,
    main_address: str | None = None,
    main_port: int | None = None,
    extra_args: list[str] | tuple = (),
    stream: bool = True,
) -> int | NodeInstructions:
    """Run this node's part of a compiled run; return its exit code.

    Multi-node runs need `node_rank` and `main_address` (node 0's host); without a node rank
    nothing starts and the per-node commands are returned (NodeInstructions) for printing.
    Exit code: the launcher's, except EXIT_PREEMPTED (75) when SIGTERM/SIGUSR1 stopped the run
    (the ranks were told to checkpoint; requeue and resume) and 130 after SIGINT.
    """
    spec = load_spec(spec_or_run_dir)
    if spec.multi_node and node_rank is None:
        return NodeInstructions(
            text=spec.node_instructions(), commands=spec.node_argv(), sbatch=spec.files.get(JOB_SBATCH)
        )
    if spec.multi_node and not main_address:
        raise FinetuneError(
            f"a {spec.num_nodes}-node run needs node 0's address",
            hint="pass --main-address HOST (the same on every node)",
        )
    if not spec.multi_node and node_rank not in (None, 0):
        raise FinetuneError(
            f"node rank {node_rank} given for a single-node run",
            hint="drop --node-rank, or compile for a multi-node preset",
        )
    rank = node_rank or 0
    argv = executable_argv(
        spec.argv(node_rank=rank, main_address=main_address, main_port=main_port, extra_args=list(extra_args))
    )
    argv, env = with_host_threads(spec, argv, launch_env(spec))
    log_path = Path(spec.run_dir) / launch_log(rank)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return _run(argv, env=env, log_path=log_path, stream=stream)


def with_host_threads(spec: LaunchSpec, argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The launch's argv and environment with `host_threads` given to the ranks. accelerate turns
    --num_cpu_threads_per_process into OMP_NUM_THREADS for its CPU and multi-GPU launches but not for
    DeepSpeed's (torchrun then sets 1), so the variable is set for every launch as well."""
    threads = host_threads(spec)
    if threads is None:
        return argv, env
    at = argv.index("--config_file")
    return [*argv[:at], "--num_cpu_threads_per_process", str(threads), *argv[at:]], {
        **env,
        "OMP_NUM_THREADS": str(threads),
    }


def host_threads(spec: LaunchSpec) -> int | None:
    """--num_cpu_threads_per_process for this launch, or None for accelerate's default (one per GPU rank).

    CPU ranks compute on the host; the ranks of an offload tier step the optimizer there (DeepSpeed's
    CPUAdam and torch's CPU kernels run on OMP_NUM_THREADS threads, one by accelerate's default, which
    made a host step several times slower than the cores allow). Decided here, not at compile time,
    because it depends on the machine that runs it; the planner assumes the same split of its preset's
    cores (finetune.plan.offload_time.host_threads_per_rank)."""
    if spec.device == "cpu" or strategies.info(spec.strategy).offload_optimizer:
        return cpu_threads_per_process(spec.procs_per_node)
    return None


def cpu_threads_per_process(procs: int) -> int:
    """Intra-op threads of each rank that computes on the host: the caller's OMP_NUM_THREADS when set (a
    user sharing the machine, or a test suite, has chosen), else the cores split between the ranks."""
    chosen = os.environ.get("OMP_NUM_THREADS", "")
    if chosen.isdigit() and int(chosen) > 0:
        return int(chosen)
    return split_cores(usable_cores(), procs)


def prctl_or_none():
    """libc's prctl, or None off Linux."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(prctl=None, *, parent: int | None = None) -> bool:
    """SIGTERM to this process when its parent dies (a rank whose launcher was killed checkpoints and
    stops instead of training on as an orphan). False when `parent`, the pid read before this call, is
    already gone: it died before the request took effect, and the kernel sends no signal for that.

    The kernel sends the signal when the parent *thread* that started us exits, so a multi-threaded
    launcher whose threads die one by one may send it more than once; the handlers treat a repeat
    SIGTERM as the same request."""
    prctl = prctl or prctl_or_none()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    return parent is None or os.getppid() == parent


def _children_die_with_us(prctl):
    """Run in the child before exec: SIGTERM when the `finetune` process dies (even of SIGKILL), so the
    ranks checkpoint and stop instead of training on as orphans. If it died between the fork and the
    request, the child exits instead of starting ranks nobody waits for."""
    parent = os.getpid()

    def child() -> None:
        if not die_with_parent(prctl, parent=parent):
            os._exit(EXIT_PREEMPTED)

    return child


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _kill_now(proc: subprocess.Popen) -> None:
    """A second Ctrl-C: SIGKILL the launcher, every rank (in sessions of their own) and their workers."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _wait_group(pgid: int, timeout: float) -> None:
    """Wait until no process of the launcher's group is left: with one process, accelerate's launcher
    dies of the signal while its rank is still writing the checkpoint (orphans are reparented to us,
    the subreaper, and reaped here)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)


def _wait(proc: subprocess.Popen) -> int:
    """proc.wait() in slices. Python runs a signal's handler in the main thread, at its next bytecode; the
    kernel may hand the signal to another thread (the output reader), and then a main thread blocked in
    one long waitpid would forward a SIGTERM only after the launcher exited: the training it was meant
    to stop would run to its end."""
    while True:
        try:
            return proc.wait(timeout=WAIT_SLICE_S)
        except subprocess.TimeoutExpired:
            continue


def _run(argv: list[str], *, env: dict[str, str], log_path: Path, stream: bool) -> int:
    received: list[int] = []
    prctl = prctl_or_none()
    if prctl is not None:
        prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    # unbuffered: a write to a full disk fails at once and leaves nothing behind for close() to fail on
    with open(log_path, "ab", buffering=0) as log:
        try:
            log.write(f"$ {' '.join(argv)}\n".encode())
        except OSError:  # a full disk: _copy_output finds it too, and the console gets every line
            pass
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            # one prctl call in the child; the lock's heartbeat thread holds no lock
            preexec_fn=_children_die_with_us(prctl),
        )  # noqa: PLW1509

        def forward(signum, _frame):
            if signum == signal.SIGINT and signal.SIGINT in received:
                print("\nsecond Ctrl-C: stopping every rank now, without a checkpoint", file=sys.stderr, flush=True)
                received.append(signum)
                _kill_now(proc)
                return
            received.append(signum)
            try:
                os.killpg(proc.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in FORWARDED_SIGNALS:
                previous[sig] = signal.signal(sig, forward)
        # a reader thread copies output while the main thread waits, so a signal handler
        # runs promptly, and a rank orphaned by a crashed launcher cannot keep us reading forever
        reader = threading.Thread(target=_copy_output, args=(proc.stdout, log, stream), daemon=True)
        reader.start()
        try:
            rc = _wait(proc)
            if received and received.count(signal.SIGINT) < 2:
                _wait_group(proc.pid, GROUP_WAIT_S)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if proc.poll() is None:  # unwinding on an exception: do not orphan the ranks
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
            reader.join(timeout=OUTPUT_DRAIN_S)
    if rc < 0:
        rc = 128 - rc
    if rc != 0 and signal.SIGINT in received:
        return EXIT_INTERRUPTED
    if rc != 0 and any(s in PREEMPT_SIGNALS for s in received):
        return EXIT_PREEMPTED
    return rc


# Tracebacks raised by the launch stack itself (accelerate's launcher re-raising a rank's exit
# code, torchrun's agent) repeat what the rank already said; they stay in the log file only.
LAUNCHER_FRAMES = ("accelerate/commands/launch.py", "torch/distributed/run.py", "torch/distributed/elastic/")


class _ConsoleFilter:
    """Hold back each traceback until it is complete; drop it from the console if it is the launcher's."""

    def __init__(self, write):
        self.write = write
        self.held: list[bytes] | None = None

    def feed(self, line: bytes) -> None:
        if self.held is None:
            if line.startswith(b"Traceback (most recent call last):"):
                self.held = [line]
            else:
                self.write(line)
            return
        self.held.append(line)
        if line[:1] not in (b" ", b"\t"):  # the exception line ends the traceback
            block, self.held = self.held, None
            text = b"".join(block).decode(errors="replace")
            if any(frame in text for frame in LAUNCHER_FRAMES):
                self.write(b"(the launcher's own traceback is hidden: the rank's message above says what failed)\n")
            else:
                for held in block:
                    self.write(held)

    def flush(self) -> None:
        for held in self.held or []:
            self.write(held)
        self.held = None


def _copy_output(pipe, log, stream: bool) -> None:
    out = getattr(sys.stdout, "buffer", None)

    def write(line: bytes) -> None:
        if out is not None:
            out.write(line)
            out.flush()
        else:
            sys.stdout.write(line.decode(errors="replace"))

    console = _ConsoleFilter(write)
    logging = True
    try:
        for line in iter(pipe.readline, b""):
            if logging:
                try:
                    log.write(line)
                except OSError:  # a full disk: the console still gets every line
                    logging = False
            if stream:
                console.feed(line)
        console.flush()
    except (ValueError, OSError):  # the log was closed after the drain timeout
        return


def with_setting(recipe, **sections):
    """`recipe` with some sections' keys replaced (validated again), keeping where it came from."""
    from finetune.recipe import load_recipe
    from finetune.recipe.load import deep_merge

    fresh = load_recipe(deep_merge(recipe.model_dump(mode="json", exclude_none=True), sections))
    fresh._source_dir, fresh._source_name = recipe._source_dir, recipe._source_name
    return fresh


def _setting(micro_batch: int, checkpointing: bool, sync_each_batch: bool = False) -> str:
    return f"micro-batch {micro_batch}, activation checkpointing {'on' if checkpointing else 'off'}" + (
        ", sync_each_batch" if sync_each_batch else ""
    )


def replan_after_oom(
    recipe, spec: LaunchSpec, *, hardware: str | None, records: list[dict], tried: tuple[tuple[int, bool, bool], ...]
):
    """The re-plan for a run whose ranks ran out of memory (finetune.plan.replan on the recipe's job)."""
    from finetune.plan import job_from_recipe
    from finetune.plan.replan import OomEvidence, replan
    from finetune.recipe.load import recipe_dir
    from finetune.registry import get_preset, resolve_model

    base = recipe_dir(recipe)
    job = job_from_recipe(
        recipe,
        arch=resolve_model(recipe.model, base_dir=base),
        preset=get_preset(hardware or recipe.hardware, base_dir=base),
    )
    return replan(job, strategy=spec.strategy, evidence=[OomEvidence.from_record(r) for r in records], tried=tried)


def run_with_oom_retries(
    recipe,
    spec: LaunchSpec,
    *,
    hardware: str | None,
    resume: str = "auto",
    node_rank: int | None = None,
    main_address: str | None = None,
    main_port: int | None = None,
) -> tuple[int | NodeInstructions, LaunchSpec]:
    """launch(spec), and when ranks ran out of memory (their records in RUN_DIR/logs/oom-rank-K.json):
    re-plan with the measured peaks (finetune.plan.replan: same strategy and global batch, a smaller
    micro-batch or activation checkpointing), say what changed, recompile the run dir and resume from
    its last complete checkpoint (or start over if none), at most `recipe.train.oom_retries` times.
    Returns (exit code or node instructions, the spec that ran last); TrainingFailed when memory still
    runs out, naming every setting tried and what to set in the recipe."""
    from finetune.compile import compile_recipe
    from finetune.errors import TrainingFailed
    from finetune.plan.replan import OomEvidence
    from finetune.rundir import OOM_RETRIES, clear_oom_records, read_oom_records

    run_dir = Path(spec.run_dir)
    history: list[dict] = []
    while True:
        clear_oom_records(run_dir)
        code = launch(
            spec, node_rank=node_rank, main_address=main_address, main_port=main_port, extra_args=["--resume", resume]
        )
        records = read_oom_records(run_dir)
        if not isinstance(code, int) or code in (0, EXIT_PREEMPTED, EXIT_INTERRUPTED) or not records:
            return code, spec
        tried = tuple((h["micro_batch_size"], h["activation_checkpointing"], h["sync_each_batch"]) for h in history)
        decision = replan_after_oom(recipe, spec, hardware=hardware, records=records, tried=tried)
        failed = records[0]  # every rank ran the same setting
        failed_sync = OomEvidence.from_record(failed).sync_each_batch
        history.append(
            {
                "attempt": len(history) + 1,
                "micro_batch_size": failed["micro_batch_size"],
                "activation_checkpointing": failed["activation_checkpointing"],
                "sync_each_batch": failed_sync,
                "gradient_accumulation_steps": failed["gradient_accumulation_steps"],
                "records": records,
                "decision": decision.text,
                "next": None
                if decision.micro_batch is None
                else {
                    "micro_batch_size": decision.micro_batch,
                    "activation_checkpointing": decision.checkpointing,
                    "sync_each_batch": bool(decision.sync_each_batch),
                },
            }
        )
        (run_dir / OOM_RETRIES).write_text(json.dumps(history, indent=2) + "\n")
        retries = recipe.train.oom_retries
        if decision.micro_batch is None or len(history) > retries or spec.multi_node:
            raise TrainingFailed(
                _oom_failure(history, decision, retries=retries, multi_node=spec.multi_node),
                file=str(run_dir / OOM_RETRIES),
                hint=_oom_hint(decision),
            )
        print(f"out of memory: {decision.text}", flush=True)
        print(
            f"out of memory: retry {len(history)} of {retries}: "
            f"{_setting(decision.micro_batch, decision.checkpointing, bool(decision.sync_each_batch))} x "
            f"accumulation {decision.gradient_accumulation_steps} (was "
            f"{_setting(failed['micro_batch_size'], failed['activation_checkpointing'], failed_sync)} x accumulation "
            f"{failed['gradient_accumulation_steps']}); resuming from the last complete checkpoint, if any",
            flush=True,
        )
        checkpointing = "on" if decision.checkpointing else "off"
        recipe = with_setting(
            recipe,
            # false where it is no setting (sync_options' None): a pinned true would contradict such a strategy
            distributed={"strategy": spec.strategy, "sync_each_batch": bool(decision.sync_each_batch)},
            train={"micro_batch_size": decision.micro_batch, "activation_checkpointing": checkpointing},
        )
        spec = compile_recipe(recipe, run_dir=run_dir, hardware=hardware)
        resume = "auto"  # what the failed attempt committed, whatever the first attempt was told


def _oom_failure(history: list[dict], decision, *, retries: int, multi_node: bool) -> str:
    tried = "; ".join(
        f"{h['attempt']}) {_setting(h['micro_batch_size'], h['activation_checkpointing'], h['sync_each_batch'])} x "
        f"accumulation {h['gradient_accumulation_steps']}: rank(s) "
        f"{', '.join(str(r['rank']) for r in h['records'])} ran out at "
        f"{max(r['peak_bytes'] for r in h['records']) / GIB:.2f} GiB"
        for h in history
    )
    if multi_node:
        why = "a multi-node run is not re-planned automatically (every node would have to agree)"
    elif decision.micro_batch is None:
        why = "no other setting is expected to fit"
    else:
        why = f"train.oom_retries ({retries}) retries are used up"
    return f"out of memory after {len(history)} attempt(s) ({why}); tried: {tried}. {decision.text}"


def _oom_hint(decision) -> str:
    from finetune.plan.choose import HEADROOM

    if decision.micro_batch is None and decision.other_strategy:
        return (
            f"set distributed.strategy: {decision.other_strategy} in the recipe (what the planner chooses "
            f"within {HEADROOM:.0%} of GPU memory), or see `finetune plan` for other changes"
        )
    if decision.micro_batch is None:
        return (
            "the model states alone leave no room for activations: `finetune plan` lists what fits "
            "(a sharded or offloading distributed.strategy, adapter.type: qlora, more GPUs, a shorter "
            "data.max_length)"
        )
    return (
        f"set train.micro_batch_size: {decision.micro_batch}"
        + (", distributed.sync_each_batch: true" if decision.sync_each_batch else "")
        + f" and train.activation_checkpointing: {'on' if decision.checkpointing else 'off'} in the recipe "
        "(what the measured peaks point to), or raise train.oom_retries"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m finetune.launch", description="Launch this node's part of a compiled run."
    )
    parser.add_argument("run_dir")
    parser.add_argument("--node-rank", type=int, default=None)
    parser.add_argument("--main-address", default=None)
    parser.add_argument("--main-port", type=int, default=None)
    parser.epilog = "Arguments after -- are passed to every rank's entry point."
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    try:
        result = launch(
            args.run_dir,
            node_rank=args.node_rank,
            main_address=args.main_address,
            main_port=args.main_port,
            extra_args=extra,
        )
    except FinetuneError as err:
        print(err.render(), file=sys.stderr)
        return err.exit_code
    if isinstance(result, NodeInstructions):
        print(result.text)
        return 0
    return result


if __name__ == "__main__":
    sys.exit(main())
