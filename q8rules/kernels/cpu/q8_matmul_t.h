// The transposed Q8_0 product on the CPU (op 'matmul_t': the gradient of x @ W with respect
// to x):
//   y (M, K) f32 = dy (M, N) f32 @ W^T,  W[k, n] = q[k, n] * scale[k / 32, n],
// q int8 (K, N) row-major, scale float32 or float16 (K/32, N). The contraction runs along N,
// across the Q8_0 blocks, so each output y[r, k] is one dot over a q row, which the (K, N)
// layout stores contiguously: for each k, w = q[k, :] * scale[k / 32, :] (float32, one
// rounding per value, as a dequantised weight holds it) is formed a vector at a time and
// folded into one float32 accumulator per dy row (FMA, lanes summed at the end in a fixed
// order, then the N % lanes tail). No float weight is kept: a q row is converted in registers
// and used by a tile of dy rows. Threads take runs of k rows; each y element is computed by
// one thread in one order, so the output does not depend on the threads. The path (AVX-512,
// AVX2 or scalar on x86-64; NEON or scalar on aarch64) is the weight-only product's (isa.h:
// $Q8RULES_CPU_ISA).

#ifndef Q8RULES_Q8_MATMUL_T_H_
#define Q8RULES_Q8_MATMUL_T_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "q8_matmul.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace q8mmt {
namespace {

namespace ffi = xla::ffi;

constexpr int64_t kBlock = 32;          // Q8_0 rows per scale
constexpr int64_t kRowsPerUnit = 64;    // k rows a thread claims at a time (at the least)

struct Transposed {
  const float* dy;    // (M, N)
  const int8_t* q;    // (K, N)
  const void* scale;  // (K/32, N) float32 or float16
  bool scale_f16;
  float* y;           // (M, K)
  int64_t m, k, n;
  q8mm::Isa isa;
};

inline float ScaleOf(const Transposed& p, int64_t i) {
  if (p.scale_f16) return q8mm::HalfToFloat(static_cast<const uint16_t*>(p.scale)[i]);
  return static_cast<const float*>(p.scale)[i];
}

// dy row r . w over columns [j0, N), w[j] = q[k, j] * scale[k/32, j]: the tail after the vectors.
inline float TailDot(const Transposed& p, int64_t r, int64_t k, int64_t j0, float s) {
  const int8_t* qr = p.q + k * p.n;
  const float* dr = p.dy + r * p.n;
  const int64_t srow = (k / kBlock) * p.n;
  for (int64_t j = j0; j < p.n; ++j) {
    s += dr[j] * (static_cast<float>(qr[j]) * ScaleOf(p, srow + j));
  }
  return s;
}

// Rows [k0, k1) of y's columns, scalar: one float32 sum per (r, k), columns in order.
inline void RowsScalar(const Transposed& p, int64_t k0, int64_t k1) {
  for (int64_t k = k0; k < k1; ++k) {
    for (int64_t r = 0; r < p.m; ++r) p.y[r * p.k + k] = TailDot(p, r, k, 0, 0.0f);
  }
}

#if Q8_X86 || Q8_ARM
// Rows [k0, k1) of y's columns on vector type Vec (simd.h): for each k, dy rows in tiles of
// Vec::kTileRows, one accumulator vector per row; each w vector is formed once per tile and
// used by all its rows. A short last tile repeats its first row in the unused slots (their
// sums are dropped), so the tile is always full width. Always inlined into RowsAvx2 and
// RowsAvx512, which carry the x86 targets, and RowsNeon, so its vectors never cross a call
// (GCC's -Wpsabi note on the template itself, compiled without the x86 targets, is about an
// ABI no call uses).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
template <class Vec>
Q8_ALWAYS_INLINE void RowsSimd(const Transposed& p, int64_t k0, int64_t k1) {
  using V = typename Vec::V;
  constexpr int64_t kLanes = Vec::kLanes;
  constexpr int64_t kTile = Vec::kTileRows;
  const int64_t nv = p.n / kLanes * kLanes;
  for (int64_t k = k0; k < k1; ++k) {
    const int8_t* qr = p.q + k * p.n;
    const int64_t srow = (k / kBlock) * p.n;
    for (int64_t r0 = 0; r0 < p.m; r0 += kTile) {
      const int64_t rows = std::min(kTile, p.m - r0);
      const float* dr[kTile];
      V acc[kTile];
      for (int64_t i = 0; i < kTile; ++i) {
        dr[i] = p.dy + (r0 + (i < rows ? i : 0)) * p.n;
        acc[i] = Vec::Zero();
      }
      for (int64_t j = 0; j < nv; j += kLanes) {
        const V w = Vec::Mul(Vec::Load(qr + j), Vec::Scale(p.scale, p.scale_f16, srow + j));
        for (int64_t i = 0; i < kTile; ++i) acc[i] = Vec::Fma(Vec::LoadU(dr[i] + j), w, acc[i]);
      }
      for (int64_t i = 0; i < rows; ++i) {
        p.y[(r0 + i) * p.k + k] = TailDot(p, r0 + i, k, nv, Vec::Sum(acc[i]));
      }
    }
  }
}
#pragma GCC diagnostic pop
#endif  // Q8_X86 || Q8_ARM

#if Q8_X86
Q8_AVX2 inline void RowsAvx2(const Transposed& p, int64_t k0, int64_t k1) {
  RowsSimd<q8simd::Avx2>(p, k0, k1);
}

Q8_AVX512 inline void RowsAvx512(const Transposed& p, int64_t k0, int64_t k1) {
  RowsSimd<q8simd::Avx512>(p, k0, k1);
}
#elif Q8_ARM
inline void RowsNeon(const Transposed& p, int64_t k0, int64_t k1) {
  RowsSimd<q8simd::Neon>(p, k0, k1);
}
#endif

// Rows [k0, k1) of y's columns on p's path.
inline void Rows(const Transposed& p, int64_t k0, int64_t k1) {
#if Q8_X86
  if (p.isa == q8mm::kAvx512) return RowsAvx512(p, k0, k1);
  if (p.isa == q8mm::kAvx2) return RowsAvx2(p, k0, k1);
#elif Q8_ARM
  if (p.isa == q8mm::kNeon || p.isa == q8mm::kNeonDot) return RowsNeon(p, k0, k1);
#endif
  RowsScalar(p, k0, k1);
}

// Runs of k rows claimed by the caller and the pool's threads until none is left.
struct Claims {
  Transposed p;
  int64_t rows_per_unit = kRowsPerUnit;
  int64_t units = 1;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};

