"""YaRN rope scaling as ggml computes it (`ggml_rope_ext` with `ext_factor` 1: ggml-cpu's
`rope_yarn`, `ggml_rope_yarn_corr_dims`, and llama.cpp's `yarn_attn_factor` in
src/llama-context.cpp).

For a layer of rope base b and frequency scale s (1 / the scaling factor F), pair i of n dims
turns by `p * b**(-2i / n) * (s * (1 - r_i) + r_i)` at position p, where r_i ramps from 1
(pairs of high frequency: extrapolated, as trained) down to 0 (low frequency: interpolated by
s) between the correction dims

  low  = max(0, floor(n * ln(n_orig / (beta_fast * 2 pi)) / (2 ln b)))
  high = min(n - 1, ceil(n * ln(n_orig / (beta_slow * 2 pi)) / (2 ln b)))

as r_i = 1 - clip((i - low) / max(0.001, high - low), 0, 1); n_orig is the context the model
was trained at (`rope.scaling.original_context_length`). Cos and sin are multiplied by
`attn_factor * (1 + 0.1 ln(1 / s))`, where llama.cpp's `attn_factor` is
`mscale(F) / (1 + 0.1 ln F) * rope.scaling.attn_factor` (mscale(F) = 1 + 0.1 ln F for F > 1,
else 1): the two cancel, so a layer scaled by the file's factor gets
`rope.scaling.attn_factor * (1 + 0.1 ln F)`. Both are computed in float32, as ggml computes
them (the floor and ceil of the correction dims included).
"""

from __future__ import annotations

import numpy as np

BETA_FAST = 32.0
BETA_SLOW = 1.0
"""llama.cpp's defaults for `yarn_beta_fast` / `yarn_beta_slow` (llama_hparams), which its
loader keeps for every arch but grok and mistral3."""

_F32 = np.float32


def corr_dims(
  n_dims: int, n_orig: int, base: float, beta_fast: float, beta_slow: float
) -> tuple[float, float]:
  """(low, high): ggml's `ggml_rope_yarn_corr_dims`, in float32."""

  def dim(n_rot: float) -> np.float32:
    ratio = _F32(n_orig) / (_F32(n_rot) * _F32(2) * _F32(np.pi))
    return _F32(n_dims) * np.log(ratio) / (_F32(2) * np.log(_F32(base)))

  low = np.floor(dim(beta_fast))
  high = np.ceil(dim(beta_slow))
  return float(max(_F32(0), low)), float(min(_F32(n_dims - 1), high))


def mix(
  n_dims: int,
  n_orig: int,
  base: float,
  scale: float,
  beta_fast: float,
  beta_slow: float,
) -> np.ndarray:
  """Per pair (n_dims / 2,) float32: the factor on its unscaled frequency, `s * (1 - r) + r`
  (1 for every pair when `scale` is 1)."""
  low, high = corr_dims(n_dims, n_orig, base, beta_fast, beta_slow)
  i = np.arange(n_dims // 2, dtype=np.float32)
  y = (i - _F32(low)) / max(_F32(0.001), _F32(high) - _F32(low))
  ramp = _F32(1) - np.minimum(_F32(1), np.maximum(_F32(0), y))
  return (_F32(scale) * (_F32(1) - ramp) + ramp).astype(np.float32)


def mscale(factor: float, scale: float, attn_factor: float) -> float:
  """The factor on cos and sin of a layer of frequency scale `scale`, with the file's scaling
  factor `factor` (F) and `rope.scaling.attn_factor`: llama.cpp's, in float32."""
  f = _F32(factor)
  ln_f = np.log(f)
  peak = _F32(0.1) * ln_f + _F32(1) if f > 1 else _F32(1)
  attn = peak * (_F32(1) / (_F32(1) + _F32(0.1) * ln_f)) * _F32(attn_factor)
  return float(attn * (_F32(1) + _F32(0.1) * np.log(_F32(1) / _F32(scale))))


__all__ = ["BETA_FAST", "BETA_SLOW", "corr_dims", "mix", "mscale"]
