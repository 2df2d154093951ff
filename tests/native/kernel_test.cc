// The native library's kernels (q8rules/kernels/cpu/) on every SIMD path this CPU runs, each
// against the scalar path and a float64 reference, on fresh random data of small shapes. One
// line per kernel and path; exit status 0 when every check passes, 1 otherwise.
//
// Built without JAX or Python: the kernel headers, XLA's header-only FFI API (for ffi::Error;
// `jax.ffi.include_dir()`) and this file. tests/native/driver.py builds and runs it: with
// the system compiler on this machine (tests/test_kernel_program.py, in the README's test
// command), and cross-compiled for aarch64 under qemu-user on a CPU with and one without sdot
// (.ci/run).
//
// Usage: kernel_test [--seed N]   (default: a fresh seed, printed first)
//
// What is checked, per path (isa.h's ladder, up to this CPU's best):
//   matmul           the weight-only product, 1-17 and 33 rows (tiles, the 1-row stream, the
//                    float32 stretch), units of K on threads and column stripes, float32 and
//                    float16 scales: within 1e-6 x cond of float64 and of the scalar path;
//                    the same bits with one thread; SIMD paths the same bits as each other
//   matmul_act_q8    the Q8_0-activation product: the scalar path's bits, within 1e-6 x cond
//                    of float64 on the quantized operands, the same bits with one thread
//   act_quantize     its activation quantizer: the scalar one's bits; the scalar one against
//                    float64 (|x - q d| <= d / 2, d = amax / 127, the float16 d), and its
//                    output the same with the caller's flush-to-zero on, which is restored
//   matmul_t         the transposed product: within 1e-6 x cond of float64 and of the scalar
//                    path, the same bits with one thread
//   ragged           the grouped product, weight-only and Q8_0-activation: each expert's rows
//                    the dense product's bits on the same path, rows past the groups zero; the
//                    Q8_0-activation form the scalar path's bits, the weight-only one within
//                    1e-5 of it
//   decode_attention float32 and bfloat16 caches, softcap, sinks, grouped heads: the scalar
//                    path's bits, within 1e-6 of float64
//   q8_0_blocks      the GGUF Q8_0 block quantizer (q8_0_blocks.h, requant.h's): the scalar
//                    one's bytes, ties, zero, subnormal, infinite and NaN blocks included; the
//                    scalar one against float64
//   repack           the 16 x 16 transposes and the GGUF repack (SSE2 / NEON, baseline): the
//                    element-by-element transpose's bytes

// GCC 12's avx512fintrin.h seeds its conversions with _mm512_undefined_*(), which
// -Wuninitialized then reports at every inlined use (GCC bug 105593), as in library.cc.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "decode_attention.h"
#include "isa.h"
#include "q8_0_blocks.h"
#include "q8_act_int8.h"
#include "q8_matmul.h"
#include "q8_matmul_t.h"
#include "q8_ragged.h"
#include "repack.h"
#include "simd.h"

namespace {

using q8isa::Isa;

// XLA's ffi::ThreadPool's two operations, on threads of its own: each task a thread, joined
// when the pool goes. The products take it where the library's helper threads are busy.
class Pool {
 public:
  Pool() = default;
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;
  ~Pool() {
    for (auto& t : threads_) t.join();
  }
  int64_t num_threads() const { return 2; }
  template <typename F>
  void Schedule(F&& f) {
    threads_.emplace_back(std::forward<F>(f));
  }

 private:
  std::vector<std::thread> threads_;
};

// The paths this CPU runs, lowest first: this architecture's ladder up to its best.
std::vector<Isa> Paths() {
  std::vector<Isa> paths;
  for (int i = 0; i <= q8isa::Rung(q8isa::Best()); ++i) paths.push_back(q8isa::kLadder[i]);
  return paths;
}

const char* Name(Isa isa) { return q8isa::kNames[isa]; }

// ---------------------------------------------------------------------------------------------
// Fresh random data.

std::mt19937_64 g_rng;

float Normal() { return std::normal_distribution<float>(0.0f, 1.0f)(g_rng); }
float Uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(g_rng); }
int64_t Integer(int64_t lo, int64_t hi) {  // [lo, hi]
  return std::uniform_int_distribution<int64_t>(lo, hi)(g_rng);
}

std::vector<float> Normals(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& f : v) f = Normal();
  return v;
}

std::vector<int8_t> Int8s(int64_t n) {
  std::vector<int8_t> v(static_cast<size_t>(n));
  for (auto& b : v) b = static_cast<int8_t>(Integer(-128, 127));
  return v;
}

// Q8_0 weights: E stacked (K, N) int8 values and (K/32, N) scales, float32 or float16 (the
// float16 bits kept; Scale gives either as float64).
struct Weights {
  int64_t experts = 1, k = 0, n = 0;
  bool f16 = false;
  std::vector<int8_t> q;
  std::vector<float> s32;
  std::vector<uint16_t> s16;

