// The Q8_0 x Q8_0 product on AVX2 (q8_act_int8.h dispatches it: AVX2 CPUs, and AVX-512 ones
// without VNNI; q8_act_common.h holds the operands, the stored column order and the scalar path
// it matches bit for bit).
//
// AVX2 has no byte dot into int32 but vpmaddubsw (unsigned bytes times signed bytes, pairs
// summed into int16, saturating) and vpmaddwd (int16 pairs into int32), as llama.cpp's AVX2 dots
// use them: |w| as the unsigned side and x with w's sign (vpsignb) as the signed one, so no pair
// sum leaves int16 (|w| <= 128, |x| <= 127) and every block dot is exact for any int8 weight.
// The sums start at 0 (no offset, unlike VNNI's).
//
// q is (K, N) row-major. A 64-column stretch is two 32-column halves, each interleaved (four
// rows' bytes to a 32-bit lane: vpunpckl/h within each 128-bit lane) once a block into an L1
// buffer that register tiles of up to 4 x rows read. Half h's group i vector holds, in its
// 128-bit lane l, columns 32 h + 16 l + 4 i + t (t < 4), which StoredColumn keeps at
// 16 i + 8 h + 4 l + t: one 8-float store at 16 i + 8 h of the stretch. One x row streams 8
// rows at a time across all columns instead, interleaving from the loads, as the VNNI path
// does.

#ifndef Q8RULES_Q8_ACT_AVX2_H_
#define Q8RULES_Q8_ACT_AVX2_H_

#include <cstdint>
#include <cstring>
#include <vector>

#include "q8_act_common.h"
#include "simd.h"

