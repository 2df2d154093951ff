// Q8_0 weight-only product on the CPU, as an XLA FFI handler:
//   y (M, N) f32 = x (M, K) f32 @ W,  W[k, n] = q[k, n] * scale[k / 32, n],
// q int8 (K, N) row-major, scale float32 or float16 (K/32, N). Numerics are the
// fold's: per 32-row block b, s[n] = sum_i x[32b + i] q[32b + i, n] in float32
// (FMA), then y[n] += scale[b, n] * s[n]. Decode-sized M is bound by reading q,
// so q is read once, converted to float32 in registers, and used by every x row.
// Paths (AVX-512, AVX2, scalar; the same block order) are picked at run time from
// the CPU and $Q8RULES_CPU_ISA; design measurements are in benchmarks/RESULTS.md.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

// GCC 12's avx512fintrin.h seeds its conversions with _mm512_undefined_*(), which
// -Wuninitialized then reports at every inlined use in this file (GCC bug 105593); on that
// compiler alone those two warnings are off.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define Q8_X86 1
#else
#define Q8_X86 0
#endif

#include "decode_attention.h"
#include "q8_act_int8.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;      // Q8_0 rows per scale
constexpr int64_t kMaxRows = 16;    // x rows sharing one read of q
// x rows and 8-column vectors per AVX2 register tile for M > 3 (the
// alternatives measured are in benchmarks/RESULTS.md).
constexpr int64_t kTileRows = 6;
constexpr int kTileVectors = 2;
constexpr int64_t kPrefetch = 128;  // bytes ahead in each q row stream (RESULTS.md)

// One product, all arrays row-major. A thread's share is a run of 32-row blocks: the same struct with x, q and
// scale advanced to its first block, k its rows, and y its own accumulator.
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
const char* const kIsaNames[] = {"scalar", "avx2", "avx512"};

struct Problem {
  const float* x;       // (M, k) with row stride ldx
  const int8_t* q;      // (k, N)
  const void* scale;    // (k/32, N) float32 or float16
  bool scale_f16;
  float* y;             // (M, N), accumulated into (+=)
  int64_t m, k, n;
  int64_t ldx;          // x's row stride (the full K)
  Isa isa;              // the path every thread runs
  // Q8_0 activations (q8_act_int8.h), else null: x's values (M, K), scales and -128 * block
  // sums (M, K/32), row strides ldx and ldx / 32; y is then stretch-permuted until the end.
  const int8_t* xq = nullptr;
  const float* dx = nullptr;
  const int32_t* xc = nullptr;
  bool vnni = false;    // the Q8_0-activation product's path: VNNI, else scalar
};

// The blocks [b0, b1) of p, accumulating into y.
Problem Blocks(const Problem& p, int64_t b0, int64_t b1, float* y) {
  Problem s = p;
  s.x = p.x + b0 * kBlock;
  if (p.xq != nullptr) {
    s.xq = p.xq + b0 * kBlock;
    s.dx = p.dx + b0;
    s.xc = p.xc + b0;
  }
  s.q = p.q + b0 * kBlock * p.n;
  s.scale = static_cast<const char*>(p.scale) + b0 * p.n * (p.scale_f16 ? 2 : 4);
  s.k = (b1 - b0) * kBlock;
  s.y = y;
  return s;
}

// IEEE half -> float without F16C (the scalar path).
float HalfToFloat(uint16_t h) { return q8act::HalfBitsToFloat(h); }

float ScaleAt(const Problem& p, int64_t b, int64_t col) {
  const int64_t i = b * p.n + col;
  if (p.scale_f16) return HalfToFloat(static_cast<const uint16_t*>(p.scale)[i]);
  return static_cast<const float*>(p.scale)[i];
}

// ---------------------------------------------------------------------------
// Scalar path (any x86-64): the same block order as the AVX2 path.
// Columns [n0, n1), x rows [m0, m0 + mg). s: mg x (n1 - n0) floats.
// ---------------------------------------------------------------------------
void ColumnsScalar(const Problem& p, int64_t n0, int64_t n1, int64_t m0, int64_t mg,
                   float* s) {
  const int64_t w = n1 - n0;
  for (int64_t b = 0; b < p.k / kBlock; ++b) {
    std::fill(s, s + mg * w, 0.0f);
    for (int64_t i = 0; i < kBlock; ++i) {  // stream the block's rows
      const int64_t row = b * kBlock + i;
      const int8_t* qr = p.q + row * p.n + n0;
      for (int64_t r = 0; r < mg; ++r) {
        const float xv = p.x[(m0 + r) * p.ldx + row];
        float* sr = s + r * w;
        for (int64_t j = 0; j < w; ++j) sr[j] += xv * static_cast<float>(qr[j]);
      }
    }
    for (int64_t r = 0; r < mg; ++r) {  // y += scale * s
      float* yr = p.y + (m0 + r) * p.n + n0;
      const float* sr = s + r * w;
      for (int64_t j = 0; j < w; ++j) yr[j] += ScaleAt(p, b, n0 + j) * sr[j];
    }
  }
}

#if Q8_X86
// ---------------------------------------------------------------------------
// AVX2 + FMA + F16C path.
// ---------------------------------------------------------------------------
#define Q8_AVX2 __attribute__((target("avx2,fma,f16c")))

// 8 int8 at p -> 8 floats.
Q8_AVX2 inline __m256 Load8(const int8_t* p) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

// 8 scales of block b from column col (float32 or float16).
Q8_AVX2 inline __m256 LoadScale8(const Problem& p, int64_t b, int64_t col) {
  const int64_t i = b * p.n + col;
  if (p.scale_f16) {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p.scale) + i));
    return _mm256_cvtph_ps(h);
  }
  return _mm256_loadu_ps(static_cast<const float*>(p.scale) + i);
}

// y[m0 + r, col + 8v ...] += d[b, col + 8v ...] * acc[r][v]: a tile's block
// sums, folded down their columns with the block's scales.
template <int MR, int NV>
Q8_AVX2 inline void FoldIntoY(const Problem& p, int64_t b, int64_t col, int64_t m0,
                              const __m256 (&acc)[MR][NV]) {
  for (int v = 0; v < NV; ++v) {
    const __m256 d = LoadScale8(p, b, col + 8 * v);
    for (int r = 0; r < MR; ++r) {
      float* yr = p.y + (m0 + r) * p.n + col + 8 * v;
      _mm256_storeu_ps(yr, _mm256_fmadd_ps(d, acc[r][v], _mm256_loadu_ps(yr)));
    }
  }
}

