#!/usr/bin/env bash
# The GPU check, one prepared run on a lent machine (under 5 minutes; installs nothing from the
# network): the test suite on the GPU (100 s), then every implementation's correctness against
# float64 and the timings (decode, prefill, a Llama-3-8B-shaped model, fold variants; 150 s);
# writes benchmarks/RESULTS_GPU.md (or --out PATH).
#   here, once:      bash benchmarks/gpu_wheels.sh              (qwix and gguf wheels into .whl/)
#   on the device:   bash benchmarks/gpu_check.sh --out "$OUT/RESULTS_GPU.md"   (carry .whl)
#   here, to check:  bash benchmarks/gpu_check.sh --smoke --out /tmp/r.md       (CPU, interpret)
set -uo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader || true
PY="${PYTHON:-python3}"
# qwix (which `import q8rules` needs) and gguf (the tests'), from the wheels gpu_wheels.sh fetched
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/q8rules-site .whl/*.whl && export PYTHONPATH="/tmp/q8rules-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import qwix, gguf" 2>/dev/null; then
  echo "gpu_check.sh: qwix or gguf is missing: run 'bash benchmarks/gpu_wheels.sh' where pip reaches" \
    "PyPI and carry .whl/ to this machine" >&2
  exit 1
fi
suite_log="$(mktemp)"
smoke=0
for a in "$@"; do [ "$a" = "--smoke" ] && smoke=1; done
if [ "$smoke" = 1 ]; then
  tests=(tests/test_q8_0.py tests/test_precision.py)
else
  tests=(tests --ignore=tests/test_notebooks.py)
fi
# The suite, time-boxed so the timings still run (in parallel where pytest-xdist is there, as on
# the H200 image); its summary goes into the results file.
parallel=()
"$PY" -c "import xdist" 2>/dev/null && [ "$smoke" = 0 ] && parallel=(-n 8)
timeout "${SUITE_BUDGET_S:-100}" "$PY" -m pytest -q -p no:cacheprovider -m "not slow" -rf \
  "${parallel[@]}" "${tests[@]}" 2>&1 | tee "$suite_log" | tail -40
exec "$PY" benchmarks/gpu_check.py --suite-log "$suite_log" "$@"
