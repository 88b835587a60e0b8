"""DataLoader workers survive the preemption signals, so the rank reaches its step boundary and saves.

torchrun's agent stops a rank by signalling its process group (the workers too), and Slurm signals every
process of the step; on the 70B preemption run a worker killed by SIGTERM failed the rank's next batch
before the checkpoint. Real transformers Trainer and torch DataLoader workers, on the CPU."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch
from transformers import Trainer, TrainingArguments

from finetune.train.signals import WorkersIgnorePreemption


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(2, 1)

    def forward(self, x, labels=None):
        return {"loss": (self.w(x) - labels).pow(2).mean()}


def _loader(trainer_cls, tmp_path):
    data = [{"x": [float(i), 1.0], "labels": [0.0]} for i in range(64)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        dataloader_num_workers=2,
        remove_unused_columns=False,
        use_cpu=True,
        report_to=[],
    )
    return trainer_cls(model=_Tiny(), args=args, train_dataset=data).get_train_dataloader()


def _signal_workers_then_read_on(loader, signum):
    batches = iter(loader)
    next(batches)
    workers = multiprocessing.active_children()
    assert len(workers) >= 2
    for worker in workers:
        os.kill(worker.pid, signum)
    time.sleep(0.5)
    return sum(1 for _ in batches) + 1


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_workers_ignore_the_preemption_signals(tmp_path, signum):
    trainer = type("T", (WorkersIgnorePreemption, Trainer), {})
    assert _signal_workers_then_read_on(_loader(trainer, tmp_path), signum) == 32  # every batch arrives


def test_without_it_a_signalled_worker_fails_the_rank(tmp_path):
    """The failure the mixin prevents (what the 70B preemption run printed)."""
    with pytest.raises(RuntimeError, match="killed by signal|exited unexpectedly"):
        _signal_workers_then_read_on(_loader(Trainer, tmp_path), signal.SIGTERM)