  Weights(int64_t e, int64_t k_, int64_t n_, bool half) : experts(e), k(k_), n(n_), f16(half) {
    q = Int8s(e * k * n);
    const int64_t count = e * (k / 32) * n;
    const float magnitude = std::pow(10.0f, Uniform(-3.0f, 0.0f));
    for (int64_t i = 0; i < count; ++i) {
      const float s = Uniform(0.5f, 2.0f) * magnitude;
      if (f16) {
        s16.push_back(q8act::FloatToHalf(s));
      } else {
        s32.push_back(s);
      }
    }
  }
  const int8_t* Q(int64_t e) const { return q.data() + e * k * n; }
  const void* ScaleData(int64_t e) const {
    return f16 ? static_cast<const void*>(s16.data() + e * (k / 32) * n)
               : static_cast<const void*>(s32.data() + e * (k / 32) * n);
  }
  double Scale(int64_t e, int64_t b, int64_t col) const {
    const size_t i = static_cast<size_t>((e * (k / 32) + b) * n + col);
    return f16 ? q8act::HalfBitsToFloat(s16[i]) : s32[i];
  }
  double W(int64_t e, int64_t row, int64_t col) const {
    return q[static_cast<size_t>((e * k + row) * n + col)] * Scale(e, row / 32, col);
  }
};

// ---------------------------------------------------------------------------------------------
// Comparisons.

// ||out - ref|| / ||ref|| in float64 (0 when both are 0).
double RelErr(const std::vector<float>& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

std::vector<double> Widened(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// The bound of a float32 sum against its float64 value: tol x max(1, cond), cond =
// || |terms| summed || / || ref || (a sum whose terms cancel is held to its terms' size).
double Bound(double tol, const std::vector<double>& ref, const std::vector<double>& abs_ref) {
  double a = 0, r = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    a += abs_ref[i] * abs_ref[i];
    r += ref[i] * ref[i];
  }
  const double cond = r == 0 ? 1.0 : std::sqrt(a / r);
  return tol * std::max(1.0, cond);
}

bool SameBits(const void* a, const void* b, size_t bytes) { return std::memcmp(a, b, bytes) == 0; }

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && SameBits(a.data(), b.data(), a.size() * sizeof(T));
}

// One kernel on one path: its cases, the worst error over its bound, the first failure.
struct Result {
  Result(const char* kernel_, std::string path_) : kernel(kernel_), path(std::move(path_)) {}
  const char* kernel;
  std::string path;
  int cases = 0;
  double worst = 0;  // the largest err / bound of a tolerance check
  std::string failure;
  std::string note;

  void Case() { ++cases; }
  void Expect(bool ok, const std::string& what) {
    if (!ok && failure.empty()) failure = what;
  }
  void Within(double err, double bound, const std::string& what) {
    worst = std::max(worst, err / bound);
    if (!(err <= bound) && failure.empty()) {
      char buf[64];
      std::snprintf(buf, sizeof buf, ": %.3g > %.3g", err, bound);
      failure = what + buf;
    }
  }
};

int g_failures = 0;

void Print(const Result& r) {
  std::string detail = std::to_string(r.cases) + " cases";
  if (r.worst > 0) {
    char buf[64];
    std::snprintf(buf, sizeof buf, ", worst error %.2f of its bound", r.worst);
    detail += buf;
  }
  if (!r.note.empty()) detail += ", " + r.note;
  if (!r.failure.empty()) detail += "; first failure: " + r.failure;
  std::printf("%-17s %-13s %-4s %s\n", r.kernel, r.path.c_str(), r.failure.empty() ? "ok" : "FAIL",
              detail.c_str());
  std::fflush(stdout);
  if (!r.failure.empty() || r.cases == 0) ++g_failures;
}

std::string Shape(int64_t m, int64_t k, int64_t n, bool f16) {
  return "(" + std::to_string(m) + ", " + std::to_string(k) + ", " + std::to_string(n) + ") " +
         (f16 ? "f16" : "f32") + " scales";
}

// ---------------------------------------------------------------------------------------------
// The weight-only product and the Q8_0-activation product (q8_matmul.h, q8_act_*.h).