// One register tile of one 32-row block: MR x rows [m0, m0 + MR) against
// NV * 8 columns from col. The block's partial sums stay in MR * NV registers
// for all 32 rows (no partial-sum traffic through memory); each q vector is
// loaded and converted once and used by all MR x rows; then the block's scales
// are applied once: y += d * s.
template <int MR, int NV>
Q8_AVX2 inline void Tile(const Problem& p, int64_t b, int64_t col, int64_t m0) {
  __m256 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  const int8_t* qb = p.q + b * kBlock * p.n + col;
  const float* xb = p.x + m0 * p.ldx + b * kBlock;
  for (int i = 0; i < kBlock; ++i) {
    const int8_t* qr = qb + i * p.n;
    // Ask for this row's stream two cache lines ahead (the 32 rows of a
    // block are 32 concurrent streams; the hardware prefetcher alone lags).
    _mm_prefetch(reinterpret_cast<const char*>(qr + kPrefetch), _MM_HINT_T0);
    __m256 qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = Load8(qr + 8 * v);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(xb + r * p.ldx + i);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(xv, qv[v], acc[r][v]);
    }
  }
  FoldIntoY<MR, NV>(p, b, col, m0, acc);
}

// Tile<MR, NV> reading q already converted to float32: f holds the block's
// 32 rows x 64 columns (row stride 64), col0 the column of f[0].
template <int MR, int NV>
Q8_AVX2 inline void TileF(const Problem& p, int64_t b, const float* f, int64_t col0, int64_t col,
                          int64_t m0) {
  __m256 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  const float* xb = p.x + m0 * p.ldx + b * kBlock;
  const float* fc = f + (col - col0);
  for (int i = 0; i < kBlock; ++i) {
    __m256 qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = _mm256_loadu_ps(fc + i * 64 + 8 * v);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(xb + r * p.ldx + i);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(xv, qv[v], acc[r][v]);
    }
  }
  FoldIntoY<MR, NV>(p, b, col, m0, acc);
}

template <int NV>
Q8_AVX2 void TileFRows(int64_t mr, const Problem& p, int64_t b, const float* f, int64_t col0,
                       int64_t col, int64_t m0) {
  switch (mr) {
    case 1: return TileF<1, NV>(p, b, f, col0, col, m0);
    case 2: return TileF<2, NV>(p, b, f, col0, col, m0);
    case 3: return TileF<3, NV>(p, b, f, col0, col, m0);
    case 4: return TileF<4, NV>(p, b, f, col0, col, m0);
    case 5: return TileF<5, NV>(p, b, f, col0, col, m0);
    default: return TileF<6, NV>(p, b, f, col0, col, m0);
  }
}

// Tile<mr, NV> for a run-time mr in 1..kTileRows.
template <int NV>
Q8_AVX2 void TileRows(int64_t mr, const Problem& p, int64_t b, int64_t col, int64_t m0) {
  switch (mr) {
    case 1: return Tile<1, NV>(p, b, col, m0);
    case 2: return Tile<2, NV>(p, b, col, m0);
    case 3: return Tile<3, NV>(p, b, col, m0);
    case 4: return Tile<4, NV>(p, b, col, m0);
    case 5: return Tile<5, NV>(p, b, col, m0);
    default: return Tile<6, NV>(p, b, col, m0);
  }
}

// One x row against columns [c0, c1) of block b (c1 - c0 a multiple of 8 * NV, at most
// kStreamColumns), reading q R rows at a time over the whole stretch: R long sequential
// streams, which a 2-core EPYC reads up to twice as fast as the 32 short ones
// of the register tiles (K = N = 4096 from DRAM, 1 / 2 threads: 11.8 / 19.9 GB/s against
// 8.1 / 12.5; RESULTS.md). The block's partial sums s (one per column) go through s_buf (L1)
// between passes; each column's sum is still fma(x_31, q_31, ... fma(x_0, q_0, 0)) in row
// order and then y = fma(d, s, y), so the result is Tile<1, 8>'s bit for bit.
// Each row's loads also prefetch kStreamAheadL2 bytes ahead into L2: the stream reads q in its
// memory order, so that is about 1 us of DRAM reads ahead. Without it the core kept too few
// lines in flight, and the stream lost to the tiles between 256 and 2048 columns (so they ran
// there); with it the stream is the faster one at every width: SmolLM-135M's 121 products of a
// decode step (576 to 3072 columns, and the 49152-column head) went from 14.4-16.5 to
// 10.2-11.5 ms on one thread and 8.8-10.2 to 7.2-8.0 on two, and 8 layers of TinyLlama's
// (2048 to 11264 columns) from 32.7 to 24.9-27.9 ms on one thread (AVX-512; capped at AVX2:
// 16.2-17.6 -> 10.6 ms and 37.2 -> 27.7 ms; a Zen 4 EPYC, RESULTS.md).
constexpr int64_t kStreamRows = 8;
constexpr int64_t kStreamColumns = 4096;
constexpr int64_t kStreamAheadL2 = q8act::kStreamAheadL2;

template <int R, int NV>
Q8_AVX2 void StreamBlock1(const Problem& p, int64_t b, int64_t c0, int64_t c1, int64_t m0,
                          float* s_buf) {
  const int8_t* qb = p.q + b * kBlock * p.n;
  const float* xb = p.x + m0 * p.ldx + b * kBlock;
  float* yr = p.y + m0 * p.n;
  for (int64_t r0 = 0; r0 < kBlock; r0 += R) {
    __m256 xv[R];
    for (int i = 0; i < R; ++i) xv[i] = _mm256_broadcast_ss(xb + r0 + i);
    const bool first = r0 == 0, last = r0 + R == kBlock;
    for (int64_t c = c0; c < c1; c += 8 * NV) {
      float* sc = s_buf + (c - c0);
      __m256 acc[NV];
      for (int v = 0; v < NV; ++v) acc[v] = first ? _mm256_setzero_ps() : _mm256_load_ps(sc + 8 * v);
      for (int i = 0; i < R; ++i) {
        const int8_t* qr = qb + (r0 + i) * p.n + c;
        _mm_prefetch(reinterpret_cast<const char*>(qr + kStreamAheadL2), _MM_HINT_T1);
        for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(xv[i], Load8(qr + 8 * v), acc[v]);
      }
      if (!last) {
        for (int v = 0; v < NV; ++v) _mm256_store_ps(sc + 8 * v, acc[v]);
        continue;
      }
      for (int v = 0; v < NV; ++v) {
        float* yc = yr + c + 8 * v;
        _mm256_storeu_ps(yc, _mm256_fmadd_ps(LoadScale8(p, b, c + 8 * v), acc[v], _mm256_loadu_ps(yc)));
      }
    }
  }
}

