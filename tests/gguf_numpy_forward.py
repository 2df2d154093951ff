"""A float64 numpy forward pass of a llama / qwen2 GGUF file: the yardstick for `load_gguf`.

Independent of q8rules: the file is read with `gguf.GGUFReader`, every tensor
dequantized with `gguf.quants.dequantize` into float64, and the model written
the way the HF reference implementations write it: for arch `llama` the q / k
rows are first put back into HF's order (the inverse of llama.cpp's converter
permutation) and RoPE rotates halves, as for `qwen2`. So agreement with it
also checks that the interleaved rope on the file's rows is that permutation.
"""

from __future__ import annotations

import gguf
import numpy as np


def _field(reader: gguf.GGUFReader, key: str, default=None):
  f = reader.fields.get(key)
  return default if f is None else f.contents()


def load_float64(path) -> tuple[dict, dict[str, np.ndarray]]:
  """(hparams, name -> float64 array in GGUF numpy order) of a GGUF file."""
  r = gguf.GGUFReader(path)
  arch = _field(r, "general.architecture")
  a = arch + "."
  hp = dict(
    arch=arch,
    dim=_field(r, a + "embedding_length"),
    layers=_field(r, a + "block_count"),
    heads=_field(r, a + "attention.head_count"),
    kv_heads=_field(r, a + "attention.head_count_kv"),
    base=_field(r, a + "rope.freq_base", 10000.0),
    eps=_field(r, a + "attention.layer_norm_rms_epsilon"),
  )
  w = {}
  for t in r.tensors:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    w[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float64).reshape(shape)
  return hp, w


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Inverse of llama.cpp's converter permutation (`LlamaModel.permute`): back to HF rows."""
  return (
    w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
  )


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope_halves(x: np.ndarray, base: float) -> np.ndarray:
  """HF rotate-half RoPE of x (T, N, H) at positions 0..T-1, float64."""
  t, _, h = x.shape
  inv = base ** (-np.arange(0, h, 2, dtype=np.float64) / h)
  ang = np.arange(t, dtype=np.float64)[:, None] * inv[None]
  cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
  x1, x2 = x[..., : h // 2], x[..., h // 2 :]
  return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def forward(hp: dict, w: dict[str, np.ndarray], ids) -> np.ndarray:
  """Logits (T, vocab) float64 of token ids (T,)."""
  ids = np.asarray(ids)
  d, nh, nkv = hp["dim"], hp["heads"], hp["kv_heads"]
  hd = d // nh
  x = w["token_embd.weight"][ids]
  t = len(ids)
  mask = np.triu(np.full((t, t), -np.inf), 1)
  for i in range(hp["layers"]):
    p = f"blk.{i}."
    h = _rms(x, w[p + "attn_norm.weight"], hp["eps"])
    wq, wk = w[p + "attn_q.weight"], w[p + "attn_k.weight"]
    if hp["arch"] == "llama":
      wq, wk = unpermute(wq, nh), unpermute(wk, nkv)
    q, k, v = h @ wq.T, h @ wk.T, h @ w[p + "attn_v.weight"].T
    if p + "attn_q.bias" in w:
      q, k, v = q + w[p + "attn_q.bias"], k + w[p + "attn_k.bias"], v + w[p + "attn_v.bias"]
    q = _rope_halves(q.reshape(t, nh, hd), hp["base"])
    k = _rope_halves(k.reshape(t, nkv, hd), hp["base"])
    v = v.reshape(t, nkv, hd)
    k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
    s = np.einsum("tnh,snh->nts", q, k) / np.sqrt(hd) + mask
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    o = np.einsum("nts,snh->tnh", s, v).reshape(t, d)
    x = x + o @ w[p + "attn_output.weight"].T
    h = _rms(x, w[p + "ffn_norm.weight"], hp["eps"])
    g = h @ w[p + "ffn_gate.weight"].T
    x = x + ((g / (1 + np.exp(-g))) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
  x = _rms(x, w["output_norm.weight"], hp["eps"])
  return x @ w.get("output.weight", w["token_embd.weight"]).T
