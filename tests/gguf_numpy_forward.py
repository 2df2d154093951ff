"""A float64 numpy forward pass of a GGUF file of any arch `load_gguf` runs: its yardstick.

Independent of q8rules: the file is read with `gguf.GGUFReader`, every tensor
dequantized with `gguf.quants.dequantize` into float64, and the model written
the way the HF reference implementations write it: for arch `llama` the q / k
rows are first put back into HF's order (the inverse of llama.cpp's converter
permutation) and RoPE always rotates halves. So agreement with it also checks
that the interleaved rope on the file's rows is that permutation.

Per arch (HF's modeling_<arch>.py): qwen3 / gemma3 RMS-normalize q and k per head;
gemma* scale the embeddings by sqrt(dim), use GELU-tanh, and (gemma2/3) normalize
the attention and FFN outputs; qwen3moe and llama with `ffn_*_exps` (Mixtral) route each
token to its top k experts; gemma2 soft-caps scores and logits; gemma2/3 mask
sliding-window layers to the window; phi3 splits its fused qkv and gate|up and
rotates with LongRoPE factors (long when the context exceeds the original one) and
the attention factor. Norm weights are used as the file stores them (Gemma's
converter stores 1 + w, which is HF's (1 + w)).
"""

from __future__ import annotations

import math

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
  dim, heads = _field(r, a + "embedding_length"), _field(r, a + "attention.head_count")
  layers = _field(r, a + "block_count")
  ctx = _field(r, a + "context_length")
  hp = dict(
    arch=arch,
    dim=dim,
    layers=layers,
    heads=heads,
    kv_heads=_field(r, a + "attention.head_count_kv", heads),
    head_dim=_field(r, a + "attention.key_length", dim // heads),
    base=_field(r, a + "rope.freq_base", 10000.0),
    eps=_field(r, a + "attention.layer_norm_rms_epsilon"),
    orig_ctx=_field(r, a + "rope.scaling.original_context_length", ctx),
    attn_factor=_field(r, a + "rope.scaling.attn_factor", 1.0),
    attn_softcap=_field(r, a + "attn_logit_softcapping", 50.0 if arch == "gemma2" else None),
    final_softcap=_field(r, a + "final_logit_softcapping", 30.0 if arch == "gemma2" else None),
    experts_used=_field(r, a + "expert_used_count", 0),
  )
  window = _field(r, a + "attention.sliding_window", 4096 if arch == "gemma2" else 0)
  hp["window"] = window if arch in ("gemma2", "gemma3") else 0  # llama.cpp ignores phi3's
  period = _field(r, a + "attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
  hp["local"] = [hp["window"] > 0 and (i + 1) % period != 0 for i in range(layers)]
  hp["base_local"] = _field(r, a + "rope.freq_base_swa", hp["base"] if arch == "gemma2" else 1e4)
  linear = _field(r, a + "rope.scaling.type") == "linear"
  hp["factor"] = _field(r, a + "rope.scaling.factor", 1.0) if linear else 1.0
  hp["factor_local"] = hp["factor"] if arch == "gemma2" else 1.0  # gemma3: global layers only
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


def _rope_halves(x, base: float, factors=None, mscale: float = 1.0, linear: float = 1.0):
  """HF rotate-half RoPE of x (T, N, H) at positions 0..T-1 (divided by `linear`), float64."""
  t, _, h = x.shape
  inv = base ** (-np.arange(0, h, 2, dtype=np.float64) / h)
  if factors is not None:
    inv = inv / factors
  ang = (np.arange(t, dtype=np.float64) / linear)[:, None] * inv[None]
  cos, sin = mscale * np.cos(ang)[:, None], mscale * np.sin(ang)[:, None]
  x1, x2 = x[..., : h // 2], x[..., h // 2 :]
  return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def gelu_fp16_table(x: np.ndarray) -> np.ndarray:
  """llama.cpp's CPU GELU (ggml's GGML_GELU_FP16): x rounded to float16, gelu of that in
  float32 rounded to float16; x <= -10 gives 0, x >= 10 gives x."""
  h = x.astype(np.float16).astype(np.float32)
  g = 0.5 * h * (1 + np.tanh(np.float32(math.sqrt(2 / math.pi)) * h * (1 + 0.044715 * h * h)))
  out = g.astype(np.float16).astype(np.float64)
  return np.where(x <= -10, 0.0, np.where(x >= 10, x, out))


def product(x: np.ndarray, weight: np.ndarray, name: str) -> np.ndarray:
  """x @ weight.T: a product of `forward`, `name` the GGUF tensor the weight is."""
  del name
  return x @ weight.T


def _attention(hp, w, p, h, i, n_ctx, mm=product, rounded=lambda a: a):
  t, nh, nkv, hd = len(h), hp["heads"], hp["kv_heads"], hp["head_dim"]
  if p + "attn_qkv.weight" in w:
    qkv = mm(h, w[p + "attn_qkv.weight"], p + "attn_qkv.weight")
    q, k, v = np.split(qkv, [nh * hd, (nh + nkv) * hd], -1)
  else:
    wq, wk = w[p + "attn_q.weight"], w[p + "attn_k.weight"]
    if hp["arch"] == "llama":
      wq, wk = unpermute(wq, nh), unpermute(wk, nkv)
    q, k = mm(h, wq, p + "attn_q.weight"), mm(h, wk, p + "attn_k.weight")
    v = mm(h, w[p + "attn_v.weight"], p + "attn_v.weight")
  if p + "attn_q.bias" in w:
    q, k, v = q + w[p + "attn_q.bias"], k + w[p + "attn_k.bias"], v + w[p + "attn_v.bias"]
  q, k, v = q.reshape(t, nh, hd), k.reshape(t, nkv, hd), v.reshape(t, nkv, hd)
  if p + "attn_q_norm.weight" in w:
    q = _rms(q, w[p + "attn_q_norm.weight"], hp["eps"])
    k = _rms(k, w[p + "attn_k_norm.weight"], hp["eps"])
  local = hp["local"][i]
  factors = w.get("rope_freqs.weight")
  if "rope_factors_long.weight" in w:
    long = n_ctx > hp["orig_ctx"]
    factors = w["rope_factors_long.weight" if long else "rope_factors_short.weight"]
  base = hp["base_local"] if local else hp["base"]
  linear = hp["factor_local"] if local else hp["factor"]
  q = _rope_halves(q, base, factors, hp["attn_factor"], linear)
  k = _rope_halves(k, base, factors, hp["attn_factor"], linear)
  q, k, v = rounded(q), rounded(k), rounded(v)
  k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
  scale = 1 / math.sqrt(hd)
  if hp["arch"] in ("gemma2", "gemma3") and hp["layers"] in (46, 62):  # 27B: dim / heads
    scale = 1 / math.sqrt(hp["dim"] / nh)
  s = np.einsum("tnh,snh->nts", q, k) * scale
  if hp["arch"] == "gemma2":
    s = np.tanh(s / hp["attn_softcap"]) * hp["attn_softcap"]
  d = np.arange(t)[:, None] - np.arange(t)[None, :]
  visible = (d >= 0) & ((d < hp["window"]) if local else True)
  s = np.where(visible, s, -np.inf)
  s = np.exp(s - s.max(-1, keepdims=True))
  s = rounded(s / s.sum(-1, keepdims=True))
  o = np.einsum("nts,snh->tnh", s, v).reshape(t, nh * hd)
  return mm(o, w[p + "attn_output.weight"], p + "attn_output.weight")


def _ffn(w: dict, p: str, h: np.ndarray, gelu, mm) -> np.ndarray:
  """The gated FFN on h (T, dim): GeGLU with `gelu`, else SwiGLU."""
  if p + "ffn_gate.weight" in w:
    g = mm(h, w[p + "ffn_gate.weight"], p + "ffn_gate.weight")
    u = mm(h, w[p + "ffn_up.weight"], p + "ffn_up.weight")
  else:  # phi3: gate | up in one matrix
    g, u = np.split(mm(h, w[p + "ffn_up.weight"], p + "ffn_up.weight"), 2, -1)
  act = gelu(g) if gelu is not None else g / (1 + np.exp(-g))
  return mm(act * u, w[p + "ffn_down.weight"], p + "ffn_down.weight")


def moe_ffn(w: dict, p: str, h: np.ndarray, k: int, routes: list | None = None) -> np.ndarray:
  """HF's Qwen3MoE / Mixtral sparse block on h (T, dim): softmax over the router's logits, the
  top k experts, their weights renormalised to sum 1, each expert's SwiGLU FFN (its stacks
  [E, n_out, n_in]) weighted and summed."""
  probs = h @ w[p + "ffn_gate_inp.weight"].T
  probs = np.exp(probs - probs.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  if routes is not None:
    routes.append(probs)
  out = np.zeros_like(h)
  for t in range(len(h)):
    top = np.argsort(-probs[t], kind="stable")[:k]
    for e, weight in zip(top, probs[t, top] / probs[t, top].sum(), strict=True):
      g = w[p + "ffn_gate_exps.weight"][e] @ h[t]
      u = w[p + "ffn_up_exps.weight"][e] @ h[t]
      out[t] += weight * (w[p + "ffn_down_exps.weight"][e] @ (g / (1 + np.exp(-g)) * u))
  return out


def forward(
  hp: dict,
  w: dict[str, np.ndarray],
  ids,
  n_ctx: int = 256,
  gelu=gelu_tanh,
  mm=product,
  rounded=lambda a: a,
  routes: list | None = None,
):
  """Logits (T, vocab) float64 of token ids (T,); `n_ctx` is the context llama.cpp would run
  with (it picks Phi-3's LongRoPE factors); `gelu` the GELU of the gemma archs; `routes`, when
  given, gets each MoE layer's router probabilities (T, E) appended. `mm` makes
  every product (`product`'s signature) and `rounded` is applied to the attention's q, k, v
  (after RoPE) and weights: both for putting another implementation's roundings back
  (benchmarks/llamacpp_rounding.py); by default the exact model."""
  ids = np.asarray(ids)
  arch = hp["arch"]
  gemma = arch.startswith("gemma")
  x = w["token_embd.weight"][ids]
  if gemma:
    x = x * math.sqrt(hp["dim"])
  for i in range(hp["layers"]):
    p = f"blk.{i}."
    h = _rms(x, w[p + "attn_norm.weight"], hp["eps"])
    o = _attention(hp, w, p, h, i, n_ctx, mm, rounded)
    if p + "post_attention_norm.weight" in w:
      o = _rms(o, w[p + "post_attention_norm.weight"], hp["eps"])
    x = x + o
    h = _rms(x, w[p + "ffn_norm.weight"], hp["eps"])
    if p + "ffn_gate_inp.weight" in w:
      f = moe_ffn(w, p, h, hp["experts_used"], routes)
    else:
      f = _ffn(w, p, h, gelu if gemma else None, mm)
    if p + "post_ffw_norm.weight" in w:
      f = _rms(f, w[p + "post_ffw_norm.weight"], hp["eps"])
    x = x + f
  x = _rms(x, w["output_norm.weight"], hp["eps"])
  head = "output.weight" if "output.weight" in w else "token_embd.weight"
  logits = mm(x, w[head], head)
  if hp["final_softcap"]:
    logits = np.tanh(logits / hp["final_softcap"]) * hp["final_softcap"]
  return logits
