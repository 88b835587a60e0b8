#!/usr/bin/env bash
# On a CUDA machine: install the carried wheels (see scripts/gpu_wheels.sh) and run the GPU tests.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
python3 -m pytest -q -m gpu tests/gpu "$@"
