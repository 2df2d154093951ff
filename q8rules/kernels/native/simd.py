"""The SIMD path of the native library's calls, chosen by the library at run time from what
this CPU has (`kernels/cpu/isa.h`): on x86-64 AVX-512, else AVX2/FMA/F16C, else scalar; on
aarch64 NEON with ARMv8.2's `sdot`, else plain NEON, else scalar. `$Q8RULES_CPU_ISA` (a name on
this architecture's ladder, or auto) caps it, read by the library on every call, and
`force_scalar` (tests) pins the scalar fallback. The Q8_0-activation product's int8 dots run on
the same path (`act_path`), AVX-512's being VNNI where the CPU has it and AVX2's where not.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

from q8rules.kernels.native import library

ISAS = ("scalar", "avx2", "avx512", "neon", "neon_dotprod")
"""The kernel's SIMD paths, by the codes its `Q8Gemv*Isa` functions return (isa.h)."""

ACT_PATHS = ("scalar", "avx2", "avx512_vnni", "neon", "neon_dotprod")
"""The Q8_0-activation product's int8 paths, by the same codes (AVX-512's is VNNI)."""

LADDERS = {
  "x86_64": ("scalar", "avx2", "avx512"),
  "aarch64": ("scalar", "neon", "neon_dotprod"),
}
"""Each architecture's paths, lowest first: what `$Q8RULES_CPU_ISA` may name there."""


def ladder(machine: str | None = None) -> tuple[str, ...]:
  """The paths of `machine` (default: this one, `platform.machine()`), lowest first."""
  m = (machine or platform.machine()).lower()
  m = {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)
  return LADDERS.get(m, ("scalar",))


def supported() -> tuple[str, ...]:
  """The paths this CPU can run, lowest first (every cap a test may set): the ladder up to
  `isa('best')`; () when the kernel is unavailable."""
  best = isa("best")
  if best is None:
    return ()
  rungs = ladder()
  return rungs[: rungs.index(best) + 1]


@functools.cache
def cpu_flags() -> frozenset[str]:
  """This CPU's feature flags as Linux names them (/proc/cpuinfo's first `flags` line on x86,
  `Features` on ARM: avx2, avx512_vnni, asimddp, ...); empty where it cannot be read."""
  try:
    text = Path("/proc/cpuinfo").read_text()
  except OSError:
    return frozenset()
  for line in text.splitlines():
    key, _, value = line.partition(":")
    if key.strip() in ("flags", "Features"):
      return frozenset(value.split())
  return frozenset()


def isa(which: str = "best") -> str | None:
  """A SIMD path of the loaded kernel: 'best' (what this CPU has), 'selected' (what the next
  call runs, after `$Q8RULES_CPU_ISA` and `force_scalar`) or 'last' (what the last call
  ran); None when the kernel is unavailable (or, for 'last', before any call)."""
  lib = library.library()
  if lib is None:
    return None
  fn = {"best": lib.Q8GemvBestIsa, "selected": lib.Q8GemvSelectedIsa, "last": lib.Q8GemvLastIsa}
  code = int(fn[which]())
  return None if code < 0 else ISAS[code]


def has_avx2() -> bool:
  """Whether the loaded kernel runs a SIMD path on this CPU now (False if unavailable)."""
  lib = library.library()
  return bool(lib is not None and lib.Q8GemvHasAvx2())


def act_path(which: str = "selected") -> str | None:
  """The Q8_0-activation product's int8 path: 'selected' (what the next product runs) or
  'last' (what the last one ran); one of `ACT_PATHS`, None when the kernel is unavailable (or,
  for 'last', before any product)."""
  lib = library.library()
  if lib is None:
    return None
  fn = {"selected": lib.Q8GemvSelectedActPath, "last": lib.Q8GemvLastActPath}
  code = int(fn[which]())
  return None if code < 0 else ACT_PATHS[code]


def last_act_path() -> str | None:
  """The int8 path the last Q8_0-activation product ran (`act_path('last')`)."""
  return act_path("last")


def force_scalar(force: bool) -> None:
  """Run the scalar fallback even on a SIMD CPU (True) or stop forcing it (False); for tests."""
  library.require().Q8GemvForceScalar(int(force))
