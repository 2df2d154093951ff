// The Q8_0 x Q8_0 product on aarch64's Advanced SIMD (q8_act_int8.h dispatches it;
// q8_act_common.h holds the operands, the stored column order and the scalar path it matches
// bit for bit), in two forms: Columns<true> with ARMv8.2's sdot (neon_dotprod), Columns<false>
// with plain NEON (neon).
//
// sdot multiplies signed bytes by signed bytes, four to a 32-bit lane, so the sums start at 0
// (no offset, unlike VNNI's) and every block dot is exact for any int8 weight. Without sdot the
// same lane sums come from smull / smull2 (int16 products), addp (pairs, inside int16) and
// sadalp (into int32): four instructions for one sdot, the same integers.
//
// q is (K, N) row-major. A 16-column chunk of rows 4t..4t+3 of a block is interleaved in
// registers (four rows' bytes to a 32-bit lane: zip1 / zip2 of bytes, then of halfwords)
// straight from the loads; group i of the chunk at column c holds columns c + 4 i .. c + 4 i + 3
// in column order. Within a 64-column stretch, chunk h's group i is what StoredColumn keeps at
// 16 i + 4 h: one 4-float store each, no shuffle. Register tiles take up to 4 x rows (16
// accumulators); one x row streams 8 rows at a time across all columns instead, as the x86
// paths do.

#ifndef Q8RULES_Q8_ACT_NEON_H_
#define Q8RULES_Q8_ACT_NEON_H_

#include <cmath>
#include <cstdint>
#include <vector>

#include "q8_act_common.h"
#include "simd.h"

