#!/usr/bin/env bash
# Set up .venv (CPU PyTorch) and fine-tune the shipped tiny Llama-architecture model on CPU:
# it learns to answer a word in capitals, and prints exact match on held-out words before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/finetune run recipes/quickstart.yaml "$@"