// y (m, n) = x (m, k) @ expert e of w on `isa`, with Q8_0 activations when act, on at most
// `threads` threads (0: the CPUs).
std::vector<float> Product(Isa isa, const std::vector<float>& x, int64_t m, const Weights& w,
                           bool act, int threads = 0) {
  std::vector<float> y(static_cast<size_t>(m * w.n), std::nanf(""));
  q8mm::Problem p;
  p.x = x.data();
  p.q = w.Q(0);
  p.scale = w.ScaleData(0);
  p.scale_f16 = w.f16;
  p.y = y.data();
  p.m = m;
  p.k = w.k;
  p.n = w.n;
  p.ldx = w.k;
  p.ldy = w.n;
  p.isa = isa;
  q8mm::g_thread_limit.store(threads);
  {
    Pool pool;
    q8mm::Product(pool, p, act);
  }
  q8mm::g_thread_limit.store(0);
  return y;
}

// x's rows as the Q8_0-activation product quantizes them, on `path`'s quantizer.
struct QuantizedRows {
  std::vector<int8_t> xq;
  std::vector<float> dx;
  std::vector<int32_t> xc;
};

QuantizedRows Quantize(Isa path, const std::vector<float>& x, int64_t m, int64_t k) {
  QuantizedRows out{std::vector<int8_t>(static_cast<size_t>(m * k)),
                    std::vector<float>(static_cast<size_t>(m * (k / 32))),
                    std::vector<int32_t>(static_cast<size_t>(m * (k / 32)))};
  q8act::QuantizeRows(x.data(), m, k, k, out.xq.data(), out.dx.data(), out.xc.data(), path);
  return out;
}

// The float64 products of x (or its Q8_0 rows) and w, and of their magnitudes.
void Reference(const std::vector<float>& x, const QuantizedRows* xq, int64_t m, const Weights& w,
               std::vector<double>* ref, std::vector<double>* abs_ref) {
  ref->assign(static_cast<size_t>(m * w.n), 0.0);
  abs_ref->assign(ref->size(), 0.0);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < w.k; ++i) {
      const size_t xi = static_cast<size_t>(r * w.k + i);
      const size_t bi = static_cast<size_t>(r * (w.k / 32) + i / 32);
      const double xv = xq ? static_cast<double>(xq->xq[xi]) * xq->dx[bi] : double{x[xi]};
      for (int64_t c = 0; c < w.n; ++c) {
        const double t = xv * w.W(0, i, c);
        (*ref)[static_cast<size_t>(r * w.n + c)] += t;
        (*abs_ref)[static_cast<size_t>(r * w.n + c)] += std::fabs(t);
      }
    }
  }
}

struct ProductShape {
  int64_t m, k, n;
};

// Every tile height (1-16: AVX-512's one m x 64 tile, two m x 32, the float32 stretch; AVX2's
// and NEON's 16-column tiles), 17 and 33 rows (past one 16-row group), the 1-row stream (one and
// two 4096-column stretches), N with 64-column stretches, a 16-, 8- or 4-column tail and a scalar
// one; products big enough for units of K on threads, and one cut into column stripes (N past
// 16384 columns, M x N past 64 Ki).
const ProductShape kProducts[] = {
    {1, 32, 1},    {1, 64, 149},  {1, 96, 4160}, {2, 96, 13},   {3, 64, 149},  {4, 128, 80},
    {5, 64, 149},  {6, 64, 64},   {7, 96, 149},  {8, 64, 128},  {9, 64, 149},  {10, 32, 70},
    {11, 64, 37},  {12, 128, 96}, {13, 64, 149}, {14, 32, 64},  {15, 64, 84},  {16, 64, 149},
    {17, 96, 70},  {33, 64, 100}, {1, 1024, 1100}, {8, 2048, 528}, {3, 256, 1024},
    {4, 64, 16448},
};

void CheckProducts(const std::vector<Isa>& paths) {
  std::vector<Result> weight_only, act;
  for (Isa isa : paths) {
    weight_only.push_back({"matmul", Name(isa)});
    Result a{"matmul_act_q8", Name(isa)};
    if (q8act::PathFor(isa) != isa) a.note = std::string("int8 dots ") + Name(q8act::PathFor(isa));
    act.push_back(a);
  }
  for (const ProductShape& s : kProducts) {
    for (bool f16 : {false, true}) {
      const Weights w(1, s.k, s.n, f16);
      const std::vector<float> x = Normals(s.m * s.k);
      const QuantizedRows xq = Quantize(q8isa::kScalar, x, s.m, s.k);
      std::vector<double> ref, abs_ref, ref_act, abs_act;
      Reference(x, nullptr, s.m, w, &ref, &abs_ref);
      Reference(x, &xq, s.m, w, &ref_act, &abs_act);
      const double bound = Bound(1e-6, ref, abs_ref);
      const double bound_act = Bound(1e-6, ref_act, abs_act);
      std::vector<std::vector<float>> y, y_act;  // per path
      const std::string what = Shape(s.m, s.k, s.n, f16);
      for (size_t i = 0; i < paths.size(); ++i) {
        Result& r = weight_only[i];
        r.Case();
        y.push_back(Product(paths[i], x, s.m, w, false));
        r.Within(RelErr(y[i], ref), bound, what + " against float64");
        r.Within(RelErr(y[i], Widened(y[0])), bound, what + " against scalar");
        r.Expect(SameBits(Product(paths[i], x, s.m, w, false, 1), y[i]),
                 what + ": one thread gives other bits");
        // The SIMD paths make the same FMAs in the same order: the same bits (N a multiple of
        // 16, so that no path's scalar tail takes columns another's vectors take).
        if (i > 1 && s.n % 16 == 0) {
          r.Expect(SameBits(y[i], y[1]), what + ": other bits than " + Name(paths[1]));
        }
        Result& ra = act[i];
        ra.Case();
        y_act.push_back(Product(paths[i], x, s.m, w, true));
        ra.Within(RelErr(y_act[i], ref_act), bound_act, what + " against float64");
        ra.Expect(SameBits(y_act[i], y_act[0]), what + ": other bits than scalar");
        ra.Expect(SameBits(Product(paths[i], x, s.m, w, true, 1), y_act[i]),
                  what + ": one thread gives other bits");
      }
    }
  }
  for (const Result& r : weight_only) Print(r);
  for (const Result& r : act) Print(r);
}

