"""The sampler chain in float64 numpy, written the plain way (a sort, loops): the yardstick the
traced chain (`q8rules.engine.chain`) is tested against."""

from __future__ import annotations

from collections import Counter

import numpy as np

from q8rules.engine.sampling import SamplingParams


def reference_probabilities(
  logits: np.ndarray, recent: list[int], params: SamplingParams
) -> np.ndarray:
  """The probability of each id (vocab,) float64 under `params` after the ids `recent` (the
  prompt and what was generated, oldest first; greedy: 1 at the argmax after the bias and the
  penalties)."""
  x = np.asarray(logits, np.float64).copy()
  for i, b in params.logit_bias:
    if i < len(x):
      x[i] += b
  counted = [r for r in recent[len(recent) - params.penalty_last_n :] if r >= 0]
  if params.penalty_last_n and params.penalized:
    for i, n in Counter(counted).items():
      x[i] = x[i] / params.repeat_penalty if x[i] > 0 else x[i] * params.repeat_penalty
      x[i] -= n * params.frequency_penalty + params.presence_penalty
  order = sorted(range(len(x)), key=lambda i: (-x[i], i))
  kept = order[: params.top_k] if params.top_k else order
  if params.top_p < 1.0:
    e = np.exp(x[kept] - x[kept].max())
    p, mass, cut = e / e.sum(), 0.0, []
    for i, pi in zip(kept, p, strict=True):
      if mass >= params.top_p:
        break
      cut.append(i)
      mass += pi
    kept = cut
  if params.min_p > 0.0:
    e = np.exp(x[kept] - x[kept].max())
    p = e / e.sum()
    kept = [i for i, pi in zip(kept, p, strict=True) if pi >= params.min_p * p.max()]
  out = np.zeros(len(x))
  if params.greedy:
    out[min(range(len(x)), key=lambda i: (-x[i], i))] = 1.0
    return out
  z = x[kept] / params.temperature
  e = np.exp(z - z.max())
  out[kept] = e / e.sum()
  return out


__all__ = ["reference_probabilities"]
