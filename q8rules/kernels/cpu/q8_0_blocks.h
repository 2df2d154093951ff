// Float32 as Q8_0's 34-byte GGUF blocks (a float16 d, then 32 int8), exactly as
// gguf.quants.quantize(..., Q8_0) makes them (the rule of q8rules/q8_0.py), on every SIMD path:
// each path makes the same float32 operations, each correctly rounded, so the blocks are the
// same bytes on each. The requantizer (requant.h) and its repacking form (requant_repack.h)
// write their blocks here.
//
// Exactness: every product and sum is its own statement, compiled with no FP contraction (GCC's
// default for C++ fuses a * b + c into one FMA wherever FMA is enabled).

#ifndef Q8RULES_Q8_0_BLOCKS_H_
#define Q8RULES_Q8_0_BLOCKS_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "isa.h"
#include "q8_act_common.h"  // q8act::FloatToHalf: float32 -> float16 bits, as numpy rounds
#include "simd.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

namespace q8requant {

constexpr int64_t kQ8Block = 32;  // values of a Q8_0 block
constexpr int64_t kQ8Bytes = 34;  // its bytes: float16 d, then 32 int8

// roundf(v) (half away from zero) as int8, as gguf.quants' np_roundf then astype(int8), for
// |v| < 128 (all a Q8_0 block holds: |x| * (1 / d) <= 127 but for rounding): the truncation
// plus one where the dropped fraction is at least 0.5 (both exact). A NaN or infinite v (a
// block with a non-finite value, or so small that 1 / d overflows) gives 0, as numpy's cast
// does on x86.
inline int8_t RoundToInt8(float v) {
  const float a = std::fabs(v);
  if (!(a < 128.0f)) return 0;
  int t = static_cast<int>(a);
  t += a - static_cast<float>(t) >= 0.5f ? 1 : 0;
  return static_cast<int8_t>(v < 0.0f ? -t : t);
}

// The block's d from its largest magnitude (NaN when a value is NaN, as numpy's max gives),
// stored as float16 at out; returns 1 / d (0 for an all-zero block), float32 throughout.
inline float StoreScale(float amax, bool nan, uint8_t* out) {
  if (nan) amax = std::numeric_limits<float>::quiet_NaN();
  const float d = amax / 127.0f;
  const uint16_t h = q8act::FloatToHalf(d);
  std::memcpy(out, &h, sizeof h);
  return d == 0.0f ? 0.0f : 1.0f / d;
}

// 32 floats as one Q8_0 GGUF block (34 bytes at out), as gguf.quants' Q8_0 quantizer.
inline void QuantizeBlock(const float* x, uint8_t* out) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < kQ8Block; ++i) {
    const float a = std::fabs(x[i]);
    amax = a > amax ? a : amax;
    nan = nan || a != a;
  }
  const float id = StoreScale(amax, nan, out);
  for (int64_t i = 0; i < kQ8Block; ++i) {
    const float v = x[i] * id;
    out[2 + i] = static_cast<uint8_t>(RoundToInt8(v));
  }
}

#if Q8_X86
// QuantizeBlock on AVX-512, bit for bit: the same float32 operations, the rounding as in
// RoundToInt8 (vcvttps2dq truncates), 0 where |v| is not below 128.
Q8_AVX512F inline void QuantizeBlockAvx512(const float* x, uint8_t* out) {
  using F = q8simd::Avx512F;
  using q8simd::F32x16, q8simd::I32x16, q8simd::Mask16;
  const F32x16 half_lo = F::LoadU(x), half_hi = F::LoadU(x + 16);
  const Mask16 unordered = F::Unordered(half_lo, half_lo) | F::Unordered(half_hi, half_hi);
  const F32x16 mag = F::Max(F::Abs(half_lo), F::Abs(half_hi));
  const F32x16 id = F::Set1(StoreScale(F::ReduceMax(mag), unordered != 0, out));
  const F32x16 halves[2] = {half_lo, half_hi};
  for (int h = 0; h < 2; ++h) {
    const F32x16 v = F::Mul(halves[h], id);
    const F32x16 a = F::Abs(v);
    const Mask16 small = F::Less(a, F::Set1(128.0f));
    I32x16 t = F::TruncToInt32Where(small, a);
    const F32x16 dropped = F::Sub(a, F::ToFloat(t));
    const Mask16 up = F::GreaterEqualWhere(small, dropped, F::Set1(0.5f));
    t = F::AddInt32Where(up, t, F::Set1Int32(1));
    const Mask16 neg = F::Less(v, F::Zero());
    t = F::NegateInt32Where(neg, t);
    F::StoreInt8(out + 2 + 16 * h, t);
  }
}
#endif