// Columns [n0, n1) for x rows [m0, m0 + mg), block by block. One row against at least 64
// columns streams q whole rows at a time (StreamBlock1). Otherwise a 64-column stretch (one
// cache line of each q row) is one 1 x 64 register tile at
// mg = 1, two 2 x 32 or 3 x 32 tiles at mg = 2, 3, and 16-column tiles of up
// to 6 rows otherwise (from float32 converted once per stretch when mg > 6) (12 accumulators + 2 q vectors + 1 broadcast fit AVX2's
// 16 registers). Columns past the last multiple of 64 go 8 at a time, and
// the last N % 8 scalar.
Q8_AVX2 void ColumnsAvx2(const Problem& p, int64_t n0, int64_t n1, int64_t m0, int64_t mg) {
  const int64_t w = n1 - n0;
  const int64_t n64 = n0 + (w & ~int64_t{63});
  const int64_t n8 = n0 + (w & ~int64_t{7});
  const bool stream = mg == 1 && w >= 64;
  for (int64_t b = 0; b < p.k / kBlock; ++b) {
    if (stream) {  // one x row: q streamed a few whole rows at a time (StreamBlock1)
      alignas(32) float s_buf[kStreamColumns];
      for (int64_t c = n0; c < n64; c += kStreamColumns)
        StreamBlock1<kStreamRows, 4>(p, b, c, std::min(n64, c + kStreamColumns), m0, s_buf);
    }
    for (int64_t c = n0; c < n64 && !stream; c += 64) {
      if (mg == 2) {  // 2 x 32 columns: 8 accumulators, half the conversions of 2 x 16
        Tile<2, 4>(p, b, c, m0);
        Tile<2, 4>(p, b, c + 32, m0);
        continue;
      }
      if (mg == 3) {  // 3 x 32 columns: 12 accumulators + 4 q vectors (+1 spilled broadcast)
        Tile<3, 4>(p, b, c, m0);
        Tile<3, 4>(p, b, c + 32, m0);
        continue;
      }
      if (mg > kTileRows) {
        // Convert the block's 32 x 64 q bytes once (8 KiB of float32, L1)
        // for the several row groups that use them.
        alignas(32) float f[kBlock * 64];
        for (int64_t i = 0; i < kBlock; ++i) {
          const int8_t* qr = p.q + (b * kBlock + i) * p.n + c;
          _mm_prefetch(reinterpret_cast<const char*>(qr + kPrefetch), _MM_HINT_T0);
          for (int v = 0; v < 8; ++v) _mm256_store_ps(f + i * 64 + 8 * v, Load8(qr + 8 * v));
        }
        for (int64_t cv = c; cv < c + 64; cv += 8 * kTileVectors)
          for (int64_t r = 0; r < mg; r += kTileRows)
            TileFRows<kTileVectors>(std::min(kTileRows, mg - r), p, b, f, c, cv, m0 + r);
        continue;
      }
      for (int64_t cv = c; cv < c + 64; cv += 8 * kTileVectors)
        for (int64_t r = 0; r < mg; r += kTileRows)
          TileRows<kTileVectors>(std::min(kTileRows, mg - r), p, b, cv, m0 + r);
    }
    for (int64_t c = n64; c < n8; c += 8)  // the last < 64 columns, 8 at a time
      for (int64_t r = 0; r < mg; r += kTileRows)
        TileRows<1>(std::min(kTileRows, mg - r), p, b, c, m0 + r);
    for (int64_t c = n8; c < n1; ++c) {  // the last < 8 columns, scalar
      const float d = ScaleAt(p, b, c);
      for (int64_t r = 0; r < mg; ++r) {
        const float* x = p.x + (m0 + r) * p.ldx + b * kBlock;
        float acc = 0.0f;
        for (int64_t i = 0; i < kBlock; ++i)
          acc = std::fma(x[i], static_cast<float>(p.q[(b * kBlock + i) * p.n + c]), acc);
        p.y[(m0 + r) * p.n + c] += d * acc;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// AVX-512 path (F, plus the AVX2/FMA/F16C set): the AVX2 path's tiles on
// 16-column zmm vectors, with 32 registers for wider tiles.
// ---------------------------------------------------------------------------
#define Q8_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

// 16 int8 at p -> 16 floats (vpmovsxbd zmm + vcvtdq2ps).
Q8_AVX512 inline __m512 Load16(const int8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

// 16 scales of block b from column col (float32 or float16).
Q8_AVX512 inline __m512 LoadScale16(const Problem& p, int64_t b, int64_t col) {
  const int64_t i = b * p.n + col;
  if (p.scale_f16) {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p.scale) + i));
    return _mm512_cvtph_ps(h);
  }
  return _mm512_loadu_ps(static_cast<const float*>(p.scale) + i);
}

template <int MR, int NV>
Q8_AVX512 inline void FoldIntoY16(const Problem& p, int64_t b, int64_t col, int64_t m0,
                                  const __m512 (&acc)[MR][NV]) {
  for (int v = 0; v < NV; ++v) {
    const __m512 d = LoadScale16(p, b, col + 16 * v);
    for (int r = 0; r < MR; ++r) {
      float* yr = p.y + (m0 + r) * p.n + col + 16 * v;
      _mm512_storeu_ps(yr, _mm512_fmadd_ps(d, acc[r][v], _mm512_loadu_ps(yr)));
    }
  }
}

// MR x rows [m0, m0 + MR) against NV * 16 columns from col of block b, as
// Tile<MR, NV> on the AVX2 path; prefetches every cache line the tile reads
// next, kPrefetch bytes ahead.
template <int MR, int NV>
Q8_AVX512 inline void Tile16(const Problem& p, int64_t b, int64_t col, int64_t m0) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const int8_t* qb = p.q + b * kBlock * p.n + col;
  const float* xb = p.x + m0 * p.ldx + b * kBlock;
  for (int i = 0; i < kBlock; ++i) {
    const int8_t* qr = qb + i * p.n;
    for (int l = 0; l < NV * 16; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(qr + l + kPrefetch), _MM_HINT_T0);
    __m512 qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = Load16(qr + 16 * v);
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_set1_ps(xb[r * p.ldx + i]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xv, qv[v], acc[r][v]);
    }
  }
  FoldIntoY16<MR, NV>(p, b, col, m0, acc);
}

