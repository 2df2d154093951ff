"""Is the llama.cpp we compare with built for this CPU? From `llama_print_system_info()`.

llama.cpp's CPU backend prints the SIMD features it was compiled with, e.g.
`CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | ...` (a feature
left out of the build is printed as `= 0` or not at all). A wheel built without
`-DGGML_NATIVE=ON` (pip's default for llama-cpp-python on some setups) can miss AVX2 or
AVX-512 that the CPU has, and then runs several times slower than llama.cpp built for the
machine: a ratio against it says nothing. `missing_features` names what this CPU has
(/proc/cpuinfo) and the build lacks; the benchmarks refuse to print a ratio when it is not
empty.

    python benchmarks/llamacpp_native.py [--llama-cpp-python /work/venv-llamacpp/bin/python]
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

CPU_TO_GGML = {
  "avx": "AVX",
  "avx2": "AVX2",
  "fma": "FMA",
  "f16c": "F16C",
  "avx_vnni": "AVX_VNNI",
  "avx512f": "AVX512",
  "avx512vbmi": "AVX512_VBMI",
  "avx512_vnni": "AVX512_VNNI",
  "avx512_bf16": "AVX512_BF16",
  "amx_int8": "AMX_INT8",
}
"""/proc/cpuinfo flag -> the name llama.cpp's system info gives the same feature."""

BUILD_NOTE = (
  'llama-cpp-python built from source for this CPU: CMAKE_ARGS="-DGGML_NATIVE=ON"'
  " pip install llama-cpp-python==0.3.36 --no-binary llama-cpp-python"
)
"""How the reference llama.cpp of these benchmarks is built (the benchmarks check it)."""

REPORT = """
import json, llama_cpp
print(json.dumps(dict(version=llama_cpp.__version__, path=llama_cpp.__file__,
                      info=llama_cpp.llama_print_system_info().decode(errors="replace"))))
"""


def cpu_flags() -> set[str]:
  """This CPU's flags (/proc/cpuinfo's first `flags` line), empty where it cannot be read."""
  try:
    text = Path("/proc/cpuinfo").read_text()
  except OSError:
    return set()
  line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
  return set(line.partition(":")[2].split())


def build_features(info: str) -> dict[str, int]:
  """`NAME = value` pairs of a `llama_print_system_info()` text, e.g. {'AVX2': 1}."""
  return {m[1]: int(m[2]) for m in re.finditer(r"([A-Z0-9_]+)\s*=\s*(\d+)", info)}


def missing_features(info: str, flags: set[str] | None = None) -> list[str]:
  """The SIMD features this CPU has that the llama.cpp build of `info` lacks (sorted)."""
  flags = cpu_flags() if flags is None else flags
  built = build_features(info)
  return sorted(g for c, g in CPU_TO_GGML.items() if c in flags and not built.get(g))


def describe(version: str, path: str, info: str) -> tuple[str, list[str]]:
  """A paragraph saying which llama.cpp this is and whether it is native, and what it lacks."""
  missing = missing_features(info)
  verdict = (
    "native for this CPU (every SIMD feature of /proc/cpuinfo that llama.cpp uses is on)"
    if not missing
    else f"NOT native for this CPU: the build lacks {', '.join(missing)}, which the CPU has"
  )
  text = (
    f"llama.cpp: llama-cpp-python {version} ({path}); system info: `{info.strip()}`;"
    f" {verdict}. Reference build: {BUILD_NOTE}."
  )
  return text, missing


def query(python: str | None) -> dict:
  """version, path and system info of llama_cpp in `python` (None: this interpreter)."""
  if python is None:
    import llama_cpp

    return dict(
      version=llama_cpp.__version__,
      path=llama_cpp.__file__,
      info=llama_cpp.llama_print_system_info().decode(errors="replace"),
    )
  out = subprocess.run([python, "-c", REPORT], capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def refusal(missing: list[str]) -> str:
  """The line printed instead of a ratio against a non-native build."""
  return (
    f"no ratio: this llama.cpp was not built for this CPU (lacks {', '.join(missing)});"
    f" build it natively ({BUILD_NOTE}) and rerun"
  )


def main() -> None:
  py = (
    sys.argv[sys.argv.index("--llama-cpp-python") + 1] if "--llama-cpp-python" in sys.argv else None
  )
  q = query(py)
  text, missing = describe(q["version"], q["path"], q["info"])
  print(text)
  sys.exit(1 if missing else 0)


if __name__ == "__main__":
  main()