  void Take() {
    int64_t i = next.fetch_add(1);
    while (i < units) {
      const int64_t k0 = i * rows_per_unit;
      Rows(p, k0, std::min(p.k, k0 + rows_per_unit));
      finished.fetch_add(1, std::memory_order_release);
      i = next.fetch_add(1);
    }
  }
};

// y = dy @ W^T on the caller and up to the pool's threads: one per q8mm::kWorkPerThread values
// of q x M (the weight-only product's rule), at most the CPUs this process may use. `pool`:
// XLA's, or any type with its Schedule(f) and num_threads() (q8mm::Share).
template <typename Pool>
inline void Compute(Pool& pool, const Transposed& p) {
  const int64_t work = p.k * p.n * std::max<int64_t>(p.m, 1);
  int64_t threads = std::max<int64_t>(1, work / q8mm::kWorkPerThread);
  threads = std::min<int64_t>({threads, pool.num_threads() + 1, q8mm::UsableCpus(),
                               (p.k + kRowsPerUnit - 1) / kRowsPerUnit});
  q8mm::g_last_threads.store(static_cast<int>(std::max<int64_t>(threads, 1)),
                             std::memory_order_relaxed);
  if (threads <= 1) {
    Rows(p, 0, p.k);
    return;
  }
  auto claims = std::make_shared<Claims>();
  claims->p = p;
  // About 4 runs per thread, whole blocks of rows, at least kRowsPerUnit rows each.
  const int64_t per = (p.k + 4 * threads - 1) / (4 * threads);
  claims->rows_per_unit = std::max(kRowsPerUnit, (per + kBlock - 1) / kBlock * kBlock);
  claims->units = (p.k + claims->rows_per_unit - 1) / claims->rows_per_unit;
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([claims] { claims->Take(); });
  claims->Take();
  // The helpers hold `claims`: one that starts after every run is taken finds none left.
  while (claims->finished.load(std::memory_order_acquire) < claims->units) {
    std::this_thread::yield();
  }
}

// The FFI handler: dy (M, N) f32, q (K, N) int8, scale (K/32, N) f32 / f16 -> y (M, K) f32.
inline ffi::Error Q8MatmulTImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> dy,
                                ffi::Buffer<ffi::S8> q, ffi::AnyBuffer scale,
                                ffi::ResultBuffer<ffi::F32> y) {
  const auto dd = dy.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  const auto yd = y->dimensions();
  if (dd.size() != 2 || qd.size() != 2 || sd.size() != 2 || yd.size() != 2) {
    return ffi::Error::InvalidArgument("q8_matmul_t: dy, q, scale and y must be 2-D");
  }
  Transposed p;
  p.m = dd[0];
  p.n = dd[1];
  p.k = qd[0];
  if (qd[1] != p.n || p.k % kBlock != 0 || sd[0] != p.k / kBlock || sd[1] != p.n ||
      yd[0] != p.m || yd[1] != p.k) {
    return ffi::Error::InvalidArgument(
        "q8_matmul_t: expected dy (M, N), q (K, N), scale (K/32, N), y (M, K), K a multiple "
        "of 32");
  }
  if (scale.element_type() != ffi::DataType::F32 && scale.element_type() != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument("q8_matmul_t: scale must be float32 or float16");
  }
  p.scale_f16 = scale.element_type() == ffi::DataType::F16;
  p.dy = dy.typed_data();
  p.q = q.typed_data();
  p.scale = scale.untyped_data();
  p.y = y->typed_data();
  if (!q8isa::Select(&p.isa)) return ffi::Error::InvalidArgument(q8isa::BadEnv("q8_matmul_t"));
  q8mm::g_last_isa.store(p.isa, std::memory_order_relaxed);
  std::fill(p.y, p.y + p.m * p.k, 0.0f);
  if (p.m == 0 || p.k == 0) return ffi::Error::Success();
  Compute(pool, p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace q8mmt

#endif  // Q8RULES_Q8_MATMUL_T_H_