// Tile16<MR, NV> reading q already converted: f holds 32 rows x 64 columns
// (row stride 64) of block b, col0 the column of f[0].
template <int MR, int NV>
Q8_AVX512 inline void TileF16(const Problem& p, int64_t b, const float* f, int64_t col0,
                              int64_t col, int64_t m0) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const float* xb = p.x + m0 * p.ldx + b * kBlock;
  const float* fc = f + (col - col0);
  for (int i = 0; i < kBlock; ++i) {
    __m512 qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = _mm512_loadu_ps(fc + i * 64 + 16 * v);
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_set1_ps(xb[r * p.ldx + i]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xv, qv[v], acc[r][v]);
    }
  }
  FoldIntoY16<MR, NV>(p, b, col, m0, acc);
}

// Tile16<mr, NV> for a run-time mr in 1..8.
template <int NV>
Q8_AVX512 void Tile16Rows(int64_t mr, const Problem& p, int64_t b, int64_t col, int64_t m0) {
  switch (mr) {
    case 1: return Tile16<1, NV>(p, b, col, m0);
    case 2: return Tile16<2, NV>(p, b, col, m0);
    case 3: return Tile16<3, NV>(p, b, col, m0);
    case 4: return Tile16<4, NV>(p, b, col, m0);
    case 5: return Tile16<5, NV>(p, b, col, m0);
    case 6: return Tile16<6, NV>(p, b, col, m0);
    case 7: return Tile16<7, NV>(p, b, col, m0);
    default: return Tile16<8, NV>(p, b, col, m0);
  }
}

template <int NV>
Q8_AVX512 void TileF16Rows(int64_t mr, const Problem& p, int64_t b, const float* f, int64_t col0,
                           int64_t col, int64_t m0) {
  switch (mr) {
    case 1: return TileF16<1, NV>(p, b, f, col0, col, m0);
    case 2: return TileF16<2, NV>(p, b, f, col0, col, m0);
    case 3: return TileF16<3, NV>(p, b, f, col0, col, m0);
    case 4: return TileF16<4, NV>(p, b, f, col0, col, m0);
    case 5: return TileF16<5, NV>(p, b, f, col0, col, m0);
    case 6: return TileF16<6, NV>(p, b, f, col0, col, m0);
    case 7: return TileF16<7, NV>(p, b, f, col0, col, m0);
    default: return TileF16<8, NV>(p, b, f, col0, col, m0);
  }
}

// StreamBlock1 on AVX-512: one x row against columns [c0, c1) of block b (c1 - c0 a multiple
// of 16 * NV, at most kStreamColumns), q read R rows at a time over the whole stretch; each
// column's sum is fma(x_31, q_31, ... fma(x_0, q_0, 0)) in row order, then y = fma(d, s, y):
// Tile16<1, NV>'s bit for bit.
template <int R, int NV>
Q8_AVX512 void StreamBlock16(const Problem& p, int64_t b, int64_t c0, int64_t c1, int64_t m0,
                             float* s_buf) {
  const int8_t* qb = p.q + b * kBlock * p.n;
  const float* xb = p.x + m0 * p.ldx + b * kBlock;
  float* yr = p.y + m0 * p.n;
  for (int64_t r0 = 0; r0 < kBlock; r0 += R) {
    __m512 xv[R];
    for (int i = 0; i < R; ++i) xv[i] = _mm512_set1_ps(xb[r0 + i]);
    const bool first = r0 == 0, last = r0 + R == kBlock;
    for (int64_t c = c0; c < c1; c += 16 * NV) {
      float* sc = s_buf + (c - c0);
      __m512 acc[NV];
      for (int v = 0; v < NV; ++v) acc[v] = first ? _mm512_setzero_ps() : _mm512_load_ps(sc + 16 * v);
      for (int i = 0; i < R; ++i) {
        const int8_t* qr = qb + (r0 + i) * p.n + c;
        _mm_prefetch(reinterpret_cast<const char*>(qr + kStreamAheadL2), _MM_HINT_T1);
        for (int v = 0; v < NV; ++v) acc[v] = _mm512_fmadd_ps(xv[i], Load16(qr + 16 * v), acc[v]);
      }
      if (!last) {
        for (int v = 0; v < NV; ++v) _mm512_store_ps(sc + 16 * v, acc[v]);
        continue;
      }
      for (int v = 0; v < NV; ++v) {
        float* yc = yr + c + 16 * v;
        _mm512_storeu_ps(yc, _mm512_fmadd_ps(LoadScale16(p, b, c + 16 * v), acc[v], _mm512_loadu_ps(yc)));
      }
    }
  }
}

// Columns [n0, n1) for x rows [m0, m0 + mg), block by block. One row against at least 64
// columns streams q (StreamBlock16), as on AVX2. Otherwise in 64-column
// stretches (one cache line of each q row): mg <= 6 is one mg x 64 tile
// (at most 24 accumulators + 4 q vectors), mg = 7, 8 two mg x 32 tiles, and
// mg > 8 converts the stretch to float32 once (8 KiB, L1) for 8 x 32 tiles.
// Then 16 columns at a time, and the last N % 16 scalar.
Q8_AVX512 void ColumnsAvx512(const Problem& p, int64_t n0, int64_t n1, int64_t m0, int64_t mg) {
  const int64_t w = n1 - n0;
  const int64_t n64 = n0 + (w & ~int64_t{63});
  const int64_t n16 = n0 + (w & ~int64_t{15});
  const bool stream = mg == 1 && w >= 64;  // as on AVX2 (StreamBlock1's comment has the times)
  for (int64_t b = 0; b < p.k / kBlock; ++b) {
    if (stream) {  // one x row: q streamed a few whole rows at a time (StreamBlock16)
      alignas(64) float s_buf[kStreamColumns];
      for (int64_t c = n0; c < n64; c += kStreamColumns)
        StreamBlock16<kStreamRows, 4>(p, b, c, std::min(n64, c + kStreamColumns), m0, s_buf);
    }
    for (int64_t c = n0; c < n64 && !stream; c += 64) {
      if (mg <= 6) {
        Tile16Rows<4>(mg, p, b, c, m0);
      } else if (mg <= 8) {
        Tile16Rows<2>(mg, p, b, c, m0);
        Tile16Rows<2>(mg, p, b, c + 32, m0);
      } else {
        alignas(64) float f[kBlock * 64];
        for (int64_t i = 0; i < kBlock; ++i) {
          const int8_t* qr = p.q + (b * kBlock + i) * p.n + c;
          _mm_prefetch(reinterpret_cast<const char*>(qr + kPrefetch), _MM_HINT_T0);
          for (int v = 0; v < 4; ++v) _mm512_store_ps(f + i * 64 + 16 * v, Load16(qr + 16 * v));
        }
        for (int64_t cv = c; cv < c + 64; cv += 32)
          for (int64_t r = 0; r < mg; r += 8)
            TileF16Rows<2>(std::min<int64_t>(8, mg - r), p, b, f, c, cv, m0 + r);
      }
    }
    for (int64_t c = n64; c < n16; c += 16)  // the last < 64 columns, 16 at a time
      for (int64_t r = 0; r < mg; r += 8)
        Tile16Rows<1>(std::min<int64_t>(8, mg - r), p, b, c, m0 + r);
    for (int64_t c = n16; c < n1; ++c) {  // the last < 16 columns, scalar
      const float d = ScaleAt(p, b, c);
      for (int64_t r = 0; r < mg; ++r) {
        const float* x = p.x + (m0 + r) * p.ldx + b * kBlock;
        float acc = 0.0f;
        for (int64_t i = 0; i < kBlock; ++i)
          acc = std::fma(x[i], static_cast<float>(p.q[(b * kBlock + i) * p.n + c]), acc);
        p.y[(m0 + r) * p.n + c] += d * acc;
      }
    }
  }
}

