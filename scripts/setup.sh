#!/usr/bin/env bash
# Create .venv with the CPU build of PyTorch and finetune with every extra.
# Idempotent: a second call only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# The CPU torch first: asking pip for plain `torch` would pull a multi-GB CUDA build. PyTorch's CPU
# index has it; where that index is unreachable (a machine with its own mirror), the mirror's torch.
python -c "import torch" 2>/dev/null \
  || pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
  || pip install -q torch==2.13.0
# (the import checks' output goes nowhere: bitsandbytes and DeepSpeed print start-up notices to stdout)
python -c "import finetune, trl, peft, bitsandbytes, hypothesis, xdist, ruff, mypy, lm_eval" >/dev/null 2>&1 \
  || pip install -q -c scripts/constraints.txt -e ".[train,qlora,test]"
# DeepSpeed ships as an sdist whose build imports torch: build it against the torch above.
python -c "import deepspeed" >/dev/null 2>&1 \
  || DS_BUILD_OPS=0 pip install -q --no-build-isolation -c scripts/constraints.txt "deepspeed==0.19.8"
