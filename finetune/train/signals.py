"""Preemption: SIGTERM / SIGUSR1 / SIGHUP -> one checkpoint at the next step boundary on every rank ->
exit 75; Ctrl-C (SIGINT) the same with exit 130, and a second SIGINT stops the rank at once.

The launcher (finetune/launch.py) forwards the signal to every rank; a rank's handler only sets a
flag (nothing unsafe runs inside a signal handler). At each step end the ranks all-reduce the flag,
so they agree on the same step even when the signal reached them at different times: the Trainer
then saves (CommitCallback marks the checkpoint complete) and stops, and run_rank raises
Preempted, which exits with EXIT_PREEMPTED (75) for the Slurm script to requeue.

DataLoader workers are not stopped by these signals (WorkersLeavePreemptionToTheRank): torchrun's agent
stops a rank by signalling its whole process group, so each worker leaves that group, and Slurm signals
every process of the job step, so workers ignore SIGUSR1, SIGHUP and SIGINT. A worker killed by the
signal would fail the rank's next batch before the step boundary, and no checkpoint would be saved.
SIGTERM itself still ends a worker: multiprocessing stops workers with it when the rank exits.

When the `finetune` process itself is killed (SIGKILL: no handler runs there), the kernel closes the
pipe it read the ranks' output from at once, but the ranks learn of its death only later, through a
chain of parent-death signals (finetune -> accelerate's launcher -> rank). A rank that prints in
between must not die of BrokenPipeError before that signal arrives: its console moves to its log file.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import signal
import stat
import sys
from pathlib import Path

from transformers import TrainerCallback

from finetune import launch
from finetune.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, FinetuneError
from finetune.rundir import CHECKPOINTS
from finetune.train.callbacks import reduce_flags

log = logging.getLogger("finetune.train")
# the launcher's preemption signals, and Ctrl-C, which also saves one checkpoint (then exits 130)
PREEMPT_SIGNALS = (*launch.PREEMPT_SIGNALS, signal.SIGINT)


# what a DataLoader worker ignores: every preemption signal but SIGTERM, with which multiprocessing ends
# its workers when the rank exits (a worker deaf to it would hang that exit)
WORKER_IGNORED_SIGNALS = tuple(sig for sig in PREEMPT_SIGNALS if sig != signal.SIGTERM)


def _leave_preemption_to_the_rank(worker_init_fn, worker_id: int) -> None:
    os.setpgid(0, 0)  # out of the rank's process group, which torchrun's agent signals to stop the rank
    for sig in WORKER_IGNORED_SIGNALS:  # Slurm signals every process of the job step
        signal.signal(sig, signal.SIG_IGN)
    if worker_init_fn is not None:
        worker_init_fn(worker_id)


def workers_leave_preemption_to_the_rank(loader):
    """`loader`, whose worker processes (if any) are not stopped by a preemption signal meant for their rank.
    The DataLoader reads worker_init_fn when it starts its workers (each epoch or evaluation), so setting it
    here is in time; a partial of module-level functions stays picklable for a spawn or forkserver start.
    accelerate's prepared loader reads through to the DataLoader it wraps (`base_dataloader`), which is the
    one set."""
    inner = getattr(loader, "base_dataloader", loader)
    if getattr(inner, "num_workers", 0):
        inner.worker_init_fn = functools.partial(_leave_preemption_to_the_rank, inner.worker_init_fn)
    return loader


class WorkersLeavePreemptionToTheRank:
    """Trainer mixin: the train and eval DataLoaders' workers are not stopped by the preemption signals."""

    def get_train_dataloader(self):
        return workers_leave_preemption_to_the_rank(super().get_train_dataloader())  # type: ignore[misc]

    def get_eval_dataloader(self, eval_dataset=None):
        return workers_leave_preemption_to_the_rank(super().get_eval_dataloader(eval_dataset))  # type: ignore[misc]


class Preempted(FinetuneError):
    exit_code = EXIT_PREEMPTED


class Interrupted(Preempted):
    exit_code = EXIT_INTERRUPTED