// RoundToInt8 of each lane of v * id, as int32 lanes, on the int lanes S (simd.h's Avx2Int or
// NeonInt), bit for bit: the truncation plus one where the dropped fraction is at least 0.5,
// 0 where |v * id| is not below 128 (or is NaN), then the sign.
template <class S, class F>
Q8_INT_LANES Q8_ALWAYS_INLINE auto RoundLanesToInt8(F v, F id) {
  const F s = S::Mul(v, id);
  const F a = S::Abs(s);
  const auto small = S::Less(a, S::Set1(128.0f));
  auto r = S::KeepWhere(small, S::TruncToInt32(a));
  const F dropped = S::Sub(a, S::ToFloat(r));
  const auto up = S::And(small, S::GreaterEqual(dropped, S::Set1(0.5f)));
  r = S::SubInt32(r, S::MaskToInt32(up));  // + 1 where up (the mask is -1 there)
  return S::NegateInt32Where(S::Less(s, S::Zero()), r);
}

#if Q8_X86
// QuantizeBlock on AVX2, bit for bit: as the AVX-512 form, in four vectors of 8.
Q8_AVX2 inline void QuantizeBlockAvx2(const float* x, uint8_t* out) {
  using A = q8simd::Avx2Int;
  using q8simd::F32x8, q8simd::I32x8;
  F32x8 v[4];
  for (int j = 0; j < 4; ++j) v[j] = A::LoadU(x + 8 * j);
  F32x8 unordered = A::Unordered(v[0], v[0]);
  for (int j = 1; j < 4; ++j) unordered = A::Or(unordered, A::Unordered(v[j], v[j]));
  const F32x8 mag = A::Max(A::Max(A::Abs(v[0]), A::Abs(v[1])), A::Max(A::Abs(v[2]), A::Abs(v[3])));
  const F32x8 id = A::Set1(StoreScale(A::ReduceMax(mag), A::Any(unordered), out));
  I32x8 t[4];
  for (int j = 0; j < 4; ++j) t[j] = RoundLanesToInt8<A>(v[j], id);
  A::StoreInt8x32(out + 2, t[0], t[1], t[2], t[3]);
}
#endif

#if Q8_ARM
// QuantizeBlock on NEON, bit for bit: as the AVX2 form, in eight vectors of 4 (fcvtzs
// truncates; the int8 stores keep each value's low byte, as the scalar cast does).
inline void QuantizeBlockNeon(const float* x, uint8_t* out) {
  using N = q8simd::NeonInt;
  using q8simd::F32x4, q8simd::I32x4, q8simd::Mask4;
  F32x4 v[8];
  for (int j = 0; j < 8; ++j) v[j] = N::LoadU(x + 4 * j);
  Mask4 unordered = N::IsNan(v[0]);
  for (int j = 1; j < 8; ++j) unordered = N::Or(unordered, N::IsNan(v[j]));
  // fmaxnm skips NaN lanes, as the scalar comparison does (a NaN block's d is NaN either way)
  F32x4 mag = N::Abs(v[0]);
  for (int j = 1; j < 8; ++j) mag = N::MaxNum(mag, N::Abs(v[j]));
  const float amax = std::fmax(0.0f, N::ReduceMaxNum(mag));
  const F32x4 id = N::Set1(StoreScale(amax, N::Any(unordered), out));
  I32x4 t[8];
  for (int j = 0; j < 8; ++j) t[j] = RoundLanesToInt8<N>(v[j], id);
  N::StoreInt8x16(out + 2, t[0], t[1], t[2], t[3]);
  N::StoreInt8x16(out + 18, t[4], t[5], t[6], t[7]);
}
#endif

// n floats (a multiple of 32) as n / 32 Q8_0 blocks at out, on the quantizer of `isa` (isa.h):
// AVX-512's, AVX2's, NEON's (both NEON rungs), else the scalar one (the same bytes).
inline void QuantizeRun(const float* x, int64_t n, uint8_t* out, q8isa::Isa isa) {
  for (int64_t b = 0; b < n / kQ8Block; ++b) {
    const float* xb = x + b * kQ8Block;
    uint8_t* ob = out + b * kQ8Bytes;
    switch (isa) {
#if Q8_X86
      case q8isa::kAvx512: QuantizeBlockAvx512(xb, ob); continue;
      case q8isa::kAvx2: QuantizeBlockAvx2(xb, ob); continue;
#elif Q8_ARM
      case q8isa::kNeonDot:
      case q8isa::kNeon: QuantizeBlockNeon(xb, ob); continue;
#endif
      default: QuantizeBlock(xb, ob);
    }
  }
}

}  // namespace q8requant

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

#endif  // Q8RULES_Q8_0_BLOCKS_H_
