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
exec .venv/bin/python -m pytest -q -ra "$@"