#endif  // Q8_X86

// Set through Q8GemvForceScalar: tests run the scalar path on a SIMD CPU.
std::atomic<bool> g_force_scalar{false};
// The path the last call ran (-1: none yet) and the threads it used, for tests and reports.
std::atomic<int> g_last_isa{-1};
std::atomic<int> g_last_threads{0};
// Whether the last Q8_0-activation product ran on VNNI (1) or scalar (0); -1: none yet.
std::atomic<int> g_last_act_vnni{-1};

// The best path this CPU supports.
Isa BestIsa() {
#if Q8_X86
  static const Isa best = [] {
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
          __builtin_cpu_supports("f16c")))
      return kScalar;
    return __builtin_cpu_supports("avx512f") ? kAvx512 : kAvx2;
  }();
  return best;
#else
  return kScalar;
#endif
}

// The path a call runs: $Q8RULES_CPU_ISA (avx512, avx2 or scalar; unset, empty
// or "auto": the best), capped at what the CPU supports, and scalar while
// Q8GemvForceScalar is on. Read on every call. False for an unknown value.
bool SelectIsa(Isa* isa) {
  Isa want = kAvx512;
  const char* env = std::getenv("Q8RULES_CPU_ISA");
  if (env != nullptr && *env != '\0' && std::strcmp(env, "auto") != 0) {
    if (std::strcmp(env, "avx512") == 0) {
      want = kAvx512;
    } else if (std::strcmp(env, "avx2") == 0) {
      want = kAvx2;
    } else if (std::strcmp(env, "scalar") == 0) {
      want = kScalar;
    } else {
      return false;
    }
  }
  if (g_force_scalar.load(std::memory_order_relaxed)) want = kScalar;
  *isa = std::min(want, BestIsa());
  return true;
}

// All x rows of p (groups of <= 16 rows), all columns, accumulated into p.y.
void Columns(const Problem& p) {
  std::vector<float> s;  // the scalar path's partial sums
  for (int64_t m0 = 0; m0 < p.m; m0 += kMaxRows) {
    const int64_t mg = std::min(kMaxRows, p.m - m0);
    if (p.xq != nullptr) {
      const int64_t nb = p.ldx / kBlock;
      const q8act::Int8Operands o{p.xq + m0 * p.ldx, p.dx + m0 * nb, p.xc + m0 * nb,
                                  p.q,               p.scale,        p.scale_f16,
                                  p.y + m0 * p.n,    mg,             p.k,
                                  p.n,               p.ldx,          nb};
      q8act::ColumnsInt8(o, p.vnni);
      continue;
    }
#if Q8_X86
    if (p.isa == kAvx512) {
      ColumnsAvx512(p, 0, p.n, m0, mg);
      continue;
    }
    if (p.isa == kAvx2) {
      ColumnsAvx2(p, 0, p.n, m0, mg);
      continue;
    }
#endif
    s.resize(static_cast<size_t>(mg * p.n));
    ColumnsScalar(p, 0, p.n, m0, mg, s.data());
  }
}

// Values of q x M a product multiplies: what its thread count and units follow.
int64_t WorkOf(const Problem& p) { return p.k * p.n * std::max<int64_t>(p.m, 1); }

// Unit i of p (its blocks [i * per_unit, (i + 1) * per_unit)), accumulated into acc.
void RunUnit(const Problem& p, int64_t per_unit, int64_t i, float* acc) {
  const int64_t blocks = p.k / kBlock;
  Columns(Blocks(p, i * per_unit, std::min(blocks, (i + 1) * per_unit), acc));
}

// y (M x N) += a unit's accumulator.
void AddInto(float* y, const std::vector<float>& acc) {
  for (size_t i = 0; i < acc.size(); ++i) y[i] += acc[i];
}

// Work shared between the caller and the pool's threads. K is cut into a fixed
// number of runs of blocks (units); whoever increments `next` to i does unit i,
// over all N columns (each q row is read as one contiguous run), into unit i's
// own accumulator: unit 0's is y, unit i's (i > 0) a zeroed M x N buffer. When
// every unit is done the caller adds the buffers into y in unit order. Units are
// claimed dynamically, so a helper that starts late (or shares its core with
// another process) just does fewer, and the result does not depend on who did
// which: the units are fixed by the problem (BlocksPerUnit) and their sums added
// in one order, so the output is the same bit for bit on every run, with any
// number of threads (one included: it runs every unit), in every process.
struct Shared {
  Problem p;
  int64_t units = 1;
  int64_t blocks_per_unit = 1;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::vector<std::vector<float>> partial;  // unit i's accumulator is partial[i - 1]