#if Q8_X86
namespace q8act {
namespace avx2 {

using q8simd::F32x8;
using q8simd::I32x8;
using A = q8simd::Avx2Int;

// QuantizeBlockScalar on AVX2, bit for bit: the same float32 operations, each correctly rounded
// (a true division, floor by vroundps), the clamp and the sign as there.
Q8_AVX2 inline void QuantizeBlock(const float* xb, int8_t* qb, float* dx, int32_t* xc) {
  F32x8 v[4];
  for (int j = 0; j < 4; ++j) v[j] = A::LoadU(xb + 8 * j);
  const F32x8 mag = A::Max(A::Max(A::Abs(v[0]), A::Abs(v[1])), A::Max(A::Abs(v[2]), A::Abs(v[3])));
  const float amax = A::ReduceMax(mag);
  const float d = amax / 127.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  const F32x8 idv = A::Set1(id), limit = A::Set1(127.0f);
  I32x8 q[4];
  for (int j = 0; j < 4; ++j) {
    const F32x8 s = A::Mul(v[j], idv);
    const F32x8 a = A::Abs(s);
    const F32x8 fl = A::Floor(a);
    const F32x8 twice = A::Add(A::Sub(a, fl), A::Sub(a, fl));
    // the sign back, then the scalar path's clamp fmin(127, fmax(-127, r)) in its order: vmaxps
    // gives its second operand when the first is NaN (1 / d overflowed), as fmax gives -127
    const F32x8 r = A::NegateWhere(A::Less(s, A::Zero()), A::Add(fl, A::Floor(twice)));
    q[j] = A::TruncToInt32(A::Min(A::Max(r, A::Set1(-127.0f)), limit));
  }
  A::StoreInt8x32(qb, q[0], q[1], q[2], q[3]);
  *dx = A::RoundToHalf(d);
  const I32x8 sum = A::AddInt32(A::AddInt32(q[0], q[1]), A::AddInt32(q[2], q[3]));
  *xc = -kOffset * A::ReduceAddInt32(sum);
}

// Rows 4t..4t+3 of block b at columns [c, c + 32), interleaved (g[i]: group i as the header
// says) with each byte's magnitude beside it (ga[i]). kStream: the caller reads q in its memory
// order (StreamRow), which also prefetches kStreamAheadL2 bytes ahead into L2; kPrefetch: this
// half starts a cache line, whose next lines it prefetches.
template <bool kStream, bool kPrefetch>
Q8_AVX2 Q8_ALWAYS_INLINE void InterleaveQuad(const Int8Operands& p, int64_t b, int64_t c, int t,
                                             I32x8* g, I32x8* ga) {
  const int8_t* row = p.q + (b * kBlock + 4 * t) * p.n + c;
  I32x8 r[4];
  for (int i = 0; i < 4; ++i) {
    if (kPrefetch) {
      if (kStream) q8simd::PrefetchL2(row + i * p.n + kStreamAheadL2);
      q8simd::PrefetchL1(row + i * p.n + kPrefetchAhead);
    }
    r[i] = A::LoadBytes(row + i * p.n);
  }
  const I32x8 lo01 = A::UnpackLo<8>(r[0], r[1]), hi01 = A::UnpackHi<8>(r[0], r[1]);
  const I32x8 lo23 = A::UnpackLo<8>(r[2], r[3]), hi23 = A::UnpackHi<8>(r[2], r[3]);
  g[0] = A::UnpackLo<16>(lo01, lo23);
  g[1] = A::UnpackHi<16>(lo01, lo23);
  g[2] = A::UnpackLo<16>(hi01, hi23);
  g[3] = A::UnpackHi<16>(hi01, hi23);
  for (int i = 0; i < 4; ++i) ga[i] = A::AbsInt8(g[i]);
}

// 8 weight scales of block b from column col, as float32.
Q8_AVX2 Q8_ALWAYS_INLINE F32x8 WeightScale8(const Int8Operands& p, int64_t b, int64_t col) {
  const int64_t i = b * p.n + col;
  if (p.scale_f16) return A::LoadHalves(static_cast<const uint16_t*>(p.scale) + i);
  return A::LoadU(static_cast<const float*>(p.scale) + i);
}

// The weight scales of block b's half h of the stretch at c, in its groups' order: ds[i] lanes
// 0-3 are columns c + 32 h + 4 i + t, lanes 4-7 columns c + 32 h + 16 + 4 i + t.
Q8_AVX2 Q8_ALWAYS_INLINE void HalfScales(const Int8Operands& p, int64_t b, int64_t c, int h,
                                         F32x8* ds) {
  F32x8 nat[4];  // columns c + 32 h + 8 v .. + 7
  for (int v = 0; v < 4; ++v) nat[v] = WeightScale8(p, b, c + 32 * h + 8 * v);
  ds[0] = A::Permute128<0x20>(nat[0], nat[2]);
  ds[1] = A::Permute128<0x31>(nat[0], nat[2]);
  ds[2] = A::Permute128<0x20>(nat[1], nat[3]);
  ds[3] = A::Permute128<0x31>(nat[1], nat[3]);
}

// y row r at half h of the stretch c += (dx * dw) * acc, one FMA a column (the scalar fold).
Q8_AVX2 Q8_ALWAYS_INLINE void FoldRow(const Int8Operands& p, int64_t b, int64_t c, int h,
                                      int64_t r, const I32x8* acc, const F32x8* ds) {
  const F32x8 dxr = A::Set1(p.dx[r * p.lddx + b]);
  float* yr = p.y + r * p.n + c + 8 * h;
  for (int i = 0; i < 4; ++i) {
    const F32x8 scale = A::Mul(dxr, ds[i]);
    A::StoreU(yr + 16 * i, A::Fma(scale, A::ToFloat(acc[i]), A::LoadU(yr + 16 * i)));
  }
}

// The 4 bytes x row r holds at rows 4t..4t+3 of block b, in every 32-bit lane.
Q8_AVX2 Q8_ALWAYS_INLINE I32x8 XQuad(const Int8Operands& p, int64_t b, int64_t r, int t) {
  int32_t quad;
  std::memcpy(&quad, p.xq + r * p.ldxq + b * kBlock + 4 * t, sizeof quad);
  return A::Set1Int32(quad);
}

// Half h of block b's stretch at c, interleaved once for every tile of rows: quad t's group i
// at g[4 t + i], its magnitudes at ga[4 t + i] (2 KiB, L1).
struct Interleaved {
  I32x8 g[kBlock], ga[kBlock];
};

Q8_AVX2 inline void InterleaveHalf(const Int8Operands& p, int64_t b, int64_t c, int h,
                                   Interleaved* w) {
  for (int t = 0; t < kBlock / 4; ++t) {
    if (h == 0) {
      InterleaveQuad<false, true>(p, b, c, t, w->g + 4 * t, w->ga + 4 * t);
    } else {
      InterleaveQuad<false, false>(p, b, c + 32, t, w->g + 4 * t, w->ga + 4 * t);
    }
  }
}

// MR (<= kTileRows) x rows from r0 against groups [i0, i0 + 2) of an interleaved half: 2 MR
// accumulators; y row r at those groups += (dx * dw) * acc, one FMA a column.
template <int MR>
Q8_AVX2 inline void Tile(const Int8Operands& p, const Interleaved& w, int64_t b, int64_t c, int h,
                         int i0, int64_t r0, const F32x8* ds) {
  I32x8 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = A::ZeroInt();
  for (int t = 0; t < kBlock / 4; ++t) {
    const I32x8 g0 = w.g[4 * t + i0], g1 = w.g[4 * t + i0 + 1];
    const I32x8 a0 = w.ga[4 * t + i0], a1 = w.ga[4 * t + i0 + 1];
    for (int r = 0; r < MR; ++r) {
      const I32x8 xv = XQuad(p, b, r0 + r, t);
      acc[r][0] = A::DotInt8(acc[r][0], a0, g0, xv);
      acc[r][1] = A::DotInt8(acc[r][1], a1, g1, xv);
    }
  }
  for (int r = 0; r < MR; ++r) {
    const F32x8 dxr = A::Set1(p.dx[(r0 + r) * p.lddx + b]);
    float* yr = p.y + (r0 + r) * p.n + c + 8 * h;
    for (int j = 0; j < 2; ++j) {
      float* yg = yr + 16 * (i0 + j);
      const F32x8 scale = A::Mul(dxr, ds[i0 + j]);
      A::StoreU(yg, A::Fma(scale, A::ToFloat(acc[r][j]), A::LoadU(yg)));
    }
  }
}

// x rows per register tile: 4 rows x 2 groups of accumulators beside the 4 interleaved vectors
// they read fill AVX2's 16 registers.
constexpr int64_t kTileRows = 4;

template <int MR = kTileRows>
Q8_AVX2 inline void TileRows(int64_t mr, const Int8Operands& p, const Interleaved& w, int64_t b,
                             int64_t c, int h, int i0, int64_t r0, const F32x8* ds) {
  if constexpr (MR == 1) {
    Tile<1>(p, w, b, c, h, i0, r0, ds);
  } else {
    if (mr == MR) return Tile<MR>(p, w, b, c, h, i0, r0, ds);
    TileRows<MR - 1>(mr, p, w, b, c, h, i0, r0, ds);
  }
}

// One x row against the stretches of block b, reading q 8 rows at a time across all n64
// columns (long sequential streams), the block's int32 sums in sums (n64 values, StoredColumn's
// order) between passes: the same integers and folds as Tile<1>.
constexpr int kStreamQuads = 2;

Q8_AVX2 inline void StreamRow(const Int8Operands& p, int64_t b, int64_t n64, int32_t* sums) {
  for (int t0 = 0; t0 < kBlock / 4; t0 += kStreamQuads) {
    I32x8 xv[kStreamQuads];
    for (int u = 0; u < kStreamQuads; ++u) xv[u] = XQuad(p, b, 0, t0 + u);
    const bool first = t0 == 0, last = t0 + kStreamQuads == kBlock / 4;
    for (int64_t c = 0; c < n64; c += kStretch) {
      for (int h = 0; h < 2; ++h) {
        int32_t* sh = sums + c + 8 * h;  // group i at sh + 16 i
        I32x8 acc[4];
        for (int i = 0; i < 4; ++i) acc[i] = first ? A::ZeroInt() : A::LoadBytes(sh + 16 * i);
        for (int u = 0; u < kStreamQuads; ++u) {
          I32x8 g[4], ga[4];
          if (h == 0) {
            InterleaveQuad<true, true>(p, b, c, t0 + u, g, ga);
          } else {
            InterleaveQuad<true, false>(p, b, c + 32, t0 + u, g, ga);
          }
          for (int i = 0; i < 4; ++i) acc[i] = A::DotInt8(acc[i], ga[i], g[i], xv[u]);
        }
        if (!last) {
          for (int i = 0; i < 4; ++i) A::StoreBytes(sh + 16 * i, acc[i]);
          continue;
        }
        F32x8 ds[4];
        HalfScales(p, b, c, h, ds);
        FoldRow(p, b, c, h, 0, acc, ds);
      }
    }
  }
}

// Every x row against every column: the stretches on AVX2, the last n % 64 columns scalar.
Q8_AVX2 inline void Columns(const Int8Operands& p) {
  const int64_t n64 = p.n & ~(kStretch - 1);
  if (p.m == 1 && n64 > 0) {
    std::vector<int32_t> sums(static_cast<size_t>(n64));
    for (int64_t b = 0; b < p.k / kBlock; ++b) StreamRow(p, b, n64, sums.data());
  } else {
    Interleaved w;
    for (int64_t b = 0; b < p.k / kBlock; ++b) {
      for (int64_t c = 0; c < n64; c += kStretch) {
        for (int h = 0; h < 2; ++h) {
          InterleaveHalf(p, b, c, h, &w);
          F32x8 ds[4];
          HalfScales(p, b, c, h, ds);
          for (int64_t r = 0; r < p.m; r += kTileRows) {
            const int64_t mr = p.m - r < kTileRows ? p.m - r : kTileRows;
            for (int i0 = 0; i0 < 4; i0 += 2) TileRows(mr, p, w, b, c, h, i0, r, ds);
          }
        }
      }
    }
  }
  if (n64 < p.n) ColumnsInt8Scalar(p, n64, p.n);
}

}  // namespace avx2
}  // namespace q8act
#endif  // Q8_X86

#endif  // Q8RULES_Q8_ACT_AVX2_H_
