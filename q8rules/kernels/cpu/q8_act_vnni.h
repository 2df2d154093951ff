// The Q8_0 x Q8_0 product on AVX-512 VNNI (q8_act_int8.h dispatches it; q8_act_common.h holds
// the operands, the stored column order and the scalar path it matches bit for bit).
//
// vpdpbusd multiplies unsigned bytes by signed bytes, four to a 32-bit lane: it takes the
// weight's values offset by 128 (q ^ 0x80, 0..255) as the unsigned side and the activations as
// the signed one, and starts each block's sums at -128 * the sum of the block's activations
// (computed when they are quantized), so every block dot is exact. q is (K, N) row-major: each
// 64-column stretch of a block's 32 rows is interleaved in registers (four rows' bytes to a
// lane) straight from the loads, for each register tile of up to 4 x rows; one x row streams 8
// rows at a time across all columns instead (StreamInt8Row). The interleave leaves a stretch's
// columns in the order `StoredColumn` gives.

#ifndef Q8RULES_Q8_ACT_VNNI_H_
#define Q8RULES_Q8_ACT_VNNI_H_

#include <cstdint>
#include <cstring>
#include <vector>

#include "q8_act_common.h"
#include "simd.h"

#if Q8_X86
namespace q8act {
namespace vnni {

using q8simd::F32x16;
using q8simd::I32x16;
using q8simd::Mask16;
using F = q8simd::Avx512F;
using Vnni = q8simd::Avx512Vnni;

// QuantizeBlockScalar on AVX-512, bit for bit: the same float32 operations, each correctly
// rounded (vdivps, not a reciprocal estimate; floor by vrndscaleps).
Q8_VNNI inline void QuantizeBlock(const float* xb, int8_t* qb, float* dx, int32_t* xc) {
  const F32x16 lo = F::LoadU(xb), hi = F::LoadU(xb + 16);
  const float amax = F::ReduceMax(F::Max(F::Abs(lo), F::Abs(hi)));
  const float d = amax / 127.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  const F32x16 idv = F::Set1(id), limit = F::Set1(127.0f);
  I32x16 q[2];
  const F32x16 halves[2] = {lo, hi};
  for (int h = 0; h < 2; ++h) {
    const F32x16 v = F::Mul(halves[h], idv);
    const F32x16 a = F::Abs(v);
    const F32x16 fl = F::Floor(a);
    const F32x16 twice = F::Add(F::Sub(a, fl), F::Sub(a, fl));
    F32x16 r = F::Add(fl, F::Floor(twice));
    // the sign back (a -0 becomes 0 as an integer either way), then the scalar path's clamp
    // fmin(127, fmax(-127, r)) in its order: vmaxps gives its second operand when the first is
    // NaN (1 / d overflowed), as fmax gives -127
    const Mask16 neg = F::Less(v, F::Zero());
    r = F::NegateWhere(neg, r);
    q[h] = F::TruncToInt32(F::Min(F::Max(r, F::Set1(-127.0f)), limit));
  }
  F::StoreInt8(qb, q[0]);
  F::StoreInt8(qb + 16, q[1]);
  *dx = Vnni::RoundToHalf(d);
  *xc = -kOffset * F::ReduceAddInt32(F::AddInt32(q[0], q[1]));
}

// 16 weight scales of block b from column col, as float32.
Q8_VNNI inline F32x16 WeightScale16(const Int8Operands& p, int64_t b, int64_t col) {
  const int64_t i = b * p.n + col;
  if (p.scale_f16) return F::LoadHalves(static_cast<const uint16_t*>(p.scale) + i);
  return F::LoadU(static_cast<const float*>(p.scale) + i);
}

// Rows 4t..4t+3 of block b's stretch at column c, interleaved: g[i] holds the 16 columns of
// group i (StoredColumn's order), four rows' values + 128 (q ^ 0x80) to a 32-bit lane.
// kStream: the caller reads q in its memory order (StreamInt8Row), which also prefetches
// kStreamAheadL2 bytes ahead into L2.
template <bool kStream = false>
Q8_VNNI inline void InterleaveQuad(const Int8Operands& p, int64_t b, int64_t c, int t,
                                   I32x16* g) {
  const int8_t* row = p.q + (b * kBlock + 4 * t) * p.n + c;
  const I32x16 flip = F::Set1Int8(static_cast<int8_t>(0x80));
  I32x16 r[4];
  for (int i = 0; i < 4; ++i) {
    if (kStream) q8simd::PrefetchL2(row + i * p.n + kStreamAheadL2);
    q8simd::PrefetchL1(row + i * p.n + kPrefetchAhead);
    r[i] = F::Xor(F::LoadBytes(row + i * p.n), flip);
  }
  const I32x16 lo01 = Vnni::UnpackLo<8>(r[0], r[1]), hi01 = Vnni::UnpackHi<8>(r[0], r[1]);
  const I32x16 lo23 = Vnni::UnpackLo<8>(r[2], r[3]), hi23 = Vnni::UnpackHi<8>(r[2], r[3]);
  g[0] = Vnni::UnpackLo<16>(lo01, lo23);
  g[1] = Vnni::UnpackHi<16>(lo01, lo23);
  g[2] = Vnni::UnpackLo<16>(hi01, hi23);
  g[3] = Vnni::UnpackHi<16>(hi01, hi23);
}

// The weight scales of block b's stretch at c in StoredColumn's order: ds[g] lane 4 L + t is
// column c + 16 L + 4 g + t (the 4 x 4 lanes of 4 columns of the 4 natural vectors, transposed).
Q8_VNNI inline void StretchScales(const Int8Operands& p, int64_t b, int64_t c, F32x16* ds) {
  const F32x16 s0 = WeightScale16(p, b, c), s1 = WeightScale16(p, b, c + 16);
  const F32x16 s2 = WeightScale16(p, b, c + 32), s3 = WeightScale16(p, b, c + 48);
  const F32x16 a = F::Shuffle128<0x44>(s0, s1), bb = F::Shuffle128<0xee>(s0, s1);
  const F32x16 cc = F::Shuffle128<0x44>(s2, s3), d = F::Shuffle128<0xee>(s2, s3);
  ds[0] = F::Shuffle128<0x88>(a, cc);
  ds[1] = F::Shuffle128<0xdd>(a, cc);
  ds[2] = F::Shuffle128<0x88>(bb, d);
  ds[3] = F::Shuffle128<0xdd>(bb, d);
}

// y rows r0..r0+MR-1 at the stretch c += (dx * dw) * acc, ds[g]: group g's weight scales.
template <int MR>
Q8_VNNI inline void FoldInt8(const Int8Operands& p, int64_t b, int64_t c, int64_t r0,
                             const I32x16 (&acc)[MR][4], const F32x16* ds) {
  for (int r = 0; r < MR; ++r) {
    const F32x16 dxr = F::Set1(p.dx[(r0 + r) * p.lddx + b]);
    float* yr = p.y + (r0 + r) * p.n + c;
    for (int g = 0; g < 4; ++g) {
      const F32x16 scale = F::Mul(dxr, ds[g]);
      F::StoreU(yr + 16 * g, F::Fma(scale, F::ToFloat(acc[r][g]), F::LoadU(yr + 16 * g)));
    }
  }
}

template <int MR>
Q8_VNNI inline void StartSums(const Int8Operands& p, int64_t b, int64_t r0,
                              I32x16 (&acc)[MR][4]) {
  for (int r = 0; r < MR; ++r) {
    const I32x16 start = F::Set1Int32(p.xc[(r0 + r) * p.lddx + b]);
    for (int g = 0; g < 4; ++g) acc[r][g] = start;
  }
}

template <int MR>
Q8_VNNI inline void DotQuad(const Int8Operands& p, int64_t b, int64_t r0, int t, const I32x16* g,
                            I32x16 (&acc)[MR][4]) {
  const int8_t* xb = p.xq + r0 * p.ldxq + b * kBlock + 4 * t;
  for (int r = 0; r < MR; ++r) {
    int32_t quad;
    std::memcpy(&quad, xb + r * p.ldxq, sizeof quad);
    const I32x16 xv = F::Set1Int32(quad);
    for (int i = 0; i < 4; ++i) acc[r][i] = Vnni::DotBytes(acc[r][i], g[i], xv);
  }
}

// MR (<= 4) x rows from r0 against block b's stretch at c, interleaved straight from the loads.
template <int MR>
Q8_VNNI inline void TileInt8(const Int8Operands& p, int64_t b, int64_t c, int64_t r0,
                                   const F32x16* ds) {
  I32x16 acc[MR][4];
  StartSums<MR>(p, b, r0, acc);
  for (int t = 0; t < kBlock / 4; ++t) {
    I32x16 g[4];
    InterleaveQuad(p, b, c, t, g);
    DotQuad<MR>(p, b, r0, t, g, acc);
  }
  FoldInt8<MR>(p, b, c, r0, acc, ds);
}

Q8_VNNI inline void TileInt8Rows(int64_t mr, const Int8Operands& p, int64_t b, int64_t c,
                                       int64_t r0, const F32x16* ds) {
  switch (mr) {
    case 1: return TileInt8<1>(p, b, c, r0, ds);
    case 2: return TileInt8<2>(p, b, c, r0, ds);
    case 3: return TileInt8<3>(p, b, c, r0, ds);
    default: return TileInt8<4>(p, b, c, r0, ds);
  }
}

// One x row against the stretches of block b, reading q kStreamQuads * 4 rows at a time across
// all n64 columns (long sequential streams) with the block's int32 sums in sums (n64 values,
// StoredColumn's order) between passes. The same integers and folds as TileInt8<1>. At
// K = N = 4096 from DRAM (one thread) it took 0.5-0.6x the time of the 1 x 64 tiles' 32 short
// streams; 4 rows at a time took 0.75x, 16 rows 0.65-0.85x.
constexpr int kStreamQuads = 2;

Q8_VNNI inline void StreamInt8Row(const Int8Operands& p, int64_t b, int64_t n64, int32_t* sums) {
  const int8_t* xb = p.xq + b * kBlock;
  const I32x16 start = F::Set1Int32(p.xc[b]);
  for (int t0 = 0; t0 < kBlock / 4; t0 += kStreamQuads) {
    I32x16 xv[kStreamQuads];
    for (int u = 0; u < kStreamQuads; ++u) {
      int32_t quad;
      std::memcpy(&quad, xb + 4 * (t0 + u), sizeof quad);
      xv[u] = F::Set1Int32(quad);
    }
    const bool first = t0 == 0, last = t0 + kStreamQuads == kBlock / 4;
    for (int64_t c = 0; c < n64; c += kStretch) {
      I32x16 acc[4];
      for (int g = 0; g < 4; ++g) acc[g] = first ? start : F::LoadBytes(sums + c + 16 * g);
      for (int u = 0; u < kStreamQuads; ++u) {
        I32x16 w[4];
        InterleaveQuad<true>(p, b, c, t0 + u, w);
        for (int g = 0; g < 4; ++g) acc[g] = Vnni::DotBytes(acc[g], w[g], xv[u]);
      }
      if (!last) {
        for (int g = 0; g < 4; ++g) F::StoreBytes(sums + c + 16 * g, acc[g]);
        continue;
      }
      F32x16 ds[4];
      StretchScales(p, b, c, ds);
      const F32x16 dxr = F::Set1(p.dx[b]);
      for (int g = 0; g < 4; ++g) {
        float* yc = p.y + c + 16 * g;
        F::StoreU(yc, F::Fma(F::Mul(dxr, ds[g]), F::ToFloat(acc[g]), F::LoadU(yc)));
      }
    }
  }
}

// x rows per register tile (4 x 4 accumulators). Each tile interleaves the stretch again from
// the loads (L1 after the first): at M = 8, 16 that took 0.65-0.85x the time of interleaving it
// once into an L1 buffer that 6-row tiles read (K x N = 4096 x 4096, 2048 x 5632, one thread).
constexpr int64_t kTileRows = 4;

// Every x row against every column: the stretches on VNNI, the last n % 64 columns scalar.
Q8_VNNI inline void Columns(const Int8Operands& p) {
  const int64_t n64 = p.n & ~(kStretch - 1);
  if (p.m == 1 && n64 > 0) {
    std::vector<int32_t> sums(static_cast<size_t>(n64));
    for (int64_t b = 0; b < p.k / kBlock; ++b) StreamInt8Row(p, b, n64, sums.data());
    if (n64 < p.n) ColumnsInt8Scalar(p, n64, p.n);
    return;
  }
  for (int64_t b = 0; b < p.k / kBlock; ++b) {
    for (int64_t c = 0; c < n64; c += kStretch) {
      F32x16 ds[4];
      StretchScales(p, b, c, ds);
      for (int64_t r = 0; r < p.m; r += kTileRows)
        TileInt8Rows(p.m - r < kTileRows ? p.m - r : kTileRows, p, b, c, r, ds);
    }
  }
  if (n64 < p.n) ColumnsInt8Scalar(p, n64, p.n);
}

// Whether this CPU has the path (AVX-512 F, BW and VNNI, with F16C).
inline bool Has() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
  }();
  return has;
}

}  // namespace vnni
}  // namespace q8act
#endif  // Q8_X86

#endif  // Q8RULES_Q8_ACT_VNNI_H_
