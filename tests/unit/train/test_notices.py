"""finetune/train/notices.py: the libraries' notices about parts a run does not use are switched off, and only
those: QLoRA on a CPU keeps bitsandbytes' notice about its CPU kernel, which that run would use."""

from __future__ import annotations

import logging
import os

import pytest

from finetune.train.notices import LIGER_BACKEND_REGISTRY, quiet_unused_library_notices


@pytest.fixture
def loggers():
    names = ("bitsandbytes.backends.cpu.ops", LIGER_BACKEND_REGISTRY)
    before = {n: logging.getLogger(n).level for n in names}
    yield {n: logging.getLogger(n) for n in names}
    for name, level in before.items():
        logging.getLogger(name).setLevel(level)


def test_gpu_lora_run(loggers, monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    quiet_unused_library_notices(device="cuda", adapter="lora")
    assert loggers[LIGER_BACKEND_REGISTRY].level == logging.ERROR
    assert loggers["bitsandbytes.backends.cpu.ops"].level == logging.ERROR
    assert "DS_ACCELERATOR" not in os.environ  # DeepSpeed finds the GPU itself


def test_cpu_qlora_run_keeps_the_bitsandbytes_notice(loggers, monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    loggers["bitsandbytes.backends.cpu.ops"].setLevel(logging.NOTSET)
    quiet_unused_library_notices(device="cpu", adapter="qlora")
    assert loggers["bitsandbytes.backends.cpu.ops"].level == logging.NOTSET
    assert os.environ["DS_ACCELERATOR"] == "cpu"
