// One new token's attention over one layer of the KV cache, on the CPU (q8rules' decoder,
// q8rules/models/attention.py, runs it through the native library's Q8DecodeAttention FFI
// target at T = 1; everywhere else XLA's softmax attention runs).
//
// q (B, H, D) float32 with RoPE applied; the layer's keys and values (B, S, KV, D), float32 or
// bfloat16 (the cache's dtype); row b attends positions [0, n[b]) (its new token's own,
// n[b] - 1, already written): one length for the batch, or one per row (a batch of sequences
// each at its own position, as `q8rules serve` decodes). Head h reads KV head h / (H / KV)
// (grouped-query attention). In float32, as the XLA path: scores = scale * q . k (then
// softcap * tanh(scores / softcap) when softcap > 0), p = exp(scores - max) / sum, out =
// sum_s p_s v_s. With sinks (H,) (gpt-oss's attn_sinks), head h's sink logit is one more term
// of its softmax, in the denominator only, as ggml's soft_max with sinks: max = max(scores,
// sink), sum += exp(sink - max), and no value row for it. Only the n written positions are read
// (XLA's path reads, masks and multiplies the whole cache length S, and copies the layer's
// keys and values into the layouts of its two dots first). Each (row, KV head) pair is one
// unit of work, shared by the caller and the library's helper threads (helper_threads.h); a
// unit's sums are the same whichever thread makes them.

#ifndef Q8RULES_DECODE_ATTENTION_H_
#define Q8RULES_DECODE_ATTENTION_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "helper_threads.h"
#include "isa.h"
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

