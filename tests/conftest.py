"""Shared fixtures: offline Hugging Face, GPU tests skipped without CUDA, a token cache per test, and the
runs built once per session (once for all pytest-xdist workers: tests/helpers/once.py) for the tests that only
read a finished run. Builders live in tests/helpers."""

from __future__ import annotations

import gc
import hashlib
import os
import sys
from pathlib import Path

import pytest

from finetune.train import collector
from tests.helpers.once import once_per_session
from tests.helpers.paths import TINY_MODEL

# Nothing in the suite may reach the Hub; set before transformers/datasets are imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread for the models trained in this process and in the processes it starts directly: a
# 64-wide model gains nothing from two, and on a shared 2-core machine two threads spin against each
# other (the quickstart trains in 11 s with one, 43 s with two). The CPU ranks `finetune run` launches
# take the same setting (finetune.launch.cpu_threads_per_process).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed on its CPU accelerator JIT-builds a shared-memory op (~50 s on two cores) into torch's extensions
# directory. Checkouts whose virtualenvs live at other paths would share ~/.cache/torch_extensions and rebuild
# the op over each other's build (its build names the virtualenv's paths); one directory per virtualenv keeps it.
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    str(Path.home() / ".cache" / "torch_extensions" / f"venv-{hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]}"),
)


# Collecting imports torch, transformers and the test modules: ~500k objects that live as long as the worker.
# The garbage collector would rescan them all over and over while they load (a quarter of the collection's
# time, in each worker); as in a rank (finetune/train/collector.py) it is held off until collection ends, and they
# are then frozen out of later passes.
collector.hold_until_loaded()


def pytest_configure(config):
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", default=None):
        gc.enable()  # pytest-xdist's controller: it collects nothing


def pytest_collection_finish(session):
    collector.loaded()


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)
    # The launches (marked slow: 5-70 s each) first, each file's in collection order, then the ~2,700 quick tests.
    # pytest-xdist hands tests out in this order (scripts/test.sh), so the quick ones fill both workers at the
    # end instead of one worker finishing the last long launch while the other idles. A stable sort, the same
    # in every worker (xdist checks that the workers collected the same order).
    items.sort(key=lambda item: "slow" not in item.keywords)


@pytest.fixture
def tiny_model_path() -> Path:
    return TINY_MODEL


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # every test gets its own tokenized-data cache unless it sets one itself
    monkeypatch.setenv("FINETUNE_CACHE_DIR", str(tmp_path_factory.mktemp("tokcache")))


@pytest.fixture(scope="session")
def trained_cli_run(tmp_path_factory):
    """One real 8-step LoRA `finetune run` (tests/helpers/trained_run.py): its RUN_DIR and what it printed."""
    from tests.helpers.trained_run import train_tiny_run

    return once_per_session(tmp_path_factory, "trained", train_tiny_run)


@pytest.fixture(scope="session")
def trained_run(trained_cli_run) -> Path:
    """RUN_DIR of the session's trained LoRA run; read it, or copy it to change it."""
    return trained_cli_run.run_dir


@pytest.fixture(scope="session")
def two_step_run(tmp_path_factory) -> Path:
    """RUN_DIR of a finished 2-step run that kept no checkpoint (tests/helpers/trained_run.py); copy it to use it."""
    from tests.helpers.trained_run import finished_two_step_run

    return once_per_session(tmp_path_factory, "two-steps", finished_two_step_run)


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory) -> dict[str, Path]:
    """base, lora, dora and full run dirs (tests/helpers/run_dirs.py); copy one to change it."""
    from tests.helpers.run_dirs import build_tiny_runs

    return once_per_session(tmp_path_factory, "tiny", build_tiny_runs)