// ---------------------------------------------------------------------------------------------
// The activations' Q8_0 quantizer (q8_act_int8.h: QuantizeRows).

// Rows of 32-value blocks: random at scales 1e-6 to 1e6, ties (amax 127 and halves), zeros,
// subnormal values beside a normal largest one, a block whose d = amax / 127 is subnormal,
// large values, negative zeros; with `overflowing`, also blocks of subnormal values alone,
// whose 1 / d overflows float32 (every path then gives the scalar one's -127 throughout).
std::vector<float> QuantizerRows(int64_t blocks, bool overflowing) {
  std::vector<float> x;
  for (int64_t b = 0; b < blocks; ++b) {
    const int kind = static_cast<int>(b % 8);
    const float scale = std::pow(10.0f, Uniform(-6.0f, 6.0f));
    for (int i = 0; i < 32; ++i) {
      float v = Normal() * scale;
      if (kind == 1) v = i == 0 ? 127.0f : static_cast<float>(Integer(-254, 254)) * 0.5f;
      if (kind == 2) v = 0.0f;
      if (kind == 3) v = i == 0 ? 1e-30f : Normal() * 1e-39f;  // subnormal values
      if (kind == 4) v = i == 0 ? 1e-36f : Normal() * 1e-37f;  // d subnormal, 1 / d finite
      if (kind == 5) v = Normal() * 1e30f;
      if (kind == 6 && i % 3 == 0) v = -0.0f;
      if (kind == 7 && overflowing) v = Normal() * 1e-39f;  // 1 / d overflows
      x.push_back(v);
    }
  }
  return x;
}

void CheckActQuantizer(const std::vector<Isa>& paths) {
  const int64_t m = 3, k = 32 * 24;
  const std::vector<float> x = QuantizerRows(m * k / 32, true);
  const QuantizedRows ref = Quantize(q8isa::kScalar, x, m, k);
  for (Isa isa : paths) {
    const Isa path = q8act::PathFor(isa);
    Result r{"act_quantize", Name(isa)};
    if (path != isa) r.note = std::string("int8 path ") + Name(path);
    const QuantizedRows got = Quantize(path, x, m, k);
    r.Case();
    r.Expect(SameBits(got.xq, ref.xq), "values: other bits than scalar");
    r.Expect(SameBits(got.dx, ref.dx), "scales: other bits than scalar");
    r.Expect(SameBits(got.xc, ref.xc), "block sums: other bits than scalar");
    // The caller's flush-to-zero does not reach the quantizer, and is back on after it.
    r.Case();
    q8simd::IeeeFloat::SetFlushing(true);
    const bool flushing = q8simd::IeeeFloat::Flushing();
    const QuantizedRows flushed = Quantize(path, x, m, k);
    const bool still = q8simd::IeeeFloat::Flushing();
    q8simd::IeeeFloat::SetFlushing(false);
    if (flushing) {  // an architecture whose flush-to-zero this layer can set
      r.Expect(still, "the caller's flush-to-zero is not restored");
      r.Expect(SameBits(flushed.xq, ref.xq) && SameBits(flushed.dx, ref.dx),
               "the caller's flush-to-zero changes the values");
    }
    if (isa == q8isa::kScalar) {  // the scalar quantizer against float64
      r.Case();
      for (int64_t blk = 0; blk < m * k / 32 && r.failure.empty(); ++blk) {
        const float* xb = x.data() + blk * 32;
        float amax = 0;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const double d = amax / 127.0f;  // float32, as gguf.quants
        int32_t sum = 0;
        for (int i = 0; i < 32; ++i) {
          const int8_t q = ref.xq[static_cast<size_t>(blk * 32 + i)];
          sum += q;
          const double inv = d == 0 ? 0.0 : double{1.0f / static_cast<float>(d)};
          r.Expect(q != -128, "a value outside [-127, 127]");
          // |x / d - q| <= 1/2, to float32 rounding of x * (1 / d)
          if (std::isfinite(inv) && d > 0) {
            r.Expect(std::fabs(xb[i] * inv - q) <= 0.5 + 1e-5 * (1 + std::fabs(q)),
                     "block " + std::to_string(blk) + ": a value not rounded to nearest");
          }
        }
        const float want_d = q8act::HalfBitsToFloat(q8act::FloatToHalf(static_cast<float>(d)));
        r.Expect(SameBits(&ref.dx[static_cast<size_t>(blk)], &want_d, sizeof want_d),
                 "block " + std::to_string(blk) + ": d is not amax / 127 as float16");
        r.Expect(ref.xc[static_cast<size_t>(blk)] == -128 * sum, "a block sum");
      }
    }
    Print(r);
  }
}

