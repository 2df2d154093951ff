"""A float64 numpy forward pass of a `gemma4` GGUF file: the yardstick of tests/test_llm_gemma4.py.

Independent of q8rules: the file is read with `gguf.GGUFReader` (tests/gguf_numpy_forward.py's
`load_float64`: every tensor dequantized into float64) and the model written as Hugging Face's
Gemma 4 writes it (modeling_gemma4.py), with the keys llama.cpp's loader reads:

  x = embed[ids] * sqrt(dim)
  per-layer inputs (per_layer_token_embd): (norm(x @ per_layer_model_proj / sqrt(dim)) +
    per_layer_token_embd[ids] * sqrt(P)) / sqrt(2), one (T, P) slice per layer
  each layer: attention (q, k RMS-normed with weights, v without; rope halves, the global
    layers' frequencies divided by rope_freqs; scale 1; local layers see the window; a layer
    past `shared_kv_layers`' start reuses the K, V of the last earlier layer of its kind; a
    layer without attn_v uses K's projection as V), post-attention norm, residual; GeGLU FFN,
    post-FFN norm, residual; per-layer branch x + norm(proj(gelu(inp_gate(x)) * in_i)); times
    layer_output_scale
  with experts (expert_count), the FFN is post_ffw_norm_1(dense(ffn_norm(x))) +
    post_ffw_norm_2(sum_j w_j s_e down_e(gelu(gate_e(y)) * up_e(y))) with y = pre_ffw_norm_2(x),
    e the top k of softmax(ffn_gate_inp @ (rms_norm(x) / sqrt(dim) * ffn_gate_inp.scale)), w
    those k probabilities normalized, s = ffn_down_exps.scale (HF's Gemma4 MoE block)
  logits = final soft-cap(norm(x) @ embed)
"""

from __future__ import annotations

import math

import gguf
import numpy as np

from tests.gguf_numpy_forward import _rms, _rope_halves, gelu_tanh, load_float64


def hparams(path) -> dict:
  """The gemma4 keys the forward needs, as llama.cpp reads them (its defaults)."""
  r = gguf.GGUFReader(path)

  def get(key: str, default=None):
    f = r.fields.get(f"gemma4.{key}")
    return default if f is None else f.contents()

  layers = get("block_count")
  heads = get("attention.head_count")
  kv = get("attention.head_count_kv", heads)
  ffn = get("feed_forward_length")
  return dict(
    dim=get("embedding_length"),
    layers=layers,
    heads=heads,
    kv_heads=kv if isinstance(kv, list) else [kv] * layers,
    ffn=ffn if isinstance(ffn, list) else [ffn] * layers,
    head_dim=get("attention.key_length"),
    head_dim_swa=get("attention.key_length_swa"),
    base=get("rope.freq_base", 10000.0),
    base_swa=get("rope.freq_base_swa", 10000.0),
    eps=get("attention.layer_norm_rms_epsilon"),
    window=get("attention.sliding_window"),
    local=[bool(b) for b in get("attention.sliding_window_pattern")],
    shared_kv=get("attention.shared_kv_layers", 0),
    per_layer=get("embedding_length_per_layer_input", 0),
    final_softcap=get("final_logit_softcapping", 30.0),
    experts=get("expert_count", 0),
    experts_used=get("expert_used_count", 0),
  )


def load(path) -> tuple[dict, dict[str, np.ndarray]]:
  """(hparams, name -> float64 array in GGUF numpy order) of a gemma4 file."""
  return hparams(path), load_float64(path)[1]


def _norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
  return _rms(x, 1.0 if w is None else w, eps)


