// The weight-only product's SIMD tiles, written once over a vector type `Vec` (simd.h: Avx2,
// Avx512, Neon). q8_matmul.h includes this file once per path, each time inside a namespace
// that names `Vec` (and on x86 under that path's target; so no include guard): every path's
// code is the same text, and each keeps the FMAs of the hand-written code it replaced, in the
// same order.
//
// Needs, from the including namespace: Problem, kBlock, kStreamRows, kStreamColumns,
// kStreamAheadL2, q8simd::kPrefetch, ScaleAt and YAt.

using V = typename Vec::V;
constexpr int L = Vec::kLanes;
constexpr int64_t kRows = Vec::kTileRows;

// y[m0 + r, col + L v ...] += d[b, col + L v ...] * acc[r][v]: a tile's block sums, folded down
// their columns with the block's scales.
template <int MR, int NV>
Q8_ALWAYS_INLINE void FoldIntoY(const Problem& p, int64_t b, int64_t col, int64_t m0,
                      const V (&acc)[MR][NV]) {
  for (int v = 0; v < NV; ++v) {
    const V d = Vec::Scale(p.scale, p.scale_f16, b * p.n + col + L * v);
    for (int r = 0; r < MR; ++r) {
      float* yr = YAt(p, m0 + r, col + L * v);
      Vec::StoreU(yr, Vec::Fma(d, acc[r][v], Vec::LoadU(yr)));
    }
  }
}

// One register tile of one 32-row block: MR x rows [m0, m0 + MR) against NV * L columns from
// col. The block's partial sums stay in MR * NV registers for all 32 rows; each q vector is
// loaded and converted once and used by all MR x rows; then the block's scales are applied
// once: y += d * s. Every cache line the tile reads next is prefetched kPrefetch bytes ahead
// (the 32 rows of a block are 32 concurrent streams; the hardware prefetcher alone lags).
template <int MR, int NV>
inline void Tile(const Problem& p, int64_t b, int64_t col, int64_t m0) {
  V acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec::Zero();
  const int8_t* qb = p.q + b * kBlock * p.n + col;
  const float* xb = p.x + m0 * p.ldx + b * kBlock;
  for (int i = 0; i < kBlock; ++i) {
    const int8_t* qr = qb + i * p.n;
    for (int l = 0; l < NV * L; l += 64)
      q8simd::PrefetchL1(qr + l + q8simd::kPrefetch);
    V qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = Vec::Load(qr + L * v);
    for (int r = 0; r < MR; ++r) {
      const V xv = Vec::Broadcast(xb + r * p.ldx + i);
      for (int v = 0; v < NV; ++v) acc[r][v] = Vec::Fma(xv, qv[v], acc[r][v]);
    }
  }
  FoldIntoY<MR, NV>(p, b, col, m0, acc);
}

// Tile<MR, NV> reading q already converted to float32: f holds the block's 32 rows x 64
// columns (row stride 64), col0 the column of f[0].
template <int MR, int NV>
inline void TileF(const Problem& p, int64_t b, const float* f, int64_t col0, int64_t col,
                  int64_t m0) {
  V acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec::Zero();
  const float* xb = p.x + m0 * p.ldx + b * kBlock;
  const float* fc = f + (col - col0);
  for (int i = 0; i < kBlock; ++i) {
    V qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = Vec::LoadU(fc + i * 64 + L * v);
    for (int r = 0; r < MR; ++r) {
      const V xv = Vec::Broadcast(xb + r * p.ldx + i);
      for (int v = 0; v < NV; ++v) acc[r][v] = Vec::Fma(xv, qv[v], acc[r][v]);
    }
  }
  FoldIntoY<MR, NV>(p, b, col, m0, acc);
}

// Tile<mr, NV> (with `f`: TileF) for a run-time mr in 1..kRows (more: kRows).
template <int NV, int MR = 1>
inline void TileRows(int64_t mr, const Problem& p, int64_t b, int64_t col, int64_t m0) {
  if constexpr (MR == kRows) {
    Tile<MR, NV>(p, b, col, m0);
  } else {
    if (mr == MR) return Tile<MR, NV>(p, b, col, m0);
    TileRows<NV, MR + 1>(mr, p, b, col, m0);
  }
}