// ---------------------------------------------------------------------------------------------
// The transposed product (q8_matmul_t.h).

std::vector<float> Transposed(Isa isa, const std::vector<float>& dy, int64_t m, const Weights& w,
                              int threads = 0) {
  std::vector<float> y(static_cast<size_t>(m * w.k), std::nanf(""));
  q8mmt::Transposed t;
  t.dy = dy.data();
  t.q = w.Q(0);
  t.scale = w.ScaleData(0);
  t.scale_f16 = w.f16;
  t.y = y.data();
  t.m = m;
  t.k = w.k;
  t.n = w.n;
  t.isa = isa;
  q8mm::g_thread_limit.store(threads);
  {
    Pool pool;
    q8mmt::Compute(pool, t);
  }
  q8mm::g_thread_limit.store(0);
  return y;
}

void CheckTransposed(const std::vector<Isa>& paths) {
  const ProductShape shapes[] = {{1, 32, 1},    {1, 64, 149}, {3, 96, 13},  {6, 64, 64},
                                 {7, 32, 149},  {8, 128, 80}, {9, 64, 37},  {16, 64, 149},
                                 {17, 96, 70},  {2, 1024, 300}};
  std::vector<Result> results;
  for (Isa isa : paths) results.push_back({"matmul_t", Name(isa)});
  for (const ProductShape& s : shapes) {
    for (bool f16 : {false, true}) {
      const Weights w(1, s.k, s.n, f16);
      const std::vector<float> dy = Normals(s.m * s.n);
      std::vector<double> ref(static_cast<size_t>(s.m * s.k)), abs_ref(ref.size());
      for (int64_t r = 0; r < s.m; ++r) {
        for (int64_t kk = 0; kk < s.k; ++kk) {
          for (int64_t c = 0; c < s.n; ++c) {
            const double t = double{dy[static_cast<size_t>(r * s.n + c)]} * w.W(0, kk, c);
            ref[static_cast<size_t>(r * s.k + kk)] += t;
            abs_ref[static_cast<size_t>(r * s.k + kk)] += std::fabs(t);
          }
        }
      }
      const double bound = Bound(1e-6, ref, abs_ref);
      const std::string what = Shape(s.m, s.k, s.n, f16);
      std::vector<float> scalar;
      for (size_t i = 0; i < paths.size(); ++i) {
        Result& r = results[i];
        r.Case();
        const std::vector<float> y = Transposed(paths[i], dy, s.m, w);
        if (i == 0) scalar = y;
        r.Within(RelErr(y, ref), bound, what + " against float64");
        r.Within(RelErr(y, Widened(scalar)), bound, what + " against scalar");
        r.Expect(SameBits(Transposed(paths[i], dy, s.m, w, 1), y),
                 what + ": one thread gives other bits");
      }
    }
  }
  for (const Result& r : results) Print(r);
}

// ---------------------------------------------------------------------------------------------
// The grouped product (q8_ragged.h).

