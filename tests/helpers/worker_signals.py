"""A rank's DataLoader workers under a preemption signal, in a process of its own (a session of its own, as
torchrun starts each rank): `python -m tests.helpers.worker_signals ours|plain group|every SIGNAL`.

`group` signals the process's whole group, as torchrun's agent stops a rank; `every` signals the process and
each worker, as Slurm signals every process of a job step. The process handles the signal as a rank does
(a flag), reads the rest of the epoch, prints how many batches it read, and exits with a second epoch's
iterator still alive (multiprocessing must still be able to end those workers)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

import torch
from transformers import Trainer, TrainingArguments

from finetune.train.signals import WorkersLeavePreemptionToTheRank


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(2, 1)

    def forward(self, x, labels=None):
        return {"loss": (self.w(x) - labels).pow(2).mean()}


def main() -> int:
    which, how, name = sys.argv[1:4]
    sig = signal.Signals[name]
    received: list[int] = []
    signal.signal(sig, lambda s, _f: received.append(s))  # the rank's own handler only sets a flag
    trainer = type("T", (WorkersLeavePreemptionToTheRank, Trainer), {}) if which == "ours" else Trainer
    args = TrainingArguments(
        output_dir=os.environ.get("TMPDIR", "/tmp"),
        per_device_train_batch_size=2,
        dataloader_num_workers=2,
        remove_unused_columns=False,
        use_cpu=True,
        report_to=[],
    )
    data = [{"x": [float(i), 1.0], "labels": [0.0]} for i in range(64)]
    loader = trainer(model=Tiny(), args=args, train_dataset=data).get_train_dataloader()
    batches = iter(loader)
    next(batches)
    if how == "group":
        os.killpg(0, sig)
    else:
        for pid in [os.getpid(), *(p.pid for p in multiprocessing.active_children())]:
            os.kill(pid, sig)
    time.sleep(0.5)
    read = 1 + sum(1 for _ in batches)
    print(f"read {read} batches; the rank saw {len(received)} signal(s)", flush=True)
    alive = iter(loader)
    next(alive)
    return 0


if __name__ == "__main__":
    sys.exit(main())