#if Q8_ARM
namespace q8act {
namespace neon {

using q8simd::F32x4;
using q8simd::I32x4;
using q8simd::I8x16;
using q8simd::Mask4;
using N = q8simd::NeonInt;

// QuantizeBlockScalar on NEON, bit for bit: the same float32 operations, each correctly rounded
// (a true division; floor by frintm; fmaxnm / fminnm as C's fmax / fmin, NaN included), the
// sign by copysign and the clamp as there.
inline void QuantizeBlock(const float* xb, int8_t* qb, float* dx, int32_t* xc) {
  F32x4 v[8];
  for (int j = 0; j < 8; ++j) v[j] = N::LoadU(xb + 4 * j);
  F32x4 mag = N::Abs(v[0]);
  for (int j = 1; j < 8; ++j) mag = N::MaxNum(mag, N::Abs(v[j]));
  // fmax(0, ...) as the scalar loop starts: 0 where every value is NaN
  const float amax = std::fmax(0.0f, N::ReduceMaxNum(mag));
  const float d = amax / 127.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  const F32x4 idv = N::Set1(id), high = N::Set1(127.0f), low = N::Set1(-127.0f);
  I32x4 q[8];
  for (int j = 0; j < 8; ++j) {
    const F32x4 s = N::Mul(v[j], idv);
    const F32x4 a = N::Abs(s);
    const F32x4 fl = N::Floor(a);
    const F32x4 twice = N::Add(N::Sub(a, fl), N::Sub(a, fl));
    const F32x4 r = N::CopySign(N::Add(fl, N::Floor(twice)), s);
    q[j] = N::TruncToInt32(N::MinNum(high, N::MaxNum(low, r)));
  }
  N::StoreInt8x16(qb, q[0], q[1], q[2], q[3]);
  N::StoreInt8x16(qb + 16, q[4], q[5], q[6], q[7]);
  *dx = N::RoundToHalf(d);
  I32x4 sum = q[0];
  for (int j = 1; j < 8; ++j) sum = N::AddInt32(sum, q[j]);
  *xc = -kOffset * N::ReduceAddInt32(sum);
}

// acc + the lane sums of w's and x's bytes: sdot (kDot), else its plain-NEON equivalent.
template <bool kDot>
Q8_ALWAYS_INLINE I32x4 Dot(I32x4 acc, I8x16 w, I8x16 x) {
  if constexpr (kDot) {
    return N::DotInt8Sdot(acc, w, x);
  } else {
    return N::DotInt8Plain(acc, w, x);
  }
}

// Rows 4t..4t+3 of block b at columns [c, c + 16), interleaved (g[i]: columns c + 4 i + l in
// lane l). kStream: the caller reads q in its memory order (StreamRow), which also prefetches
// kStreamAheadL2 bytes ahead into L2; kPrefetch: this chunk starts a cache line, whose next
// lines it prefetches.
template <bool kStream, bool kPrefetch>
Q8_ALWAYS_INLINE void InterleaveQuad(const Int8Operands& p, int64_t b, int64_t c, int t,
                                     I8x16* g) {
  const int8_t* row = p.q + (b * kBlock + 4 * t) * p.n + c;
  I8x16 r[4];
  for (int i = 0; i < 4; ++i) {
    if (kPrefetch) {
      if (kStream) q8simd::PrefetchL2(row + i * p.n + kStreamAheadL2);
      q8simd::PrefetchL1(row + i * p.n + kPrefetchAhead);
    }
    r[i] = N::LoadBytes(row + i * p.n);
  }
  const I8x16 lo01 = N::Zip1<8>(r[0], r[1]), hi01 = N::Zip2<8>(r[0], r[1]);
  const I8x16 lo23 = N::Zip1<8>(r[2], r[3]), hi23 = N::Zip2<8>(r[2], r[3]);
  g[0] = N::Zip1<16>(lo01, lo23);
  g[1] = N::Zip2<16>(lo01, lo23);
  g[2] = N::Zip1<16>(hi01, hi23);
  g[3] = N::Zip2<16>(hi01, hi23);
}

// The chunk at column c (within the stretch at c64) interleaved as InterleaveQuad, its first
// chunk prefetching for the stretch.
template <bool kStream>
Q8_ALWAYS_INLINE void ChunkQuad(const Int8Operands& p, int64_t b, int64_t c64, int h, int t,
                                I8x16* g) {
  if (h == 0) {
    InterleaveQuad<kStream, true>(p, b, c64, t, g);
  } else {
    InterleaveQuad<kStream, false>(p, b, c64 + 16 * h, t, g);
  }
}

// 4 weight scales of block b from column col, as float32.
Q8_ALWAYS_INLINE F32x4 WeightScale4(const Int8Operands& p, int64_t b, int64_t col) {
  const int64_t i = b * p.n + col;
  if (p.scale_f16) return N::LoadHalves(static_cast<const uint16_t*>(p.scale) + i);
  return N::LoadU(static_cast<const float*>(p.scale) + i);
}

// y row r at chunk h of the stretch c64 += (dx * dw) * acc, one FMA a column (the scalar fold),
// each group stored where StoredColumn keeps it.
Q8_ALWAYS_INLINE void FoldRow(const Int8Operands& p, int64_t b, int64_t c64, int h, int64_t r,
                              const I32x4* acc) {
  const F32x4 dxr = N::Set1(p.dx[r * p.lddx + b]);
  float* yr = p.y + r * p.n + c64 + 4 * h;
  for (int i = 0; i < 4; ++i) {
    const F32x4 scale = N::Mul(dxr, WeightScale4(p, b, c64 + 16 * h + 4 * i));
    N::StoreU(yr + 16 * i, N::Fma(scale, N::ToFloat(acc[i]), N::LoadU(yr + 16 * i)));
  }
}

// The 4 bytes x row r holds at rows 4t..4t+3 of block b, in every 32-bit lane.
Q8_ALWAYS_INLINE I8x16 XQuad(const Int8Operands& p, int64_t b, int64_t r, int t) {
  return N::BroadcastQuad(p.xq + r * p.ldxq + b * kBlock + 4 * t);
}

// MR (<= kTileRows) x rows from r0 against chunk h of block b's stretch at c64.
template <bool kDot, int MR>
Q8_ALWAYS_INLINE void Tile(const Int8Operands& p, int64_t b, int64_t c64, int h, int64_t r0) {
  I32x4 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < 4; ++i) acc[r][i] = N::ZeroInt();
  for (int t = 0; t < kBlock / 4; ++t) {
    I8x16 g[4];
    ChunkQuad<false>(p, b, c64, h, t, g);
    for (int r = 0; r < MR; ++r) {
      const I8x16 xv = XQuad(p, b, r0 + r, t);
      for (int i = 0; i < 4; ++i) acc[r][i] = Dot<kDot>(acc[r][i], g[i], xv);
    }
  }
  for (int r = 0; r < MR; ++r) FoldRow(p, b, c64, h, r0 + r, acc[r]);
}

// x rows per register tile: 4 x 4 accumulators beside the 4 loaded rows and 4 interleaved
// vectors (and the plain dots' int16 products) in NEON's 32 registers.
constexpr int64_t kTileRows = 4;

// One x row against the stretches of block b, reading q 8 rows at a time across all n64
// columns (long sequential streams), the block's int32 sums in sums (n64 values, column order)
// between passes: the same integers and folds as Tile<kDot, 1>.
constexpr int kStreamQuads = 2;

template <bool kDot>
Q8_ALWAYS_INLINE void StreamRow(const Int8Operands& p, int64_t b, int64_t n64, int32_t* sums) {
  for (int t0 = 0; t0 < kBlock / 4; t0 += kStreamQuads) {
    I8x16 xv[kStreamQuads];
    for (int u = 0; u < kStreamQuads; ++u) xv[u] = XQuad(p, b, 0, t0 + u);
    const bool first = t0 == 0, last = t0 + kStreamQuads == kBlock / 4;
    for (int64_t c = 0; c < n64; c += kStretch) {
      for (int h = 0; h < 4; ++h) {
        int32_t* sh = sums + c + 16 * h;  // group i at sh + 4 i
        I32x4 acc[4];
        for (int i = 0; i < 4; ++i) acc[i] = first ? N::ZeroInt() : N::LoadInt32(sh + 4 * i);
        for (int u = 0; u < kStreamQuads; ++u) {
          I8x16 g[4];
          ChunkQuad<true>(p, b, c, h, t0 + u, g);
          for (int i = 0; i < 4; ++i) acc[i] = Dot<kDot>(acc[i], g[i], xv[u]);
        }
        if (!last) {
          for (int i = 0; i < 4; ++i) N::StoreInt32(sh + 4 * i, acc[i]);
          continue;
        }
        FoldRow(p, b, c, h, 0, acc);
      }
    }
  }
}

// Every x row against every column: the stretches on NEON, the last n % 64 columns scalar.
// Always inlined into Columns<kDot>, which carries sdot's target where kDot.
template <bool kDot>
Q8_ALWAYS_INLINE void AllColumns(const Int8Operands& p) {
  const int64_t n64 = p.n & ~(kStretch - 1);
  if (p.m == 1 && n64 > 0) {
    std::vector<int32_t> sums(static_cast<size_t>(n64));
    for (int64_t b = 0; b < p.k / kBlock; ++b) StreamRow<kDot>(p, b, n64, sums.data());
  } else {
    for (int64_t b = 0; b < p.k / kBlock; ++b) {
      for (int64_t c = 0; c < n64; c += kStretch) {
        for (int h = 0; h < 4; ++h) {
          int64_t r = 0;
          for (; r + kTileRows <= p.m; r += kTileRows) Tile<kDot, kTileRows>(p, b, c, h, r);
          switch (p.m - r) {
            case 3: Tile<kDot, 3>(p, b, c, h, r); break;
            case 2: Tile<kDot, 2>(p, b, c, h, r); break;
            case 1: Tile<kDot, 1>(p, b, c, h, r); break;
            default: break;
          }
        }
      }
    }
  }
  if (n64 < p.n) ColumnsInt8Scalar(p, n64, p.n);
}

// y (p.m, p.n, stretch-permuted) += the blocks of p: with sdot (kDot; only on a CPU that has
// it) or without.
template <bool kDot>
void Columns(const Int8Operands& p);

template <>
inline void Columns<false>(const Int8Operands& p) {
  AllColumns<false>(p);
}

template <>
Q8_NEON_DOT inline void Columns<true>(const Int8Operands& p) {
  AllColumns<true>(p);
}

}  // namespace neon
}  // namespace q8act
#endif  // Q8_ARM

#endif  // Q8RULES_Q8_ACT_NEON_H_