  // Claim and run units until none is left.
  void Work() {
    for (int64_t i = next.fetch_add(1); i < units; i = next.fetch_add(1)) {
      float* acc = p.y;
      if (i > 0) {
        auto& buf = partial[static_cast<size_t>(i - 1)];
        buf.assign(static_cast<size_t>(p.m * p.n), 0.0f);
        acc = buf.data();
      }
      RunUnit(p, blocks_per_unit, i, acc);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// The CPUs this process may run on (its affinity mask, e.g. under taskset),
// else the hardware's threads.
int64_t UsableCpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max<unsigned>(1, std::thread::hardware_concurrency());
}

// Values of q x M per thread worth waking (and per unit of work: below two of them a
// product is one unit, on the calling thread).
constexpr int64_t kWorkPerThread = int64_t{1} << 16;

// The 32-row blocks in each unit K is cut into (see Shared): a function of the
// problem alone, not of the threads, so the output is the same bit for bit whatever
// the pool, the CPU count or the scheduling. About 8 units at decode sizes
// (M <= 16: each unit's buffer, M x N floats, is small next to q), 4 for more rows;
// one unit (no buffers) for a small product.
int64_t BlocksPerUnit(const Problem& p) {
  const int64_t blocks = p.k / kBlock;
  if (WorkOf(p) < 2 * kWorkPerThread) return blocks;
  const int64_t want = std::min(blocks, int64_t{p.m <= kMaxRows ? 8 : 4});
  return (blocks + want - 1) / want;
}

// Threads worth using: one per kWorkPerThread values of q x M, at most the pool's threads
// plus the caller and the CPUs this process may use. (One per 1 MiB left
// SmolLM-135M's 576-wide layers on one thread at decode: 2 threads decoded it at
// 41-44 tokens/s with 1 MiB, 63-67 with 64 Ki, 51-58 with 32 Ki; RESULTS.md.)
int64_t Threads(const Problem& p, int64_t pool_threads) {
  int64_t t = std::max<int64_t>(1, WorkOf(p) / kWorkPerThread);
  t = std::min<int64_t>(t, pool_threads + 1);
  t = std::min<int64_t>(t, p.k / kBlock);
  if (t > 1) t = std::min<int64_t>(t, UsableCpus());
  return std::max<int64_t>(t, 1);
}

// The product on x (M, K), q (K, N), scale (K/32, N) given as their dimensions (the trailing two
// of q's and scale's) and first elements; y (M, N).
// The product p (y zeroed) on the caller and up to the pool's threads, in units (Shared).
void Compute(ffi::ThreadPool& pool, const Problem& p) {
  const int64_t blocks = p.k / kBlock;
  const int64_t per_unit = BlocksPerUnit(p);
  const int64_t units = (blocks + per_unit - 1) / per_unit;
  const int64_t threads = std::min(units, Threads(p, pool.num_threads()));
  g_last_threads.store(static_cast<int>(threads), std::memory_order_relaxed);
  if (units == 1) {
    Columns(p);
    return;
  }
  if (threads == 1) {  // the units one after another: unit 0 into y, each other one into
    // one reused buffer added into y as it is done (the sums, and so y, as with threads)
    RunUnit(p, per_unit, 0, p.y);
    std::vector<float> buf(static_cast<size_t>(p.m * p.n));
    for (int64_t i = 1; i < units; ++i) {
      std::fill(buf.begin(), buf.end(), 0.0f);
      RunUnit(p, per_unit, i, buf.data());
      AddInto(p.y, buf);
    }
    return;
  }
  auto shared = std::make_shared<Shared>();
  shared->p = p;
  shared->blocks_per_unit = per_unit;
  shared->units = units;
  shared->partial.resize(static_cast<size_t>(units - 1));
  // The helpers hold the shared state, so one that wakes up after the caller
  // has done every unit finds nothing to claim and touches no buffer.
  for (int64_t t = 1; t < threads; ++t) {
    pool.Schedule([shared] { shared->Work(); });
  }
  shared->Work();
  // Wait for the units the helpers claimed (at most one each is still running).
  for (int spins = 0; shared->done.load(std::memory_order_acquire) < shared->units; ++spins) {
#if Q8_X86
    if (spins < 4096) {
      _mm_pause();
      continue;
    }
#endif
    std::this_thread::yield();
  }
  for (const auto& buf : shared->partial) AddInto(p.y, buf);  // in unit order
  return;
}

ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Span<const int64_t> qd,
               const int8_t* q, ffi::Span<const int64_t> sd, ffi::DataType scale_type,
               const void* scale, ffi::Result<ffi::Buffer<ffi::F32>>& y, bool act_q8) {
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sd.size() != 2 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("q8_gemv: x, q, scale and y must be 2-D");
  }
  Problem p;
  p.m = xd[0];
  p.k = xd[1];
  p.n = qd[1];
  p.ldx = p.k;
  if (qd[0] != p.k || p.k % kBlock != 0 || sd[0] != p.k / kBlock || sd[1] != p.n ||
      yd[0] != p.m || yd[1] != p.n) {
    return ffi::Error::InvalidArgument(
        "q8_gemv: expected x (M, K), q (K, N), scale (K/32, N), y (M, N), K a multiple of 32");
  }
  if (scale_type == ffi::DataType::F32) {
    p.scale_f16 = false;
  } else if (scale_type == ffi::DataType::F16) {
    p.scale_f16 = true;
  } else {
    return ffi::Error::InvalidArgument("q8_gemv: scale must be float32 or float16");
  }
  p.x = x.typed_data();
  p.q = q;
  p.scale = scale;
  p.y = y->typed_data();
  if (!SelectIsa(&p.isa)) {
    return ffi::Error::InvalidArgument(
        "q8_gemv: $Q8RULES_CPU_ISA must be avx512, avx2, scalar or auto");
  }
  g_last_isa.store(p.isa, std::memory_order_relaxed);
  std::fill(p.y, p.y + p.m * p.n, 0.0f);
  if (p.m == 0 || p.n == 0 || p.k == 0) return ffi::Error::Success();
  std::vector<int8_t> xq;
  std::vector<float> dx;
  std::vector<int32_t> xc;
  if (act_q8) {  // Q8_0 activations, once for every thread's share (q8_act_int8.h)
    p.vnni = p.isa == kAvx512 && q8act::HasVnni();
    xq.resize(static_cast<size_t>(p.m * p.k));
    dx.resize(static_cast<size_t>(p.m * (p.k / kBlock)));
    xc.resize(dx.size());
    q8act::QuantizeRows(p.x, p.m, p.k, p.ldx, xq.data(), dx.data(), xc.data(), p.vnni);
    p.xq = xq.data();
    p.dx = dx.data();
    p.xc = xc.data();
    g_last_act_vnni.store(p.vnni ? 1 : 0, std::memory_order_relaxed);
  }
  Compute(pool, p);
  if (act_q8) q8act::UnpermuteColumns(p.y, p.m, p.n);
  return ffi::Error::Success();
}


template <bool kActQ8>
ffi::Error Q8GemvImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                      ffi::AnyBuffer scale, ffi::ResultBuffer<ffi::F32> y) {
  return Run(pool, x, q.dimensions(), q.typed_data(), scale.dimensions(), scale.element_type(),
             scale.untyped_data(), y, kActQ8);
}