template <int NV, int MR = 1>
inline void TileFRows(int64_t mr, const Problem& p, int64_t b, const float* f, int64_t col0,
                      int64_t col, int64_t m0) {
  if constexpr (MR == kRows) {
    TileF<MR, NV>(p, b, f, col0, col, m0);
  } else {
    if (mr == MR) return TileF<MR, NV>(p, b, f, col0, col, m0);
    TileFRows<NV, MR + 1>(mr, p, b, f, col0, col, m0);
  }
}

// One x row against columns [c0, c1) of block b (c1 - c0 a multiple of L * NV, at most
// kStreamColumns), reading q R rows at a time over the whole stretch: R long sequential
// streams, which a 2-core EPYC reads up to twice as fast as the 32 short ones of the register
// tiles (RESULTS.md). The block's partial sums s (one per column) go through s_buf (L1)
// between passes; each column's sum is still fma(x_31, q_31, ... fma(x_0, q_0, 0)) in row
// order and then y = fma(d, s, y), so the result is Tile<1, NV>'s bit for bit. Each row's
// loads also prefetch into L2 the same columns of a row at least kStreamAheadL2 bytes ahead
// (about 1 us of DRAM reads: without it the core kept too few lines in flight, and the stream
// lost to the tiles between 256 and 2048 columns) and at least R rows ahead, a row the next
// pass reads (a fixed byte distance would point into rows this pass is reading at N = 4096, or
// at other columns than a stretch's at N > kStreamColumns).
template <int R, int NV>
inline void StreamBlock(const Problem& p, int64_t b, int64_t c0, int64_t c1, int64_t m0,
                        float* s_buf) {
  const int8_t* qb = p.q + b * kBlock * p.n;
  const float* xb = p.x + m0 * p.ldx + b * kBlock;
  const int64_t ahead = p.n * std::max<int64_t>(R, (kStreamAheadL2 + p.n - 1) / p.n);
  for (int64_t r0 = 0; r0 < kBlock; r0 += R) {
    V xv[R];
    for (int i = 0; i < R; ++i) xv[i] = Vec::Broadcast(xb + r0 + i);
    const bool first = r0 == 0, last = r0 + R == kBlock;
    for (int64_t c = c0; c < c1; c += L * NV) {
      float* sc = s_buf + (c - c0);
      V acc[NV];
      for (int v = 0; v < NV; ++v) acc[v] = first ? Vec::Zero() : Vec::LoadA(sc + L * v);
      for (int i = 0; i < R; ++i) {
        const int8_t* qr = qb + (r0 + i) * p.n + c;
        q8simd::PrefetchL2(qr + ahead);
        for (int v = 0; v < NV; ++v) acc[v] = Vec::Fma(xv[i], Vec::Load(qr + L * v), acc[v]);
      }
      if (!last) {
        for (int v = 0; v < NV; ++v) Vec::StoreA(sc + L * v, acc[v]);
        continue;
      }
      for (int v = 0; v < NV; ++v) {
        float* yc = YAt(p, m0, c + L * v);
        const V d = Vec::Scale(p.scale, p.scale_f16, b * p.n + c + L * v);
        Vec::StoreU(yc, Vec::Fma(d, acc[v], Vec::LoadU(yc)));
      }
    }
  }
}

// Columns [c0, c1) of block b for x rows [m0, m0 + mg), one column at a time: the last columns
// past a whole vector. Compiled under the path's target like the tiles (where the compiler may
// contract y += d * acc into an FMA, as it did in the hand-written paths).
inline void ColumnsTail(const Problem& p, int64_t b, int64_t c0, int64_t c1, int64_t m0,
                        int64_t mg) {
  for (int64_t c = c0; c < c1; ++c) {
    const float d = ScaleAt(p, b, c);
    for (int64_t r = 0; r < mg; ++r) {
      const float* x = p.x + (m0 + r) * p.ldx + b * kBlock;
      float acc = 0.0f;
      for (int64_t i = 0; i < kBlock; ++i)
        acc = std::fma(x[i], static_cast<float>(p.q[(b * kBlock + i) * p.n + c]), acc);
      *YAt(p, m0 + r, c) += d * acc;
    }
  }
}

