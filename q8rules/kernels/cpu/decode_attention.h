// One new token's attention over one layer of the KV cache, on the CPU (q8rules' decoder,
// q8rules/models/attention.py, runs it through the native library's Q8DecodeAttention FFI
// target at T = 1; everywhere else XLA's softmax attention runs).
//
// q (B, H, D) float32 with RoPE applied; the layer's keys and values (B, S, KV, D), float32 or
// bfloat16 (the cache's dtype); positions [0, n) attended (the new token's own, n - 1, already
// written). Head h reads KV head h / (H / KV) (grouped-query attention). In float32, as the
// XLA path: scores = scale * q . k (then softcap * tanh(scores / softcap) when softcap > 0),
// p = exp(scores - max) / sum, out = sum_s p_s v_s. Only the n written positions are read
// (XLA's path reads, masks and multiplies the whole cache length S, and copies the layer's
// keys and values into the layouts of its two dots first).

#ifndef Q8RULES_DECODE_ATTENTION_H_
#define Q8RULES_DECODE_ATTENTION_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace q8attn {

inline float Widen(float v) { return v; }

inline float Widen(uint16_t bf16) {  // bfloat16 bits -> float32, exactly
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// a (float32) . b (E), d values: 8 interleaved partial sums (vectorized by the compiler), then
// added pairwise, then the last d % 8 products.
template <typename E>
inline float Dot(const float* a, const E* b, int64_t d) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) {
    for (int j = 0; j < 8; ++j) s[j] += a[i + j] * Widen(b[i + j]);
  }
  float t = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
  for (; i < d; ++i) t += a[i] * Widen(b[i]);
  return t;
}

// out (B, H, D) for q (B, H, D) against keys k and values v (B, S, KV, D) of one layer, over
// positions [0, n) (1 <= n <= S).
template <typename E>
void DecodeAttention(const float* q, const E* k, const E* v, float* out, int64_t batch,
                     int64_t length, int64_t kv_heads, int64_t heads, int64_t d, int64_t n,
                     float scale, float softcap) {
  const int64_t group = heads / kv_heads;
  std::vector<float> p(static_cast<size_t>(n));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = q + (b * heads + h) * d;
      const int64_t g = h / group;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < n; ++s) {
        float score = Dot(qh, k + ((b * length + s) * kv_heads + g) * d, d) * scale;
        if (softcap > 0) score = std::tanh(score / softcap) * softcap;
        p[s] = score;
        top = std::max(top, score);
      }
      float sum = 0;
      for (int64_t s = 0; s < n; ++s) {
        p[s] = std::exp(p[s] - top);
        sum += p[s];
      }
      float* o = out + (b * heads + h) * d;
      std::fill(o, o + d, 0.0f);
      for (int64_t s = 0; s < n; ++s) {
        const float w = p[s] / sum;
        const E* vs = v + ((b * length + s) * kv_heads + g) * d;
        for (int64_t i = 0; i < d; ++i) o[i] += w * Widen(vs[i]);
      }
    }
  }
}

}  // namespace q8attn

#endif  // Q8RULES_DECODE_ATTENTION_H_