// Layer `layer` of stacked q (L, K, N) and scale (L, K/32, N), read in place (no slice copied).
template <bool kActQ8>
ffi::Error Q8GemvLayerImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                           ffi::AnyBuffer scale, ffi::Buffer<ffi::S32> layer,
                           ffi::ResultBuffer<ffi::F32> y) {
  const auto qd = q.dimensions();
  const auto sd = scale.dimensions();
  if (qd.size() != 3 || sd.size() != 3 || sd[0] != qd[0] || layer.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "q8_gemv_layer: expected q (L, K, N), scale (L, K/32, N) and one int32 layer index");
  }
  const int64_t i = layer.typed_data()[0];
  if (i < 0 || i >= qd[0]) {
    return ffi::Error::InvalidArgument("q8_gemv_layer: layer index " + std::to_string(i) +
                                       " outside [0, " + std::to_string(qd[0]) + ")");
  }
  const int64_t q_layer = qd[1] * qd[2];
  const int64_t s_layer = sd[1] * sd[2];
  const int64_t s_bytes = scale.element_type() == ffi::DataType::F16 ? 2 : 4;
  const auto* s = static_cast<const char*>(scale.untyped_data()) + i * s_layer * s_bytes;
  return Run(pool, x, qd.last(2), q.typed_data() + i * q_layer, sd.last(2),
             scale.element_type(), s, y, kActQ8);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Q8Gemv, Q8GemvImpl<false>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (M, K)
                                  .Arg<ffi::Buffer<ffi::S8>>()   // q (K, N)
                                  .Arg<ffi::AnyBuffer>()         // scale (K/32, N) f32 / f16
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y (M, N)
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(Q8GemvLayer, Q8GemvLayerImpl<false>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (M, K)
                                  .Arg<ffi::Buffer<ffi::S8>>()   // q (L, K, N)
                                  .Arg<ffi::AnyBuffer>()         // scale (L, K/32, N) f32 / f16
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer () int32
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y (M, N)
);

// The same products with Q8_0 activations (q8_act_int8.h).
XLA_FFI_DEFINE_HANDLER_SYMBOL(Q8GemvActQ8, Q8GemvImpl<true>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (M, K)
                                  .Arg<ffi::Buffer<ffi::S8>>()   // q (K, N)
                                  .Arg<ffi::AnyBuffer>()         // scale (K/32, N) f32 / f16
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y (M, N)
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(Q8GemvActQ8Layer, Q8GemvLayerImpl<true>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (M, K)
                                  .Arg<ffi::Buffer<ffi::S8>>()   // q (L, K, N)
                                  .Arg<ffi::AnyBuffer>()         // scale (L, K/32, N) f32 / f16
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer () int32
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y (M, N)
);

namespace {

// One new token's attention over layer `slot` of the cache, positions [0, pos] (clamped to the
// cache's length): decode_attention.h.
ffi::Error DecodeAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::S32> pos,
                               ffi::Result<ffi::Buffer<ffi::F32>> out, float scale,
                               float softcap) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const auto od = out->dimensions();
  bool ok = qd.size() == 3 && kd.size() == 5 && vd.size() == 5 && od.size() == 3 &&
            k.element_type() == v.element_type();
  for (size_t i = 0; ok && i < 5; ++i) ok = kd[i] == vd[i];
  ok = ok && qd[0] == kd[1] && qd[2] == kd[4] && kd[3] > 0 && qd[1] % kd[3] == 0 &&
       od[0] == qd[0] && od[1] == qd[1] && od[2] == qd[2] && kd[2] > 0;
  if (!ok) {
    return ffi::Error::InvalidArgument(
        "q8_decode_attention: expected q (B, H, D), keys and values (L, B, S, KV, D) of one "
        "type, H a multiple of KV, out (B, H, D)");
  }
  const int64_t layers = kd[0], batch = kd[1], length = kd[2], kv_heads = kd[3], d = kd[4];
  const int64_t layer = slot.typed_data()[0];
  if (layer < 0 || layer >= layers) {
    return ffi::Error::InvalidArgument("q8_decode_attention: the layer is outside the cache");
  }
  const int64_t n = std::clamp<int64_t>(int64_t{pos.typed_data()[0]} + 1, 1, length);
  const int64_t offset = layer * batch * length * kv_heads * d;
  if (k.element_type() == ffi::DataType::F32) {
    q8attn::DecodeAttention(q.typed_data(), static_cast<const float*>(k.untyped_data()) + offset,
                            static_cast<const float*>(v.untyped_data()) + offset,
                            out->typed_data(), batch, length, kv_heads, qd[1], d, n, scale,
                            softcap);
  } else if (k.element_type() == ffi::DataType::BF16) {
    q8attn::DecodeAttention(q.typed_data(), static_cast<const uint16_t*>(k.untyped_data()) + offset,
                            static_cast<const uint16_t*>(v.untyped_data()) + offset,
                            out->typed_data(), batch, length, kv_heads, qd[1], d, n, scale,
                            softcap);
  } else {
    return ffi::Error::InvalidArgument("q8_decode_attention: the cache must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Q8DecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q (B, H, D)
                                  .Arg<ffi::AnyBuffer>()         // keys (L, B, S, KV, D)
                                  .Arg<ffi::AnyBuffer>()         // values (L, B, S, KV, D)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot () int32: the layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos () int32: the new token's
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out (B, H, D)
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
);

namespace {

// The 16 x 16 int8 block at s (row stride ls) transposed into d (row stride ld): four rounds of
// SSE2 unpacks (baseline on x86-64); the column a result register holds is its index with the
// four bits reversed. Elsewhere, element by element.
void Transpose16(const int8_t* s, int64_t ls, int8_t* d, int64_t ld) {
#if Q8_X86
  static constexpr int kColumn[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  __m128i x[16], t[16];
  for (int i = 0; i < 16; ++i) x[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i * ls));
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm_unpacklo_epi8(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = _mm_unpackhi_epi8(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 2; ++j) {
      x[4 * i + j] = _mm_unpacklo_epi16(t[4 * i + j], t[4 * i + j + 2]);
      x[4 * i + j + 2] = _mm_unpackhi_epi16(t[4 * i + j], t[4 * i + j + 2]);
    }
  }
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm_unpacklo_epi32(x[8 * i + j], x[8 * i + j + 4]);
      t[8 * i + j + 4] = _mm_unpackhi_epi32(x[8 * i + j], x[8 * i + j + 4]);
    }
  }
  for (int j = 0; j < 8; ++j) {
    x[j] = _mm_unpacklo_epi64(t[j], t[j + 8]);
    x[j + 8] = _mm_unpackhi_epi64(t[j], t[j + 8]);
  }
  for (int k = 0; k < 16; ++k) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + kColumn[k] * ld), x[k]);
  }
#else
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 16; ++c) d[c * ld + r] = s[r * ls + c];
  }
#endif
}