class PreemptionCallback(TrainerCallback):
    """Installs the handlers at construction (main thread) and turns a received signal into
    should_save + should_training_stop at the next step end, agreed by all ranks."""

    def __init__(self, log_path=None):
        self.log_path = str(log_path) if log_path else os.devnull
        self.received: int | None = None
        self.stopped_at: int | None = None
        # the handlers in place before ours (the interpreter's defaults, or a host program's own)
        self._previous = {sig: signal.getsignal(sig) for sig in PREEMPT_SIGNALS}
        # a stop the rank's early handler (finetune.train.__main__) recorded but could not act on, because
        # the exception it raised was swallowed: not lost, the run stops at its first step boundary
        for handler in self._previous.values():
            early = getattr(handler, "stopped", None)
            if early:
                self.received = signal.Signals[early[0]]
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, self._handle)
        self._streams = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = (_survive_a_dead_reader(s, self._detach_from_a_dead_console) for s in self._streams)
        launch.die_with_parent()  # the launcher (accelerate or torchrun's agent) was killed: save and stop

    def _handle(self, signum, _frame):
        if signum == signal.SIGINT and self.received == signal.SIGINT:  # Ctrl-C twice: stop now
            os.write(2, b"second SIGINT: stopping at once, without a checkpoint\n")
            os._exit(EXIT_INTERRUPTED)
        self.received = self.received or signum
        self._detach_from_a_dead_console()

    def _detach_from_a_dead_console(self) -> None:
        """When the `finetune` process that read our output is gone (killed: its death is what sent
        this signal), printing would raise BrokenPipeError before the checkpoint is saved; write the
        rest of the output to the rank's log file instead."""
        import select

        for fd in (1, 2):
            try:
                poll = select.poll()
                poll.register(fd, select.POLLOUT)
                events = poll.poll(0)
            except (OSError, ValueError):
                continue
            if events and events[0][1] & (select.POLLERR | select.POLLHUP):
                target = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(target, fd)
                os.close(target)

    def on_train_begin(self, args, state, control, **kwargs):
        # the rank's early handler (finetune.train.__main__), which restore() puts back as the rank ends, no longer
        # stands for a stop before training
        for handler in self._previous.values():
            if hasattr(handler, "training"):
                handler.training = True
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if not reduce_flags([1.0 if self.received else 0.0])[0]:
            return control
        self.stopped_at = state.global_step
        log.warning(f"{self.signal_name} received: saving checkpoint-{state.global_step} and stopping")
        control.should_save = True
        control.should_training_stop = True
        return control

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received else "a preemption signal on another rank"

    def error(self, run_dir) -> Preempted:
        kind = Interrupted if self.received == signal.SIGINT else Preempted
        return kind(
            f"stopped by {self.signal_name} at step {self.stopped_at}; checkpoint-{self.stopped_at} "
            f"is saved in {Path(run_dir) / CHECKPOINTS}",
            hint="run the same command again to resume from it"
            + ("" if self.received == signal.SIGINT else f" (the Slurm script requeues on exit code {EXIT_PREEMPTED})"),
        )

    def restore(self) -> None:
        """Put back the handlers and streams that were in place before this callback (run_rank calls it
        last); output still to come (the exit message) goes to the log if the console is gone."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        sys.stdout, sys.stderr = self._streams
        self._detach_from_a_dead_console()


class _PipeOrLog(io.RawIOBase):
    """The rank's end of the launcher's output pipe (fd 1 or 2): a write that finds the reader gone calls
    `detach` (which points fds 1 and 2 at the rank's log file) and lands in the log instead."""

    def __init__(self, fd: int, detach):
        super().__init__()
        self._fd, self._detach = fd, detach

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def write(self, data) -> int:
        try:
            return os.write(self._fd, data)
        except BrokenPipeError:
            self._detach()
            return os.write(self._fd, data)


def _survive_a_dead_reader(stream, detach):
    """`stream` (sys.stdout or sys.stderr) as an equivalent text stream over _PipeOrLog when it writes to
    a pipe; otherwise `stream` itself (a file or a terminal does not vanish with the `finetune` process)."""
    try:
        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return stream
        stream.flush()
    except BrokenPipeError:  # the reader is gone already: what follows goes to the log
        detach()
        return stream
    except (AttributeError, OSError, ValueError):  # no fd: a host program captures the output
        return stream
    return io.TextIOWrapper(
        io.BufferedWriter(_PipeOrLog(fd, detach)),
        encoding=stream.encoding,
        errors=stream.errors,
        write_through=True,  # each write reaches the pipe at once, as PYTHONUNBUFFERED has it in a launch
    )