// One unit of out (B, H, D): the heads of row b that share KV head g, for q (B, H, D) against
// keys k and values v (B, S, KV, D) of one layer, over positions [0, n) (1 <= n <= S); p holds
// group * n floats and top group floats of scratch. The H / KV query heads that share a KV head
// go together, so each key and value row is read once for its whole group (not once per head);
// each head's sums are the same, in the same order, as it alone would make. `sinks` (H,), or
// null: none. Compiled once per
// path (see DecodeAttention), each making the same multiplications and additions in the same
// order, only in wider vectors: the same bits on every path.
template <typename E>
Q8_ALWAYS_INLINE void AttendUnit(const float* q, const E* k, const E* v, float* out, int64_t b,
                                 int64_t g, int64_t length, int64_t kv_heads, int64_t heads,
                                 int64_t d, int64_t n, float scale, float softcap,
                                 const float* sinks, float* p, float* top) {
  const int64_t group = heads / kv_heads;
  const float* qg = q + (b * heads + g * group) * d;  // the group's heads, one after another
  const float* sg = sinks ? sinks + g * group : nullptr;  // the group's sink logits
  if (sg) {
    std::copy(sg, sg + group, top);
  } else {
    std::fill(top, top + group, -std::numeric_limits<float>::infinity());
  }
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
    float* pj = p + j * n;
    float sum = 0;
    for (int64_t s = 0; s < n; ++s) {
      pj[s] = std::exp(pj[s] - top[j]);
      sum += pj[s];
    }
    if (sg) sum += std::exp(sg[j] - top[j]);
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

// The operands of one call: row b attends positions [0, ns[b]).
template <typename E>
struct Operands {
  const float* q;
  const E* k;
  const E* v;
  float* out;
  int64_t length, kv_heads, heads, d;
  const int64_t* ns;
  float scale, softcap;
  const float* sinks;  // (H,), or null: no sinks
};

// Units [first, last) (unit u: row u / KV, KV head u % KV), with scratch p and top.
template <typename E>
Q8_ALWAYS_INLINE void AttendUnits(const Operands<E>& a, int64_t first, int64_t last, float* p,
                                  float* top) {
  for (int64_t u = first; u < last; ++u) {
    const int64_t b = u / a.kv_heads, g = u % a.kv_heads;
    AttendUnit(a.q, a.k, a.v, a.out, b, g, a.length, a.kv_heads, a.heads, a.d, a.ns[b], a.scale,
               a.softcap, a.sinks, p, top);
  }
}

// Contraction off: the SSE2 build has no FMA to contract into, so every path keeps the
// separate multiplications and additions (the same bits). On aarch64, where FMA is baseline and
// GCC contracts by default, both paths carry it.
#define Q8_NO_CONTRACT __attribute__((optimize("fp-contract=off")))

#if Q8_X86

template <typename E>
Q8_AVX2 Q8_NO_CONTRACT void AttendUnitsAvx2(const Operands<E>& a, int64_t first, int64_t last,
                                            float* p, float* top) {
  AttendUnits(a, first, last, p, top);
}

template <typename E>
Q8_AVX512 Q8_NO_CONTRACT void AttendUnitsAvx512(const Operands<E>& a, int64_t first,
                                                int64_t last, float* p, float* top) {
  AttendUnits(a, first, last, p, top);
}
#elif Q8_ARM
// The NEON path (Advanced SIMD is baseline: the compiler's vectors of the generic code) and
// the scalar one (the same code left unvectorized), both without contraction.
template <typename E>
Q8_NO_CONTRACT void AttendUnitsNeon(const Operands<E>& a, int64_t first, int64_t last,
                                    float* p, float* top) {
  AttendUnits(a, first, last, p, top);
}

template <typename E>
__attribute__((optimize("fp-contract=off", "no-tree-vectorize"))) void AttendUnitsScalar(
    const Operands<E>& a, int64_t first, int64_t last, float* p, float* top) {
  AttendUnits(a, first, last, p, top);
}
#endif

// Every unit of a call, claimed one at a time from one counter by the caller and its helpers
// (each with scratch of its own), on the path `isa` names.
template <typename E>
struct Work final : q8helpers::Task {
  Operands<E> a;
  int isa = 0;
  int64_t units = 0, most = 1;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() override {
    const int64_t group = a.heads / a.kv_heads;
    std::vector<float> p(static_cast<size_t>(group * most)), top(static_cast<size_t>(group));
    for (int64_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) {
#if Q8_X86
      if (isa >= 2) {
        AttendUnitsAvx512(a, u, u + 1, p.data(), top.data());
      } else if (isa == 1) {
        AttendUnitsAvx2(a, u, u + 1, p.data(), top.data());
      } else {
        AttendUnits(a, u, u + 1, p.data(), top.data());
      }
#elif Q8_ARM
      if (isa == q8isa::kNeon || isa == q8isa::kNeonDot) {
        AttendUnitsNeon(a, u, u + 1, p.data(), top.data());
      } else {
        AttendUnitsScalar(a, u, u + 1, p.data(), top.data());
      }
#else
      AttendUnits(a, u, u + 1, p.data(), top.data());
#endif
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Attention of a batch (`sinks` (H,) or null) on the path `isa` names (isa.h's codes: 0 scalar
// (SSE2 on x86-64), 1 AVX2, 2 AVX-512, 3 and 4 NEON; the caller picks it as for the products),
// on the caller and up to threads - 1 helpers.
template <typename E>
void DecodeAttention(int isa, const float* q, const E* k, const E* v, const float* sinks,
                     float* out, int64_t batch, int64_t length, int64_t kv_heads, int64_t heads,
                     int64_t d, const int64_t* ns, float scale, float softcap, int64_t threads) {
  auto* work = new Work<E>;  // reference counted: helpers that start late hold it
  work->a = {q, k, v, out, length, kv_heads, heads, d, ns, scale, softcap, sinks};
  work->isa = isa;
  work->units = batch * kv_heads;
  work->most = *std::max_element(ns, ns + batch);
  auto& helpers = q8helpers::Helpers::Get();
  const int want = static_cast<int>(std::min<int64_t>(threads, work->units) - 1);
  if (want > 0) helpers.Post(work, want);
  work->Run();
  q8helpers::WaitFor(work->done, work->units);
  if (want > 0) helpers.Retract(work);
  work->Release();
}

}  // namespace q8attn

#endif  // Q8RULES_DECODE_ATTENTION_H_