// Rows [r0, r1) of one (N = rows, K = nb * 32) tensor of 34-byte Q8_0 blocks `s` (a float16
// scale, then 32 int8 values), transposed: the values into dq (K, ldq), the scales' bits into
// ds (nb, lds) when ds is not null. Block column by block column for 16 rows at a time (each
// block's 32 values two 16 x 16 tiles), the rows past the last multiple of 16 element by
// element.
void RepackRows(const uint8_t* s, int8_t* dq, uint16_t* ds, int64_t r0, int64_t r1, int64_t nb,
                int64_t ldq, int64_t lds) {
  constexpr int64_t kBlockBytes = 34;
  const int64_t row_bytes = nb * kBlockBytes;
  int64_t r = r0;
  for (; r + 16 <= r1; r += 16) {
    for (int64_t j = 0; j < nb; ++j) {
      const uint8_t* blk = s + r * row_bytes + j * kBlockBytes;
      for (int h = 0; h < 2; ++h) {
        Transpose16(reinterpret_cast<const int8_t*>(blk + 2 + 16 * h), row_bytes,
                    dq + (j * kBlock + 16 * h) * ldq + r, ldq);
      }
      if (ds != nullptr) {
        for (int i = 0; i < 16; ++i) std::memcpy(ds + j * lds + r + i, blk + i * row_bytes, 2);
      }
    }
  }
  for (; r < r1; ++r) {
    for (int64_t j = 0; j < nb; ++j) {
      const uint8_t* blk = s + r * row_bytes + j * kBlockBytes;
      for (int64_t i = 0; i < kBlock; ++i) {
        dq[(j * kBlock + i) * ldq + r] = static_cast<int8_t>(blk[2 + i]);
      }
      if (ds != nullptr) std::memcpy(ds + j * lds + r, blk, 2);
    }
  }
}

}  // namespace

// Q8_0 tensors as a GGUF file stores them, into the kernel layout: tensor i (N = rows,
// K = nb * 32: rows of nb 34-byte blocks, a float16 scale, then 32 int8 values) starts at
// blocks[i]; dq + i * q_stride gets its (K, rows) int8 values with a row stride of ldq >= rows,
// and ds + i * s_stride (when ds is not null) its scales' float16 bits (nb, rows) with a row
// stride of lds >= rows: so a column range of wider matrices (load_gguf's fused q | k | v and
// gate | up), and the layers of a stack in one call. Read straight from the file's blocks (the
// GGUF loader's one copy of the values and scales) on up to `threads` threads, started once a
// call: whole tensors to each thread when there are several, else the rows of the one tensor
// in runs of 64 (so no two threads write one cache line of dq). A thread a tensor of
// SmolLM-135M's layers (0.35 MB), or rows cut at multiples of 16, took 1.5-2.5x one thread's
// time on a 2-core VM: a started thread costs 40-70 us there, and threads writing
// the same lines of dq contend for them.
extern "C" void Q8RepackKernelBatch(const uint8_t* const* blocks, int8_t* dq, uint16_t* ds,
                                    int64_t batch, int64_t rows, int64_t nb, int64_t ldq,
                                    int64_t lds, int64_t q_stride, int64_t s_stride,
                                    int64_t threads) {
  auto tensors = [=](int64_t i0, int64_t i1, int64_t r0, int64_t r1) {
    for (int64_t i = i0; i < i1; ++i)
      RepackRows(blocks[i], dq + i * q_stride, ds == nullptr ? nullptr : ds + i * s_stride, r0,
                 r1, nb, ldq, lds);
  };
  std::vector<std::thread> helpers;
  if (batch > 1) {
    const int64_t parts = std::max<int64_t>(1, std::min(threads, batch));
    for (int64_t t = 1; t < parts; ++t)
      helpers.emplace_back(tensors, t * batch / parts, (t + 1) * batch / parts, 0, rows);
    tensors(0, batch / parts, 0, rows);
  } else if (batch == 1) {
    constexpr int64_t kRun = 64;  // rows: one cache line of each dq row
    const int64_t parts = std::max<int64_t>(1, std::min(threads, rows / kRun));
    const int64_t per = (rows / parts + kRun - 1) / kRun * kRun;
    for (int64_t t = 1; t < parts; ++t) {
      const int64_t r0 = std::min(rows, t * per), r1 = t + 1 == parts ? rows : std::min(rows, r0 + per);
      if (r0 < r1) helpers.emplace_back(tensors, 0, 1, r0, r1);
    }
    tensors(0, 1, 0, parts > 1 ? std::min(rows, per) : rows);
  }
  for (auto& t : helpers) t.join();
}

// Whether a call would run a SIMD path (AVX2 or AVX-512) on this CPU now.
extern "C" int Q8GemvHasAvx2() {
  Isa isa;
  return SelectIsa(&isa) && isa != kScalar ? 1 : 0;
}

// Force (1) or stop forcing (0) the scalar path, whatever the CPU supports.
extern "C" void Q8GemvForceScalar(int force) { g_force_scalar.store(force != 0); }

// The best path this CPU supports: 0 scalar, 1 avx2, 2 avx512.
extern "C" int Q8GemvBestIsa() { return BestIsa(); }

// The path the next call would run (as above), or -1 if $Q8RULES_CPU_ISA is invalid.
extern "C" int Q8GemvSelectedIsa() {
  Isa isa;
  return SelectIsa(&isa) ? isa : -1;
}

// The path the last call ran, or -1 before the first call.
extern "C" int Q8GemvLastIsa() { return g_last_isa.load(); }

// The threads the last call used (the caller and pool helpers), 0 before the first call.
extern "C" int Q8GemvLastThreads() { return g_last_threads.load(); }

// 1: the last Q8_0-activation product ran on AVX-512 VNNI; 0: scalar; -1: none has run.
extern "C" int Q8GemvLastActVnni() { return g_last_act_vnni.load(); }

// Whether this CPU has the Q8_0-activation product's VNNI path.
extern "C" int Q8GemvHasVnni() { return q8act::HasVnni() ? 1 : 0; }

// Q8_0 of x (m, k) as the Q8_0-activation product quantizes it: int8 values, scales (the
// float16 d widened) and -128 * block sums; on AVX-512 when `simd` (and the CPU has it), else
// scalar. For tests against gguf.quants.
extern "C" void Q8QuantizeActivations(const float* x, int64_t m, int64_t k, int8_t* xq,
                                      float* dx, int32_t* xc, int simd) {
  q8act::QuantizeRows(x, m, k, k, xq, dx, xc, simd != 0 && q8act::HasVnni());
}

// The name of path `isa` ("scalar", "avx2", "avx512"), or "" if there is none.
extern "C" const char* Q8GemvIsaName(int isa) {
  return isa >= 0 && isa <= kAvx512 ? kIsaNames[isa] : "";
}
