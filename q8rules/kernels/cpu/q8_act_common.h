// The Q8_0 x Q8_0 product's shared ground (q8_act_int8.h dispatches it): the activations'
// Q8_0 as gguf.quants makes it, the operands of one share of a product, the order y's columns
// are kept in while the int8 paths run, and the scalar path every SIMD path is held to. The
// SIMD paths (q8_act_vnni.h, q8_act_avx2.h, q8_act_neon.h) compute the same integers and the
// same float32 folds, in the same order, so y is the same bits on every path.

#ifndef Q8RULES_Q8_ACT_COMMON_H_
#define Q8RULES_Q8_ACT_COMMON_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace q8act {

constexpr int64_t kBlock = 32;
constexpr int64_t kStretch = 64;  // columns of one interleaved stretch (a cache line of q)
// Bytes ahead in each q row that the interleave prefetches (into L1). 0 took 1.1-1.4x the time
// at M = 1 and 8 (K = N = 4096, one thread); 192, 256 and an L2 hint were within the noise.
constexpr int64_t kPrefetchAhead = 128;
// Bytes ahead in q's memory order that one x row's stream (StreamInt8Row) also prefetches into
// L2. A stream reads q in its memory order, so this is about 1 us of DRAM reads ahead; without
// it the core's loads and the hardware prefetcher alone kept too few lines in flight: the
// 576-wide products of SmolLM-135M read 6-7 GB/s from DRAM on one thread against 15.5 for a
// plain read of the same bytes. 16 KiB (L2 hint) took 0.6-0.67x the time at 576 x 576,
// 576 x 960 and 1536 x 576, 0.9x at 576 x 3072, the same at 4096 x 4096 and 576 x 49152 (8-32
// KiB were close); an L1 hint at 16 KiB 0.8x (one thread, 15 interleaved rounds). SmolLM's
// 121 products of a decode step: 14.5-16.6 -> 11.2-11.6 ms on one thread.
constexpr int64_t kStreamAheadL2 = 16384;
constexpr int32_t kOffset = 128;  // added to the weight's values for vpdpbusd's unsigned side

// The column of y's storage that holds column `col` while the product runs: within each
// 64-column stretch below n64, column 16 L + 4 i + t is stored at 16 i + 4 L + t (the order
// vpunpck leaves four interleaved rows in, and each path writes). An involution: applying it twice is the identity.
inline int64_t StoredColumn(int64_t col, int64_t n64) {
  if (col >= n64) return col;
  const int64_t c = col & ~(kStretch - 1), j = col & (kStretch - 1);
  const int64_t lane = j / 16, group = (j % 16) / 4, t = j % 4;
  return c + 16 * group + 4 * lane + t;
}

// float -> IEEE half, round to nearest even (as numpy's astype(float16) and F16C).
inline uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (abs < 0x38800000u) {  // a half subnormal (or zero): round abs * 2^24 to an integer
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);  // below half the smallest
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(abs >> 23);  // 14..24
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = ((abs >> 13) - (112u << 10));
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

inline float HalfBitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// C roundf (half away from zero) exactly, as gguf.quants' np_roundf: floor(a) + floor(2 frac).
inline float RoundHalfAway(float v) {
  const float a = std::fabs(v), fl = std::floor(a);
  return std::copysign(fl + std::floor(2.0f * (a - fl)), v);
}

// Block b of row r as Q8_0: 32 int8 values into qb, the float16 d widened, and -128 * the
// values' sum (the VNNI sums' starting point) into *dx and *xc. IEEE float32 throughout.
inline void QuantizeBlockScalar(const float* xb, int8_t* qb, float* dx, int32_t* xc) {
  float amax = 0.0f;
  for (int64_t i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
  const float d = amax / 127.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  int32_t sum = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    float v = RoundHalfAway(xb[i] * id);
    v = std::fmin(127.0f, std::fmax(-127.0f, v));  // |x * id| <= 127 but for rounding
    qb[i] = static_cast<int8_t>(v);
    sum += qb[i];
  }
  *dx = HalfBitsToFloat(FloatToHalf(d));
  *xc = -kOffset * sum;
}


// The operands of one share of a product (a run of blocks), all row-major.
struct Int8Operands {
  const int8_t* xq;    // (m, k) activation values, row stride ldxq
  const float* dx;     // (m, k / 32) activation scales, row stride lddx
  const int32_t* xc;   // (m, k / 32) -128 * each block's sum of xq, row stride lddx
  const int8_t* q;     // (k, n)
  const void* scale;   // (k / 32, n) float32 or float16
  bool scale_f16;
  float* y;            // (m, n), stretch-permuted below n64 (StoredColumn), accumulated into
  int64_t m, k, n, ldxq, lddx;
};

inline float WeightScale(const Int8Operands& p, int64_t b, int64_t col) {
  const int64_t i = b * p.n + col;
  if (p.scale_f16) return HalfBitsToFloat(static_cast<const uint16_t*>(p.scale)[i]);
  return static_cast<const float*>(p.scale)[i];
}

// Columns [c0, c1) of every x row, scalar: the same integers and folds as the VNNI path.
inline void ColumnsInt8Scalar(const Int8Operands& p, int64_t c0, int64_t c1) {
  const int64_t n64 = p.n & ~(kStretch - 1);
  for (int64_t b = 0; b < p.k / kBlock; ++b) {
    for (int64_t c = c0; c < c1; ++c) {
      const float dw = WeightScale(p, b, c);
      for (int64_t r = 0; r < p.m; ++r) {
        const int8_t* xb = p.xq + r * p.ldxq + b * kBlock;
        int32_t acc = p.xc[r * p.lddx + b];
        for (int64_t i = 0; i < kBlock; ++i)
          acc += static_cast<int32_t>(xb[i]) * (p.q[(b * kBlock + i) * p.n + c] + kOffset);
        float* yc = p.y + r * p.n + StoredColumn(c, n64);
        *yc = std::fma(p.dx[r * p.lddx + b] * dw, static_cast<float>(acc), *yc);
      }
    }
  }
}

// y's stretches back in column order (rows [0, m) of y (m, n)).
inline void UnpermuteColumns(float* y, int64_t m, int64_t n) {
  const int64_t n64 = n & ~(kStretch - 1);
  float tmp[kStretch];
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n64; c += kStretch) {
      float* yc = y + r * n + c;
      std::memcpy(tmp, yc, sizeof tmp);
      for (int64_t j = 0; j < kStretch; ++j) yc[j] = tmp[StoredColumn(j, kStretch)];
    }
  }
}
}  // namespace q8act

#endif  // Q8RULES_Q8_ACT_COMMON_H_