// Columns [n0, n1) for x rows [m0, m0 + mg), block by block. One row against at least 64
// columns streams q whole rows at a time (StreamBlock). Otherwise in 64-column stretches (one
// cache line of each q row), with register tiles that fit the path's registers:
//   4 lanes, 32 registers: mg <= 6 16-column tiles;
//   8 lanes, 16 registers: mg = 2, 3 two mg x 32 tiles; mg = 4 4 x 24, 4 x 24, 4 x 16 (12
//     accumulators: 8 left the FMAs waiting on their latency, 0.85x the time at 4096 x 4096
//     and 576 x 3072 on an AVX2 EPYC); mg = 5, 6 16-column tiles;
//   16 lanes, 32 registers: mg <= 6 one mg x 64 tile; mg = 7, 8 two mg x 32 tiles;
// and more rows than a tile takes convert the stretch to float32 once (8 KiB, L1) for tiles
// of up to kRows rows and kFloatVectors vectors (4 of 4 lanes, else 2; 8 lanes: up to 4 rows,
// balanced, x 24, 24, 16 columns). Then L columns at a time, and the last N % L scalar.
inline void Columns(const Problem& p, int64_t n0, int64_t n1, int64_t m0, int64_t mg) {
  const int64_t w = n1 - n0;
  const int64_t n64 = n0 + (w & ~int64_t{63});
  const int64_t nl = n0 + (w & ~int64_t{L - 1});
  const bool stream = mg == 1 && w >= 64;
  constexpr int kFloatVectors = L == 4 ? 4 : 2;
  for (int64_t b = 0; b < p.k / kBlock; ++b) {
    if (stream) {
      alignas(64) float s_buf[kStreamColumns];
      for (int64_t c = n0; c < n64; c += kStreamColumns)
        StreamBlock<kStreamRows, 4>(p, b, c, std::min(n64, c + kStreamColumns), m0, s_buf);
    }
    for (int64_t c = n0; c < n64 && !stream; c += 64) {
      if (mg > kRows) {
        alignas(64) float f[kBlock * 64];
        for (int64_t i = 0; i < kBlock; ++i) {
          const int8_t* qr = p.q + (b * kBlock + i) * p.n + c;
          q8simd::PrefetchL1(qr + q8simd::kPrefetch);
          for (int v = 0; v < 64 / L; ++v) Vec::StoreA(f + i * 64 + L * v, Vec::Load(qr + L * v));
        }
        if constexpr (L == 8) {  // tiles of at most 4 rows (balanced) x 24, 24, 16 columns
          const int64_t tiles = (mg + 3) / 4;
          for (int64_t t = 0; t < tiles; ++t) {
            const int64_t r0 = mg * t / tiles, mr = mg * (t + 1) / tiles - r0;
            TileFRows<3>(mr, p, b, f, c, c, m0 + r0);
            TileFRows<3>(mr, p, b, f, c, c + 24, m0 + r0);
            TileFRows<2>(mr, p, b, f, c, c + 48, m0 + r0);
          }
        } else {
          for (int64_t cv = c; cv < c + 64; cv += kFloatVectors * L)
            for (int64_t r = 0; r < mg; r += kRows)
              TileFRows<kFloatVectors>(std::min(kRows, mg - r), p, b, f, c, cv, m0 + r);
        }
        continue;
      }
      if constexpr (L == 4) {  // at most 24 accumulators + 4 q vectors
        for (int64_t cv = c; cv < c + 64; cv += 4 * L) TileRows<4>(mg, p, b, cv, m0);
      } else if constexpr (L == 8) {
        if (mg == 2 || mg == 3) {  // 8 or 12 accumulators + 4 q vectors
          TileRows<4>(mg, p, b, c, m0);
          TileRows<4>(mg, p, b, c + 32, m0);
          continue;
        }
        if (mg == 4) {  // 12 accumulators + 3 q vectors, then 8 + 2
          TileRows<3>(mg, p, b, c, m0);
          TileRows<3>(mg, p, b, c + 24, m0);
          TileRows<2>(mg, p, b, c + 48, m0);
          continue;
        }
        for (int64_t cv = c; cv < c + 64; cv += 2 * L) TileRows<2>(mg, p, b, cv, m0);
      } else {
        if (mg <= 6) {  // at most 24 accumulators + 4 q vectors
          TileRows<4>(mg, p, b, c, m0);
        } else {
          TileRows<2>(mg, p, b, c, m0);
          TileRows<2>(mg, p, b, c + 32, m0);
        }
      }
    }
    for (int64_t c = n64; c < nl; c += L)  // the last < 64 columns, L at a time
      for (int64_t r = 0; r < mg; r += kRows) TileRows<1>(std::min(kRows, mg - r), p, b, c, m0 + r);
    ColumnsTail(p, b, nl, n1, m0, mg);  // the last < L columns
  }
}
