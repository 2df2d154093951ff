// The weight-only Q8_0 product on the CPU (op 'matmul', and the Q8_0-activation product's
// driver: q8_act_int8.h):
//   y (M, N) f32 = x (M, K) f32 @ W,  W[k, n] = q[k, n] * scale[k / 32, n],
// q int8 (K, N) row-major, scale float32 or float16 (K/32, N). Numerics are the fold's: per
// 32-row block b, s[n] = sum_i x[32b + i] q[32b + i, n] in float32 (FMA), then
// y[n] += scale[b, n] * s[n]. Decode-sized M is bound by reading q, so q is read once,
// converted to float32 in registers, and used by every x row. Paths (AVX-512, AVX2 or scalar
// on x86-64; NEON or scalar on aarch64, where both NEON rungs run the same float code; the
// same block order) are picked at run time from the CPU and $Q8RULES_CPU_ISA; the SIMD tiles
// are q8_tiles.h, written once for every vector width. Design measurements are in
// benchmarks/RESULTS.md.

#ifndef Q8RULES_Q8_MATMUL_H_
#define Q8RULES_Q8_MATMUL_H_

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

#include "helper_threads.h"
#include "isa.h"
#include "q8_act_int8.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace q8mm {
// Internal linkage, as one translation unit (library.cc) includes it: the compiler may then
// specialise the column loops for their call sites.
namespace {

namespace ffi = xla::ffi;

constexpr int64_t kBlock = 32;      // Q8_0 rows per scale
constexpr int64_t kMaxRows = 16;    // x rows sharing one read of q
// One x row streams q kStreamRows rows at a time over up to kStreamColumns columns
// (q8_tiles.h: StreamBlock), prefetching kStreamAheadL2 bytes ahead into L2.
constexpr int64_t kStreamRows = 8;
constexpr int64_t kStreamColumns = 4096;
constexpr int64_t kStreamAheadL2 = q8act::kStreamAheadL2;

// One product, all arrays row-major. A thread's share is a run of 32-row blocks: the same struct with x, q and
// scale advanced to its first block, k its rows, and y its own accumulator; or a stripe of
// columns, with y a stripe-sized accumulator (ldy its width, y_col its first column).
using q8isa::Isa;
using q8isa::kAvx2;
using q8isa::kAvx512;
using q8isa::kNeon;
using q8isa::kNeonDot;
using q8isa::kScalar;

struct Problem {
  const float* x;       // (M, k) with row stride ldx
  const int8_t* q;      // (k, N)
  const void* scale;    // (k/32, N) float32 or float16
  bool scale_f16;
  float* y;             // (M, N), accumulated into (+=): column c of row r at YAt(r, c)
  int64_t m, k, n;
  int64_t ldx;          // x's row stride (the full K)
  int64_t ldy = 0;      // y's row stride (N; a stripe's width for its partial sums)
  int64_t y_col = 0;    // the column y[0] holds (0; a stripe's first column)
  Isa isa;              // the path every thread runs
  // Q8_0 activations (q8_act_int8.h), else null: x's values (M, K), scales and -128 * block
  // sums (M, K/32), row strides ldx and ldx / 32; y is then stretch-permuted until the end.
  const int8_t* xq = nullptr;
  const float* dx = nullptr;
  const int32_t* xc = nullptr;
  Isa act_path = kScalar;  // the Q8_0-activation product's int8 path (q8act::PathFor)
};

// The blocks [b0, b1) of p, accumulating into y.
inline Problem Blocks(const Problem& p, int64_t b0, int64_t b1, float* y) {
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

// Where y keeps column col of x row `row`.
inline float* YAt(const Problem& p, int64_t row, int64_t col) {
  return p.y + (row * p.ldy + (col - p.y_col));
}

// IEEE half -> float without F16C (the scalar path).
inline float HalfToFloat(uint16_t h) { return q8act::HalfBitsToFloat(h); }

inline float ScaleAt(const Problem& p, int64_t b, int64_t col) {
  const int64_t i = b * p.n + col;
  if (p.scale_f16) return HalfToFloat(static_cast<const uint16_t*>(p.scale)[i]);
  return static_cast<const float*>(p.scale)[i];
}

// ---------------------------------------------------------------------------
// Scalar path (any CPU): the same block order as the SIMD paths.
// Columns [n0, n1), x rows [m0, m0 + mg). s: mg x (n1 - n0) floats.
// ---------------------------------------------------------------------------
inline void ColumnsScalar(const Problem& p, int64_t n0, int64_t n1, int64_t m0, int64_t mg,
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
      float* yr = YAt(p, m0 + r, n0);
      const float* sr = s + r * w;
      for (int64_t j = 0; j < w; ++j) yr[j] += ScaleAt(p, b, n0 + j) * sr[j];
    }
  }
}

