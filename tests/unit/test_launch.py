"""finetune/launch.py's choices that depend on the machine it runs on."""

from __future__ import annotations

import os

from finetune.launch import cpu_threads_per_process


def test_cpu_ranks_take_the_callers_thread_count_or_split_the_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads_per_process(2) == 3
    for unset in ("", "0", "many"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert cpu_threads_per_process(2) == max(1, (os.cpu_count() or 1) // 2)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert cpu_threads_per_process(10_000) == 1
