"""The SIMD path of the native library's calls: AVX-512, else AVX2/FMA/F16C, else scalar,
chosen by the library at run time from what this CPU has; `$Q8RULES_CPU_ISA` (avx512, avx2,
scalar, auto) caps it, read by the library on every call, and `force_scalar` (tests) pins the
scalar fallback. The Q8_0-activation product has its own AVX-512 VNNI path (`has_vnni`).
"""

from __future__ import annotations

from q8rules.kernels.native import library

ISAS = ("scalar", "avx2", "avx512")
"""The kernel's SIMD paths, by the codes its `Q8Gemv*Isa` functions return."""


def isa(which: str = "best") -> str | None:
  """A SIMD path of the loaded kernel: 'best' (what this CPU has), 'selected' (what the next
  call runs, after `$Q8RULES_CPU_ISA` and `force_scalar`) or 'last' (what the last call
  ran); None when the kernel is unavailable."""
  lib = library.library()
  if lib is None:
    return None
  fn = {"best": lib.Q8GemvBestIsa, "selected": lib.Q8GemvSelectedIsa, "last": lib.Q8GemvLastIsa}
  return ISAS[fn[which]()]


def has_avx2() -> bool:
  """Whether the loaded kernel runs a SIMD path on this CPU (False if unavailable)."""
  lib = library.library()
  return bool(lib is not None and lib.Q8GemvHasAvx2())


def has_vnni() -> bool:
  """Whether the loaded kernel's Q8_0-activation product runs its AVX-512 VNNI path on this CPU
  (False: its scalar path, or the kernel is unavailable)."""
  lib = library.library()
  return bool(lib is not None and lib.Q8GemvHasVnni())


def last_act_path() -> str | None:
  """The path the last Q8_0-activation product ran: 'avx512_vnni' or 'scalar' (None: none
  has run, or the kernel is unavailable)."""
  lib = library.library()
  code = -1 if lib is None else int(lib.Q8GemvLastActVnni())
  return None if code < 0 else ("avx512_vnni" if code else "scalar")


def force_scalar(force: bool) -> None:
  """Run the scalar fallback even on an AVX2 CPU (True) or stop forcing it (False); for tests."""
  library.require().Q8GemvForceScalar(int(force))
