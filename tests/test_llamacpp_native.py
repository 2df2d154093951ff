"""benchmarks/llamacpp_native.py: a llama.cpp build lacking this CPU's SIMD is refused."""

from benchmarks.llamacpp_native import build_features, missing_features

NATIVE_AVX2 = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | OPENMP = 1 |"
GENERIC = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 0 | F16C = 0 | FMA = 0 | OPENMP = 1 |"
AVX512_CPU = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "sse3"}


def test_build_features_parses_system_info():
  assert build_features(NATIVE_AVX2)["AVX2"] == 1
  assert build_features(GENERIC)["FMA"] == 0


def test_missing_features():
  avx2_cpu = {"avx", "avx2", "fma", "f16c"}
  assert missing_features(NATIVE_AVX2, avx2_cpu) == []
  assert missing_features(GENERIC, avx2_cpu) == ["AVX2", "F16C", "FMA"]
  # an AVX2 build on an AVX-512 CPU: a feature printed as 0 or not at all is missing
  assert missing_features(NATIVE_AVX2, AVX512_CPU) == ["AVX512", "AVX512_VNNI"]
  assert missing_features(NATIVE_AVX2 + " AVX512 = 1 | AVX512_VNNI = 1 |", AVX512_CPU) == []