def _attention(hp, w, p, h, i, kv_of):
  """Layer i's attention output (T, dim); a layer that computes KV keeps its (k, v) in kv_of."""
  t, nh, eps = len(h), hp["heads"], hp["eps"]
  local = hp["local"][i]
  hd = hp["head_dim_swa"] if local else hp["head_dim"]
  base = hp["base_swa"] if local else hp["base"]
  factors = None if local else w.get("rope_freqs.weight")
  q = _norm((h @ w[p + "attn_q.weight"].T).reshape(t, nh, hd), w[p + "attn_q_norm.weight"], eps)
  q = _rope_halves(q, base, factors)
  own = hp["layers"] - hp["shared_kv"]
  if i < own:
    nkv = hp["kv_heads"][i]
    k_raw = (h @ w[p + "attn_k.weight"].T).reshape(t, nkv, hd)
    v_raw = k_raw if p + "attn_v.weight" not in w else (h @ w[p + "attn_v.weight"].T)
    k = _rope_halves(_norm(k_raw, w[p + "attn_k_norm.weight"], eps), base, factors)
    v = _norm(v_raw.reshape(t, nkv, hd), None, eps)
    kv_of[i] = (k, v)
  else:
    k, v = kv_of[own - (2 if local else 1)]
  rep = nh // k.shape[1]
  k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
  s = np.einsum("tnh,snh->nts", q, k)  # scale 1
  d = np.arange(t)[:, None] - np.arange(t)[None, :]
  visible = (d >= 0) & ((d < hp["window"]) if local else True)
  s = np.where(visible, s, -np.inf)
  s = np.exp(s - s.max(-1, keepdims=True))
  s = s / s.sum(-1, keepdims=True)
  o = np.einsum("nts,snh->tnh", s, v).reshape(t, nh * hd)
  return o @ w[p + "attn_output.weight"].T


def _experts(hp, w, p, x, gelu):
  """The expert branch of a layer (T, dim), each token through its top-k experts."""
  eps, k = hp["eps"], hp["experts_used"]
  router_in = _norm(x, None, eps) / math.sqrt(hp["dim"]) * w[p + "ffn_gate_inp.scale"]
  logits = router_in @ w[p + "ffn_gate_inp.weight"].T
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  y = _norm(x, w[p + "pre_ffw_norm_2.weight"], eps)
  gate_up, down = w[p + "ffn_gate_up_exps.weight"], w[p + "ffn_down_exps.weight"]
  scale = w.get(p + "ffn_down_exps.scale", np.ones(len(down)))
  half = gate_up.shape[1] // 2
  out = np.zeros_like(x)
  for t in range(len(x)):
    chosen = np.argsort(-probs[t], kind="stable")[:k]
    weights = probs[t, chosen] / probs[t, chosen].sum()
    for e, wt in zip(chosen, weights, strict=True):
      g, u = np.split(gate_up[e] @ y[t], [half])
      out[t] += wt * scale[e] * (down[e] @ (gelu(g) * u))
  return _norm(out, w[p + "post_ffw_norm_2.weight"], eps)


def forward(hp: dict, w: dict[str, np.ndarray], ids, gelu=gelu_tanh) -> np.ndarray:
  """Logits (T, vocab) float64 of token ids (T,); `gelu` every GELU of the graph (the FFN's and
  the per-layer branch's)."""
  ids = np.asarray(ids)
  dim, eps, pl = hp["dim"], hp["eps"], hp["per_layer"]
  x = w["token_embd.weight"][ids] * math.sqrt(dim)
  if pl:
    proj = (x @ w["per_layer_model_proj.weight"].T) / math.sqrt(dim)
    proj = _norm(proj.reshape(len(ids), hp["layers"], pl), w["per_layer_proj_norm.weight"], eps)
    looked_up = w["per_layer_token_embd.weight"][ids].reshape(proj.shape) * math.sqrt(pl)
    per_layer = (proj + looked_up) / math.sqrt(2.0)
  kv_of: dict[int, tuple] = {}
  for i in range(hp["layers"]):
    p = f"blk.{i}."
    h = _norm(x, w[p + "attn_norm.weight"], eps)
    o = _attention(hp, w, p, h, i, kv_of)
    x = x + _norm(o, w[p + "post_attention_norm.weight"], eps)
    h = _norm(x, w[p + "ffn_norm.weight"], eps)
    f = (gelu(h @ w[p + "ffn_gate.weight"].T) * (h @ w[p + "ffn_up.weight"].T)) @ w[
      p + "ffn_down.weight"
    ].T
    if hp["experts"]:
      f = _norm(f, w[p + "post_ffw_norm_1.weight"], eps) + _experts(hp, w, p, x, gelu)
    x = x + _norm(f, w[p + "post_ffw_norm.weight"], eps)
    if pl:
      g = gelu(x @ w[p + "inp_gate.weight"].T) * per_layer[:, i]
      x = x + _norm(g @ w[p + "proj.weight"].T, w[p + "post_norm.weight"], eps)
    if p + "layer_output_scale.weight" in w:
      x = x * w[p + "layer_output_scale.weight"]
  x = _norm(x, w["output_norm.weight"], eps)
  head = "output.weight" if "output.weight" in w else "token_embd.weight"
  logits = x @ w[head].T
  cap = hp["final_softcap"]
  return np.tanh(logits / cap) * cap if cap else logits
