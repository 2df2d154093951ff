#!/usr/bin/env bash
# The wheels the H200 image lacks (qwix, gguf), into .whl/ for the device tool to carry:
#   bash benchmarks/gpu_wheels.sh      # here, where pip reaches PyPI; .whl/ is git-ignored
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
  'qwix==0.1.8' "gguf==$(python3 -c 'import importlib.metadata as m; print(m.version("gguf"))' 2>/dev/null || echo 0.17.1)"
ls -la .whl
