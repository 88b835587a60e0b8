#!/usr/bin/env bash
# Set up (if needed), lint, type-check and run the whole test suite on CPU. GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# format, lint and types first: seconds, and a failure names the line (`ruff format` fixes the first)
.venv/bin/python -m ruff format --check finetune scripts tests
.venv/bin/python -m ruff check finetune scripts tests
.venv/bin/python -m mypy  # the torch-free packages listed in pyproject.toml [tool.mypy]
# Two pytest-xdist workers: most of the suite's time is `finetune run` launches, one core each (imports, then a
# few steps of a tiny model), so two at once use both cores of a 2-core machine. Every test works in its own
# tmp_path (each worker has its own base), ranks of one machine pick free ports, and the session-built runs
# are built once for both (tests/helpers/once.py). Tests are handed out one at a time in collection order
# (--maxschedchunk 1), which tests/conftest.py sorts with the launches (marked slow) first, so the quick tests fill
# both workers at the end; by default each worker would first be given a block of 160, all of the launches on one
# worker. Pass -n 0 to run in one process.
exec .venv/bin/python -m pytest -q -ra -n 2 --maxschedchunk 1 "$@"
