"""A float64 numpy forward pass of a `gpt-oss` GGUF file: the yardstick of tests/test_llm_gpt_oss.py.

Independent of q8rules: the file is read with `gguf.GGUFReader`, every tensor dequantized
with `gguf.quants.dequantize` into float64, and the model written as OpenAI's gpt-oss
reference (HF's modeling_gpt_oss) writes it, with llama.cpp's readings where they differ:

  * attention: q, k, v with biases; NEOX (rotate-half) rope with YaRN; GQA; causal, and on
    even layers a sliding window; each head's softmax has one more logit, its sink (weight
    exp(sink) in the denominator, no value); the output projection with a bias;
  * YaRN's correction dims rounded down / up (llama.cpp always rounds them: HF's config says
    `truncate: false`), beta fast 32 / slow 1, cos and sin times 1 + 0.1 ln(factor);
  * the FFN: RMS norm (`post_attention_norm`), router logits (with bias), the top k of the
    logits, their softmax as the weights; each chosen expert's gate and up (with biases),
    glu = min(gate, 7) * sigmoid(1.702 * min(gate, 7)) * (clip(up, -7, 7) + 1), then down
    (with bias), weighted and summed;
  * an untied output projection.
"""

from __future__ import annotations

import math

import gguf
import numpy as np

ALPHA, LIMIT = 1.702, 7.0
"""swiglu_oai's constants (llama.cpp's build_moe_ffn, OpenAI's reference)."""


def _field(reader: gguf.GGUFReader, key: str, default=None):
  f = reader.fields.get(key)
  return default if f is None else f.contents()


def load_float64(path) -> tuple[dict, dict[str, np.ndarray]]:
  """(hparams, name -> float64 array in GGUF numpy order) of a gpt-oss file."""
  r = gguf.GGUFReader(path)
  a = "gpt-oss."
  hp = dict(
    layers=_field(r, a + "block_count"),
    heads=_field(r, a + "attention.head_count"),
    kv_heads=_field(r, a + "attention.head_count_kv"),
    head_dim=_field(r, a + "attention.key_length"),
    base=_field(r, a + "rope.freq_base"),
    eps=_field(r, a + "attention.layer_norm_rms_epsilon"),
    factor=_field(r, a + "rope.scaling.factor"),
    orig_ctx=_field(r, a + "rope.scaling.original_context_length"),
    window=_field(r, a + "attention.sliding_window"),
    experts_used=_field(r, a + "expert_used_count"),
  )
  w = {}
  for t in r.tensors:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    w[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float64).reshape(shape)
  return hp, w


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def yarn_inv_freq(head_dim: int, base: float, factor: float, orig_ctx: int) -> np.ndarray:
  """Per pair (head_dim / 2,): YaRN's frequencies, float64, llama.cpp's rounded corr dims."""
  inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)

  def corr_dim(n_rot: float) -> float:
    return head_dim * math.log(orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(base))

  low = max(0.0, math.floor(corr_dim(32.0)))
  high = min(head_dim - 1.0, math.ceil(corr_dim(1.0)))
  i = np.arange(head_dim // 2, dtype=np.float64)
  ramp = 1 - np.clip((i - low) / max(0.001, high - low), 0, 1)  # 1: extrapolated, as trained
  return inv / factor * (1 - ramp) + inv * ramp


def _rope(x: np.ndarray, inv: np.ndarray, mscale: float) -> np.ndarray:
  """Rotate-half RoPE of x (T, N, H) at positions 0..T-1, cos and sin times mscale."""
  ang = np.arange(len(x), dtype=np.float64)[:, None] * inv[None]
  cos, sin = mscale * np.cos(ang)[:, None], mscale * np.sin(ang)[:, None]
  h = x.shape[-1] // 2
  x1, x2 = x[..., :h], x[..., h:]
  return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def attention(hp: dict, w: dict, p: str, h: np.ndarray, local: bool) -> np.ndarray:
  t, nh, nkv, hd = len(h), hp["heads"], hp["kv_heads"], hp["head_dim"]
  q = (h @ w[p + "attn_q.weight"].T + w[p + "attn_q.bias"]).reshape(t, nh, hd)
  k = (h @ w[p + "attn_k.weight"].T + w[p + "attn_k.bias"]).reshape(t, nkv, hd)
  v = (h @ w[p + "attn_v.weight"].T + w[p + "attn_v.bias"]).reshape(t, nkv, hd)
  inv = yarn_inv_freq(hd, hp["base"], hp["factor"], hp["orig_ctx"])
  mscale = 1 + 0.1 * math.log(hp["factor"])
  q, k = _rope(q, inv, mscale), _rope(k, inv, mscale)
  k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
  s = np.einsum("tnh,snh->nts", q, k) / math.sqrt(hd)
  d = np.arange(t)[:, None] - np.arange(t)[None, :]
  visible = (d >= 0) & ((d < hp["window"]) if local else True)
  s = np.where(visible, s, -np.inf)
  sink = w[p + "attn_sinks.weight"][:, None, None]  # (heads, 1, 1)
  top = np.maximum(s.max(-1, keepdims=True), sink)
  e = np.exp(s - top)
  probs = e / (e.sum(-1, keepdims=True) + np.exp(sink - top))
  o = np.einsum("nts,snh->tnh", probs, v).reshape(t, nh * hd)
  return o @ w[p + "attn_output.weight"].T + w[p + "attn_output.bias"]


def swiglu_oai(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
  g = np.minimum(gate, LIMIT)
  return g / (1 + np.exp(-ALPHA * g)) * (np.clip(up, -LIMIT, LIMIT) + 1)


def experts(hp: dict, w: dict, p: str, h: np.ndarray) -> np.ndarray:
  """The routed experts of h (T, dim) -> (T, dim)."""
  logits = h @ w[p + "ffn_gate_inp.weight"].T + w[p + "ffn_gate_inp.bias"]
  k = hp["experts_used"]
  out = np.zeros_like(h)
  for t in range(len(h)):
    chosen = np.argsort(-logits[t], kind="stable")[:k]
    weights = np.exp(logits[t, chosen] - logits[t, chosen].max())
    weights /= weights.sum()
    for e, weight in zip(chosen, weights, strict=True):
      gate = w[p + "ffn_gate_exps.weight"][e] @ h[t] + w[p + "ffn_gate_exps.bias"][e]
      up = w[p + "ffn_up_exps.weight"][e] @ h[t] + w[p + "ffn_up_exps.bias"][e]
      down = w[p + "ffn_down_exps.weight"][e] @ swiglu_oai(gate, up)
      out[t] += weight * (down + w[p + "ffn_down_exps.bias"][e])
  return out


def forward(hp: dict, w: dict[str, np.ndarray], ids) -> np.ndarray:
  """Logits (T, vocab) float64 of token ids (T,) from position 0."""
  x = w["token_embd.weight"][np.asarray(ids)]
  for i in range(hp["layers"]):
    p = f"blk.{i}."
    x = x + attention(hp, w, p, _rms(x, w[p + "attn_norm.weight"], hp["eps"]), i % 2 == 0)
    x = x + experts(hp, w, p, _rms(x, w[p + "post_attention_norm.weight"], hp["eps"]))
  return _rms(x, w["output_norm.weight"], hp["eps"]) @ w["output.weight"].T