void CheckRagged(const std::vector<Isa>& paths) {
  struct Grouped {
    int64_t m, k, n;
    std::vector<int32_t> sizes;  // rows of each expert, summing to at most m
  };
  const Grouped cases[] = {
      {9, 64, 149, {3, 0, 5, 1}},
      {20, 96, 80, {0, 17, 2, 0}},  // more than 16 rows in one expert; a group of none
      {6, 1024, 528, {1, 2, 0, 2}},  // units of K on threads; a row past the groups
  };
  for (bool act : {false, true}) {
    std::vector<Result> results;
    for (Isa isa : paths) results.push_back({act ? "ragged_act_q8" : "ragged", Name(isa)});
    for (const Grouped& g : cases) {
      for (bool f16 : {false, true}) {
        const int64_t experts = static_cast<int64_t>(g.sizes.size());
        const Weights w(experts, g.k, g.n, f16);
        const std::vector<float> x = Normals(g.m * g.k);
        const std::string what = Shape(g.m, g.k, g.n, f16);
        std::vector<float> scalar;
        for (size_t i = 0; i < paths.size(); ++i) {
          Result& r = results[i];
          r.Case();
          std::vector<float> y(static_cast<size_t>(g.m * g.n), std::nanf(""));
          Pool pool;
          const auto status =
              act ? q8ragged::Ragged<true>(pool, x.data(), w.Q(0), w.ScaleData(0), f16,
                                           g.sizes.data(), g.m, g.k, experts, g.n, y.data(),
                                           paths[i])
                  : q8ragged::Ragged<false>(pool, x.data(), w.Q(0), w.ScaleData(0), f16,
                                            g.sizes.data(), g.m, g.k, experts, g.n, y.data(),
                                            paths[i]);
          r.Expect(status.success(), what + ": " + status.message());
          if (i == 0) scalar = y;
          int64_t start = 0;
          for (int64_t e = 0; e < experts; ++e) {
            const int64_t rows = g.sizes[static_cast<size_t>(e)];
            if (rows == 0) continue;
            Weights one(1, g.k, g.n, f16);  // expert e alone
            one.q.assign(w.Q(e), w.Q(e) + g.k * g.n);
            if (f16) {
              const auto* s = static_cast<const uint16_t*>(w.ScaleData(e));
              one.s16.assign(s, s + g.k / 32 * g.n);
            } else {
              const auto* s = static_cast<const float*>(w.ScaleData(e));
              one.s32.assign(s, s + g.k / 32 * g.n);
            }
            const std::vector<float> xe(x.begin() + start * g.k, x.begin() + (start + rows) * g.k);
            const std::vector<float> ye = Product(paths[i], xe, rows, one, act);
            r.Expect(SameBits(ye.data(), y.data() + start * g.n, ye.size() * sizeof(float)),
                     what + ": expert " + std::to_string(e) + " is not its dense product");
            start += rows;
          }
          for (int64_t j = start * g.n; j < g.m * g.n; ++j) {
            r.Expect(y[static_cast<size_t>(j)] == 0.0f, what + ": a row past the groups");
          }
          if (act) {
            r.Expect(SameBits(y, scalar), what + ": other bits than scalar");
          } else {
            double num = 0, den = 0;  // against scalar, relative to the output's size
            for (size_t j = 0; j < y.size(); ++j) {
              num += double{y[j] - scalar[j]} * (y[j] - scalar[j]);
              den += double{scalar[j]} * scalar[j];
            }
            r.Within(std::sqrt(num / den), 1e-5, what + " against scalar");
          }
        }
      }
    }
    for (const Result& r : results) Print(r);
  }
}

// ---------------------------------------------------------------------------------------------
// Decode attention (decode_attention.h).

