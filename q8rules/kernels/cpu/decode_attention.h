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

#include "simd.h"

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
// positions [0, n) (1 <= n <= S). The H / KV query heads that share a KV head go together, so
// each key and value row is read once for its whole group (not once per head); each head's
// sums are the same, in the same order, as it alone would make. Compiled once per path (see
// DecodeAttention), each making the same multiplications and additions in the same order,
// only in wider vectors: the same bits on every path.
template <typename E>
Q8_ALWAYS_INLINE void Attend(const float* q, const E* k, const E* v, float* out, int64_t batch,
                             int64_t length, int64_t kv_heads, int64_t heads, int64_t d,
                             int64_t n, float scale, float softcap) {
  const int64_t group = heads / kv_heads;
  std::vector<float> p(static_cast<size_t>(group * n));  // head j's weights at p[j * n]
  std::vector<float> top(static_cast<size_t>(group));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t g = 0; g < kv_heads; ++g) {
      const float* qg = q + (b * heads + g * group) * d;  // the group's heads, one after another
      std::fill(top.begin(), top.end(), -std::numeric_limits<float>::infinity());
      for (int64_t s = 0; s < n; ++s) {
        const E* ks = k + ((b * length + s) * kv_heads + g) * d;
        for (int64_t j = 0; j < group; ++j) {
          float score = Dot(qg + j * d, ks, d) * scale;
          if (softcap > 0) score = std::tanh(score / softcap) * softcap;
          p[j * n + s] = score;
          top[j] = std::max(top[j], score);
        }
      }
      float* og = out + (b * heads + g * group) * d;
      std::fill(og, og + group * d, 0.0f);
      for (int64_t j = 0; j < group; ++j) {
        float* pj = p.data() + j * n;
        float sum = 0;
        for (int64_t s = 0; s < n; ++s) {
          pj[s] = std::exp(pj[s] - top[j]);
          sum += pj[s];
        }
        for (int64_t s = 0; s < n; ++s) pj[s] /= sum;
      }
      for (int64_t s = 0; s < n; ++s) {
        const E* vs = v + ((b * length + s) * kv_heads + g) * d;
        for (int64_t j = 0; j < group; ++j) {
          const float w = p[j * n + s];
          float* o = og + j * d;
          for (int64_t i = 0; i < d; ++i) o[i] += w * Widen(vs[i]);
        }
      }
    }
  }
}

#if Q8_X86
// Contraction off: the SSE2 build has no FMA to contract into, so every path keeps the
// separate multiplications and additions (the same bits).
#define Q8_NO_CONTRACT __attribute__((optimize("fp-contract=off")))

template <typename E>
Q8_AVX2 Q8_NO_CONTRACT void AttendAvx2(const float* q, const E* k, const E* v, float* out,
                                       int64_t batch, int64_t length, int64_t kv_heads,
                                       int64_t heads, int64_t d, int64_t n, float scale,
                                       float softcap) {
  Attend(q, k, v, out, batch, length, kv_heads, heads, d, n, scale, softcap);
}

template <typename E>
Q8_AVX512 Q8_NO_CONTRACT void AttendAvx512(const float* q, const E* k, const E* v, float* out,
                                           int64_t batch, int64_t length, int64_t kv_heads,
                                           int64_t heads, int64_t d, int64_t n, float scale,
                                           float softcap) {
  Attend(q, k, v, out, batch, length, kv_heads, heads, d, n, scale, softcap);
}
#endif

// Attend on the path `isa` names (0 scalar / SSE2, 1 AVX2, 2 AVX-512: q8mm::Isa, which the
// caller picks as for the products).
template <typename E>
void DecodeAttention(int isa, const float* q, const E* k, const E* v, float* out, int64_t batch,
                     int64_t length, int64_t kv_heads, int64_t heads, int64_t d, int64_t n,
                     float scale, float softcap) {
#if Q8_X86
  if (isa >= 2)
    return AttendAvx512(q, k, v, out, batch, length, kv_heads, heads, d, n, scale, softcap);
  if (isa == 1)
    return AttendAvx2(q, k, v, out, batch, length, kv_heads, heads, d, n, scale, softcap);
#endif
  Attend(q, k, v, out, batch, length, kv_heads, heads, d, n, scale, softcap);
}

}  // namespace q8attn

#endif  // Q8RULES_DECODE_ATTENTION_H_