#if Q8_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
using Vec = q8simd::Avx2;
#include "q8_tiles.h"
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#endif
namespace avx512 {
using Vec = q8simd::Avx512;
#include "q8_tiles.h"
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#elif Q8_ARM
namespace neon {  // Advanced SIMD is baseline on aarch64: no target to add
using Vec = q8simd::Neon;
#include "q8_tiles.h"
}  // namespace neon
#endif  // Q8_X86

// The path the last call ran (-1: none yet) and the threads it used, for tests and reports.
inline std::atomic<int> g_last_isa{-1};
inline std::atomic<int> g_last_threads{0};
// The path of the last Q8_0-activation product's int8 dots (q8act::Path); -1: none yet.
inline std::atomic<int> g_last_act_path{-1};

// All x rows of p (groups of <= 16 rows), columns [n0, n1) (every column on the Q8_0-activation
// path), accumulated into p.y.
inline void Columns(const Problem& p, int64_t n0, int64_t n1) {
  std::vector<float> s;  // the scalar path's partial sums
  for (int64_t m0 = 0; m0 < p.m; m0 += kMaxRows) {
    const int64_t mg = std::min(kMaxRows, p.m - m0);
    if (p.xq != nullptr) {
      const int64_t nb = p.ldx / kBlock;
      const q8act::Int8Operands o{p.xq + m0 * p.ldx, p.dx + m0 * nb, p.xc + m0 * nb,
                                  p.q,               p.scale,        p.scale_f16,
                                  p.y + m0 * p.n,    mg,             p.k,
                                  p.n,               p.ldx,          nb};
      q8act::ColumnsInt8(o, p.act_path);
      continue;
    }
#if Q8_X86
    if (p.isa == kAvx512) {
      avx512::Columns(p, n0, n1, m0, mg);
      continue;
    }
    if (p.isa == kAvx2) {
      avx2::Columns(p, n0, n1, m0, mg);
      continue;
    }
#elif Q8_ARM
    if (p.isa == kNeon || p.isa == kNeonDot) {
      neon::Columns(p, n0, n1, m0, mg);
      continue;
    }
#endif
    s.resize(static_cast<size_t>(mg * (n1 - n0)));
    ColumnsScalar(p, n0, n1, m0, mg, s.data());
  }
}

inline void Columns(const Problem& p) { Columns(p, 0, p.n); }

// Values of q x M a product multiplies: what its thread count and units follow.
inline int64_t WorkOf(const Problem& p) { return p.k * p.n * std::max<int64_t>(p.m, 1); }

// Unit i of p (its blocks [i * per_unit, (i + 1) * per_unit)), accumulated into acc.
inline void RunUnit(const Problem& p, int64_t per_unit, int64_t i, float* acc) {
  const int64_t blocks = p.k / kBlock;
  Columns(Blocks(p, i * per_unit, std::min(blocks, (i + 1) * per_unit), acc));
}

// y (M x N) += a unit's accumulator. Not inlined: GCC drops `restrict` from an inlined
// function's parameters and leaves this loop scalar there.
[[gnu::noinline]] inline void AddInto(float* __restrict y, const float* __restrict acc,
                                      size_t n) {
  for (size_t i = 0; i < n; ++i) y[i] += acc[i];
}

inline void AddInto(float* y, const std::vector<float>& acc) {
  AddInto(y, acc.data(), acc.size());
}

// Work shared between the caller and its helpers (helper_threads.h, else XLA's pool). K is
// cut into a fixed number of runs of blocks (units); whoever increments `next` to i does unit i,
// over all N columns (each q row is read as one contiguous run), into unit i's
// own accumulator: unit 0's is y, unit i's (i > 0) a zeroed M x N buffer. When
// every unit is done the caller adds the buffers into y in unit order. Units are
// claimed dynamically, so a helper that starts late (or shares its core with
// another process) just does fewer, and the result does not depend on who did
// which: the units are fixed by the problem (BlocksPerUnit) and their sums added
// in one order, so the output is the same bit for bit on every run, with any
// number of threads (one included: it runs every unit), in every process.
struct Shared final : q8helpers::Task {
  Problem p;
  int64_t units = 1;
  int64_t blocks_per_unit = 1;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::vector<std::vector<float>> partial;  // unit i's accumulator is partial[i - 1]