template <typename E>
void CheckAttentionOf(const std::vector<Isa>& paths, const char* kernel) {
  struct Heads {
    int64_t batch, length, kv_heads, heads, d;
    float softcap;
    bool sinks;
  };
  const Heads cases[] = {
      {2, 11, 2, 4, 37, 0.0f, false}, {2, 11, 2, 4, 64, 20.0f, false},
      {1, 9, 1, 3, 40, 0.0f, true},   {3, 7, 2, 2, 16, 30.0f, true},
  };
  std::vector<Result> results;
  for (Isa isa : paths) results.push_back({kernel, Name(isa)});
  for (const Heads& h : cases) {
    const int64_t kv_size = h.batch * h.length * h.kv_heads * h.d;
    const std::vector<float> q = Normals(h.batch * h.heads * h.d);
    std::vector<E> k(static_cast<size_t>(kv_size)), v(k.size());
    std::vector<float> kf(k.size()), vf(k.size());  // what the kernel reads, as float32
    for (size_t i = 0; i < k.size(); ++i) {
      const float a = Normal(), b = Normal();
      if constexpr (sizeof(E) == 2) {
        uint32_t ab, bb;
        std::memcpy(&ab, &a, 4);
        std::memcpy(&bb, &b, 4);
        k[i] = static_cast<E>(ab >> 16);
        v[i] = static_cast<E>(bb >> 16);
        kf[i] = q8attn::Widen(k[i]);
        vf[i] = q8attn::Widen(v[i]);
      } else {
        k[i] = kf[i] = a;
        v[i] = vf[i] = b;
      }
    }
    const std::vector<float> sinks = Normals(h.heads);
    std::vector<int64_t> ns;
    for (int64_t b = 0; b < h.batch; ++b) ns.push_back(b == 0 ? h.length : Integer(1, h.length));
    const float scale = 1.0f / std::sqrt(static_cast<float>(h.d));
    // float64: scores, softcap, softmax with the sink in the denominator, weighted values
    std::vector<double> ref(static_cast<size_t>(h.batch * h.heads * h.d), 0.0);
    const int64_t group = h.heads / h.kv_heads;
    for (int64_t b = 0; b < h.batch; ++b) {
      for (int64_t j = 0; j < h.heads; ++j) {
        const int64_t g = j / group, n = ns[static_cast<size_t>(b)];
        std::vector<double> s(static_cast<size_t>(n));
        double top = h.sinks ? sinks[static_cast<size_t>(j)] : -INFINITY;
        for (int64_t t = 0; t < n; ++t) {
          double dot = 0;
          for (int64_t i = 0; i < h.d; ++i)
            dot += double{q[static_cast<size_t>((b * h.heads + j) * h.d + i)]} *
                   kf[static_cast<size_t>(((b * h.length + t) * h.kv_heads + g) * h.d + i)];
          double score = dot * scale;
          if (h.softcap > 0) score = std::tanh(score / h.softcap) * h.softcap;
          s[static_cast<size_t>(t)] = score;
          top = std::max(top, score);
        }
        double sum = h.sinks ? std::exp(sinks[static_cast<size_t>(j)] - top) : 0.0;
        for (double& e : s) sum += (e = std::exp(e - top));
        for (int64_t t = 0; t < n; ++t)
          for (int64_t i = 0; i < h.d; ++i)
            ref[static_cast<size_t>((b * h.heads + j) * h.d + i)] +=
                s[static_cast<size_t>(t)] / sum *
                vf[static_cast<size_t>(((b * h.length + t) * h.kv_heads + g) * h.d + i)];
      }
    }
    char what[96];
    std::snprintf(what, sizeof what, "B %" PRId64 " H %" PRId64 " KV %" PRId64 " D %" PRId64
                  " softcap %g%s", h.batch, h.heads, h.kv_heads, h.d, h.softcap,
                  h.sinks ? " sinks" : "");
    std::vector<float> scalar;
    for (size_t i = 0; i < paths.size(); ++i) {
      Result& r = results[i];
      r.Case();
      std::vector<float> out(ref.size(), std::nanf(""));
      q8attn::DecodeAttention<E>(paths[i], q.data(), k.data(), v.data(),
                                 h.sinks ? sinks.data() : nullptr, out.data(), h.batch, h.length,
                                 h.kv_heads, h.heads, h.d, ns.data(), scale, h.softcap, 2);
      if (i == 0) scalar = out;
      r.Within(RelErr(out, ref), 1e-6, std::string(what) + " against float64");
      r.Expect(SameBits(out, scalar), std::string(what) + ": other bits than scalar");
    }
  }
  for (const Result& r : results) Print(r);
}

void CheckAttention(const std::vector<Isa>& paths) {
  CheckAttentionOf<float>(paths, "decode_attention");
  CheckAttentionOf<uint16_t>(paths, "decode_attn_bf16");
}

// ---------------------------------------------------------------------------------------------
// The GGUF Q8_0 block quantizer (q8_0_blocks.h).

void CheckGgufBlocks(const std::vector<Isa>& paths) {
  std::vector<float> x = QuantizerRows(64, true);
  // and blocks with a NaN, with +infinity and with -infinity
  std::vector<float> special(96, 0.0f);
  for (int i = 0; i < 96; ++i) special[static_cast<size_t>(i)] = Normal();
  special[5] = std::nanf("");
  special[40] = INFINITY;
  special[70] = -INFINITY;
  x.insert(x.end(), special.begin(), special.end());
  const int64_t blocks = static_cast<int64_t>(x.size()) / 32;
  std::vector<uint8_t> ref(static_cast<size_t>(blocks * 34));
  q8requant::QuantizeRun(x.data(), blocks * 32, ref.data(), q8isa::kScalar);
  for (Isa isa : paths) {
    Result r{"q8_0_blocks", Name(isa)};
    std::vector<uint8_t> got(ref.size(), 0xcd);
    q8requant::QuantizeRun(x.data(), blocks * 32, got.data(), isa);
    r.Case();
    r.Expect(SameBits(got, ref), "other bytes than scalar");
    if (isa == q8isa::kScalar) {  // the scalar quantizer against float64, finite blocks
      r.Case();
      for (int64_t b = 0; b < blocks; ++b) {
        const float* xb = x.data() + b * 32;
        const uint8_t* ob = ref.data() + b * 34;
        float amax = 0;
        bool finite = true;
        for (int i = 0; i < 32; ++i) {
          amax = std::max(amax, std::fabs(xb[i]));
          finite = finite && std::isfinite(xb[i]);
        }
        const float d = amax / 127.0f;
        uint16_t h;
        std::memcpy(&h, ob, 2);
        if (!finite) {
          r.Expect(std::isnan(q8act::HalfBitsToFloat(h)) || std::isinf(q8act::HalfBitsToFloat(h)),
                   "block " + std::to_string(b) + ": a non-finite block's scale is finite");
          continue;
        }
        r.Expect(h == q8act::FloatToHalf(d), "block " + std::to_string(b) + ": d");
        const float id = d == 0.0f ? 0.0f : 1.0f / d;
        for (int i = 0; i < 32; ++i) {
          const double want = std::round(double{xb[i] * id});  // half away from zero
          const int8_t q = static_cast<int8_t>(ob[2 + i]);
          if (std::isfinite(id)) {
            r.Expect(q == static_cast<int8_t>(want),
                     "block " + std::to_string(b) + ": value " + std::to_string(i));
          }
        }
      }
    }
    Print(r);
  }
}

