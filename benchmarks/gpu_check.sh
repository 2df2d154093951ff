#!/usr/bin/env bash
# The fold's GPU check on a lent machine, from anywhere: bash benchmarks/gpu_check.sh [--out PATH]
# Needs python with jax (CUDA) and numpy; Qwix rows appear only if `import qwix` works there.
# On CPU, add --smoke (tiny shapes, Pallas interpret mode) to check the script itself.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
exec env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