  // Claim and run units until none is left.
  void Run() override {
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

// Columns a stripe of a column-split product spans (Stripes): a multiple of 64, so each
// stripe's columns take the paths they take in the whole product. Each q row is read in 16 KiB
// runs, and y's stripe and a unit's partial sums (64 KiB each a row of x) stay in L2. On one
// core (CPU time a call, 2-core EPYC): Gemma 3's head 640 x 262144 6.9-7.3 ms against 7.9-8.8
// as units over all N, a 2048 x 128256 head 10.5-10.8 against 10.3-10.9; 4096-column stripes
// took 7.4-7.7 and 11.6-11.7 (each row's run one page), 32768 7.9-8.0 and 11.1-11.6.
constexpr int64_t kStripeColumns = 16384;

// Stripe i of p: every unit of K (BlocksPerUnit) in order over the stripe's columns, unit 0
// into y, each other one into `buf` (zeroed, M x the stripe's width) added into y as it is
// done: each column's sums are the units' over all of N (Shared), in the same order.
inline void RunStripe(const Problem& p, int64_t per_unit, int64_t units, int64_t width,
                      int64_t i, std::vector<float>& buf) {
  const int64_t blocks = p.k / kBlock;
  const int64_t n0 = i * width, n1 = std::min(p.n, n0 + width);
  const int64_t w = n1 - n0;
  Columns(Blocks(p, 0, std::min(blocks, per_unit), p.y), n0, n1);
  if (units == 1) return;
  buf.resize(static_cast<size_t>(p.m * w));
  Problem s = p;
  s.ldy = w;
  s.y_col = n0;
  for (int64_t u = 1; u < units; ++u) {
    std::fill(buf.begin(), buf.end(), 0.0f);
    Columns(Blocks(s, u * per_unit, std::min(blocks, (u + 1) * per_unit), buf.data()), n0, n1);
    for (int64_t r = 0; r < p.m; ++r)
      AddInto(YAt(p, r, n0), buf.data() + r * w, static_cast<size_t>(w));
  }
}

// A product whose units' (M, N) buffers would be large (a vocabulary's output head: 1 MiB a
// unit at N = 262144, M = 1), done as stripes of about kStripeColumns columns (StripeCount), claimed one at a time
// by the caller and its helpers (RunStripe). The sums are Shared's, so y is the same bit for
// bit; y and the partial sums of a stripe stay in the cache, where the units' buffers were
// written to memory, read back and added on the caller alone at the end.
struct Stripes final : q8helpers::Task {
  Problem p;
  int64_t units = 1;
  int64_t blocks_per_unit = 1;
  int64_t stripes = 1;
  int64_t width = kStripeColumns;  // columns a stripe (the last one may have fewer)
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() override {
    std::vector<float> buf;
    for (int64_t i = next.fetch_add(1); i < stripes; i = next.fetch_add(1)) {
      RunStripe(p, blocks_per_unit, units, width, i, buf);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Stripes of a striped product of n columns on `threads` threads: about kStripeColumns columns
// each, their count rounded up to a multiple of the threads so that every thread does as many
// (Gemma 3's 262,144-column head: 16 stripes; SmolLM2's 49,152-column one: 4 of 12,288 on 2
// threads, where 3 of 16,384 left one thread idle for a third of the product). Each column's
// sums do not depend on the stripe it falls in (RunStripe), so neither does y.
inline int64_t StripeCount(int64_t n, int64_t threads) {
  const int64_t stripes = (n + kStripeColumns - 1) / kStripeColumns;
  if (threads <= 1) return stripes;
  return (stripes + threads - 1) / threads * threads;
}

// Whether p runs as column stripes (Stripes) rather than units of K over all of N (Shared): on
// the float path, more than one stripe, and a unit's (M, N) buffer of kStripeMinValues values
// or more (256 KiB). Below that the buffers stay in cache and the whole rows stream faster:
// TinyLlama's 2048 x 11264 gate | up at M = 8 took 2.41 ms in 4096-column stripes against 2.22.
constexpr int64_t kStripeMinValues = int64_t{1} << 16;
inline bool Striped(const Problem& p, int64_t units) {
  return p.xq == nullptr && units > 1 && p.m * p.n >= kStripeMinValues &&
         p.n > kStripeColumns;
}

// The most threads one native call may run on, the caller included; 0: no limit but the CPUs
// (Q8SetThreadLimit: q8rules.set_cpu_threads, $Q8RULES_THREADS).
inline std::atomic<int> g_thread_limit{0};

// The CPUs this process may run on (its affinity mask, e.g. under taskset), else the
// hardware's threads; at most g_thread_limit when it is set. The mask is asked on every call
// (it may change); hardware_concurrency, which reads a sysfs file, once, where there is none.
inline int64_t UsableCpus() {
  int64_t cpus = 0;
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) cpus = std::max(1, CPU_COUNT(&set));
#endif
  if (cpus == 0) {
    static const int64_t hardware = std::max<unsigned>(1, std::thread::hardware_concurrency());
    cpus = hardware;
  }
  const int limit = g_thread_limit.load(std::memory_order_relaxed);
  return limit > 0 ? std::min<int64_t>(cpus, limit) : cpus;
}

// Values of q x M per thread worth waking (and per unit of work: below two of them a
// product is one unit, on the calling thread).
inline constexpr int64_t kWorkPerThread = int64_t{1} << 16;

// The 32-row blocks in each unit K is cut into (see Shared): a function of the
// problem alone, not of the threads, so the output is the same bit for bit whatever
// the pool, the CPU count or the scheduling. About 8 units at decode sizes
// (M <= 16: each unit's buffer, M x N floats, is small next to q), 4 for more rows;
// one unit (no buffers) for a small product.
inline int64_t BlocksPerUnit(const Problem& p) {
  const int64_t blocks = p.k / kBlock;
  if (WorkOf(p) < 2 * kWorkPerThread) return blocks;
  const int64_t want = std::min(blocks, int64_t{p.m <= kMaxRows ? 8 : 4});
  return (blocks + want - 1) / want;
}

// Threads worth using: one per kWorkPerThread values of q x M, at most XLA's pool's threads
// plus the caller and the CPUs this process may use. (One per 1 MiB left
// SmolLM-135M's 576-wide layers on one thread at decode: 2 threads decoded it at
// 41-44 tokens/s with 1 MiB, 63-67 with 64 Ki, 51-58 with 32 Ki; RESULTS.md.)
inline int64_t Threads(const Problem& p, int64_t pool_threads) {
  int64_t t = std::max<int64_t>(1, WorkOf(p) / kWorkPerThread);
  t = std::min<int64_t>(t, pool_threads + 1);
  t = std::min<int64_t>(t, p.k / kBlock);
  if (t > 1) t = std::min<int64_t>(t, UsableCpus());
  return std::max<int64_t>(t, 1);
}

// Runs `task` (`count` pieces, each counted in its `done` when finished) on the caller and up to
// threads - 1 helpers, and returns when every piece is done. Helpers hold a reference on the
// task, so one that starts after the caller has done every piece finds nothing to claim and
// touches no buffer. Helpers another caller is using are replaced by threads of `pool`: XLA's
// (ffi::ThreadPool), or any type with its Schedule(f) and num_threads() (the C++ kernel test's).
template <typename Pool, typename T>
inline void Share(Pool& pool, T* task, int64_t threads, int64_t count) {
  auto& helpers = q8helpers::Helpers::Get();
  const int want = static_cast<int>(threads - 1);
  for (int t = want > 0 ? helpers.Post(task, want) : 0; t < want; ++t) {
    task->Hold();
    pool.Schedule([task] {
      task->Run();
      task->Release();
    });
  }
  task->Run();
  // Wait for the pieces the helpers claimed (at most one each is still running).
  q8helpers::WaitFor(task->done, count);
  if (want > 0) helpers.Retract(task);
}

// The product p (y zeroed) on the caller and up to threads - 1 helpers, in units (Shared) or
// column stripes (Stripes).
template <typename Pool>
inline void Compute(Pool& pool, const Problem& p) {
  const int64_t blocks = p.k / kBlock;
  const int64_t per_unit = BlocksPerUnit(p);
  const int64_t units = (blocks + per_unit - 1) / per_unit;
  if (Striped(p, units)) {
    auto* task = new Stripes;
    task->p = p;
    task->blocks_per_unit = per_unit;
    task->units = units;
    const int64_t threads = Threads(p, pool.num_threads());
    task->stripes = StripeCount(p.n, threads);
    task->width = (p.n + task->stripes - 1) / task->stripes;
    task->width = (task->width + 63) / 64 * 64;
    task->stripes = (p.n + task->width - 1) / task->width;
    g_last_threads.store(static_cast<int>(std::min(threads, task->stripes)),
                         std::memory_order_relaxed);
    Share(pool, task, std::min(threads, task->stripes), task->stripes);
    task->Release();
    return;
  }
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
  auto* shared = new Shared;
  shared->p = p;
  shared->blocks_per_unit = per_unit;
  shared->units = units;
  shared->partial.resize(static_cast<size_t>(units - 1));
  Share(pool, shared, threads, units);
  for (const auto& buf : shared->partial) AddInto(p.y, buf);  // in unit order
  shared->Release();
}

// Rows of x as the Q8_0-activation product takes them (q8_act_int8.h), quantized once for every
// thread's share, on the int8 path of the ISA the product runs (q8act::PathFor).
struct ActivationsQ8 {
  std::vector<int8_t> xq;   // (m, k)
  std::vector<float> dx;    // (m, k / 32)
  std::vector<int32_t> xc;  // (m, k / 32)
  int64_t k = 0;
  Isa path = kScalar;

  // Rows [0, m) of x (row stride ldx), k values each.
  void Quantize(const float* x, int64_t m, int64_t k_, int64_t ldx, Isa isa) {
    k = k_;
    path = q8act::PathFor(isa);
    xq.resize(static_cast<size_t>(m * k));
    dx.resize(static_cast<size_t>(m * (k / kBlock)));
    xc.resize(dx.size());
    q8act::QuantizeRows(x, m, k, ldx, xq.data(), dx.data(), xc.data(), path);
    g_last_act_path.store(path, std::memory_order_relaxed);
  }

  // p on these activations from row `row` on (p.x's first row), row strides k and k / 32.
  void Attach(Problem& p, int64_t row) const {
    p.act_path = path;
    p.xq = xq.data() + row * k;
    p.dx = dx.data() + row * (k / kBlock);
    p.xc = xc.data() + row * (k / kBlock);
  }
};

// The product p (its operands, shape and path set; y (M, N) written whole), with Q8_0
// activations (x quantized once on p.isa's int8 path) when act_q8.
template <typename Pool>
inline void Product(Pool& pool, Problem p, bool act_q8) {
  std::fill(p.y, p.y + p.m * p.n, 0.0f);
  if (p.m == 0 || p.n == 0 || p.k == 0) return;
  ActivationsQ8 act;
  if (act_q8) {  // Q8_0 activations, once for every thread's share (q8_act_int8.h)
    act.Quantize(p.x, p.m, p.k, p.ldx, p.isa);
    act.Attach(p, 0);
  }
  Compute(pool, p);
  if (act_q8) q8act::UnpermuteColumns(p.y, p.m, p.n);
}

// The product on x (M, K), q (K, N), scale (K/32, N) given as their dimensions (the trailing two
// of q's and scale's) and first elements; y (M, N).
inline ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Span<const int64_t> qd,
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
  p.ldy = p.n;
  if (!q8isa::Select(&p.isa)) return ffi::Error::InvalidArgument(q8isa::BadEnv("q8_gemv"));
  g_last_isa.store(p.isa, std::memory_order_relaxed);
  Product(pool, p, act_q8);
  return ffi::Error::Success();
}


template <bool kActQ8>
inline ffi::Error Q8GemvImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                      ffi::AnyBuffer scale, ffi::ResultBuffer<ffi::F32> y) {
  return Run(pool, x, q.dimensions(), q.typed_data(), scale.dimensions(), scale.element_type(),
             scale.untyped_data(), y, kActQ8);
}

// Layer `layer` of stacked q (L, K, N) and scale (L, K/32, N), read in place (no slice copied).
template <bool kActQ8>
inline ffi::Error Q8GemvLayerImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
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
}  // namespace q8mm

#endif  // Q8RULES_Q8_MATMUL_H_