// ---------------------------------------------------------------------------------------------
// The repack (repack.h): 16 x 16 transposes and GGUF blocks into the kernel layout.

void CheckRepack() {
#if Q8_X86
  const char* path = "sse2";
#elif Q8_ARM
  const char* path = "neon";
#else
  const char* path = "scalar";
#endif
  Result r{"repack", path};
  for (int round = 0; round < 8; ++round) {
    const int64_t ls = 16 + Integer(0, 40), ld = 16 + Integer(0, 40);
    const std::vector<int8_t> s = Int8s(16 * ls);
    std::vector<int8_t> a(static_cast<size_t>(16 * ld), 0), b(a.size(), 0);
    q8repack::Transpose16(s.data(), ls, a.data(), ld);
    q8repack::Transpose16Scalar(s.data(), ls, b.data(), ld);
    r.Case();
    r.Expect(SameBits(a, b), "Transpose16: other bytes than element by element");
  }
  // Two tensors of 37 rows (two 16-row runs and 5 rows past them) of 3 blocks, into wider rows.
  const int64_t batch = 2, rows = 37, nb = 3, ldq = 40, lds = 41;
  std::vector<std::vector<int8_t>> tensors;
  std::vector<const uint8_t*> blocks;
  for (int64_t t = 0; t < batch; ++t) {
    tensors.push_back(Int8s(rows * nb * 34));
    blocks.push_back(reinterpret_cast<const uint8_t*>(tensors.back().data()));
  }
  const int64_t q_stride = nb * 32 * ldq, s_stride = nb * lds;
  std::vector<int8_t> dq(static_cast<size_t>(batch * q_stride), 0);
  std::vector<uint16_t> ds(static_cast<size_t>(batch * s_stride), 0);
  q8repack::RepackKernelBatch(blocks.data(), dq.data(), ds.data(), batch, rows, nb, ldq, lds,
                              q_stride, s_stride, 2);
  r.Case();
  for (int64_t t = 0; t < batch; ++t) {
    for (int64_t row = 0; row < rows; ++row) {
      for (int64_t j = 0; j < nb; ++j) {
        const uint8_t* blk = blocks[static_cast<size_t>(t)] + (row * nb + j) * 34;
        uint16_t h;
        std::memcpy(&h, blk, 2);
        r.Expect(ds[static_cast<size_t>(t * s_stride + j * lds + row)] == h, "a scale");
        for (int64_t i = 0; i < 32; ++i) {
          r.Expect(dq[static_cast<size_t>(t * q_stride + (j * 32 + i) * ldq + row)] ==
                       static_cast<int8_t>(blk[2 + i]),
                   "a value");
        }
      }
    }
  }
  Print(r);
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t seed = std::random_device{}();
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr, "usage: %s [--seed N]\n", argv[0]);
      return 2;
    }
  }
  g_rng.seed(seed);
  const std::vector<Isa> paths = Paths();
  std::string names;
  for (Isa isa : paths) names += std::string(names.empty() ? "" : " ") + Name(isa);
  std::string ladder;
  for (Isa isa : q8isa::kLadder) ladder += std::string(ladder.empty() ? "" : " ") + Name(isa);
  std::printf("kernel_test: seed %" PRIu64 "; this CPU runs %s (of %s)\n", seed, names.c_str(),
              ladder.c_str());
  std::fflush(stdout);
  CheckProducts(paths);
  CheckActQuantizer(paths);
  CheckTransposed(paths);
  CheckRagged(paths);
  CheckAttention(paths);
  CheckGgufBlocks(paths);
  CheckRepack();
  std::printf("kernel_test: %s\n", g_failures == 0 ? "all passed"
                                                   : (std::to_string(g_failures) +
                                                      " kernel/path lines failed").c_str());
  return g_failures == 0 ? 0 : 1;
}
