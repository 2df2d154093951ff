// The grouped (ragged) Q8_0 product on the CPU (op 'ragged_matmul'):
//   y[m] (N) f32 = x[m] (K) f32 @ W[g(m)],  W[e][k, n] = q[e, k, n] * scale[e, k / 32, n],
// rows of x sorted by group, group_sizes (E) int32 the rows of each expert. Each expert that
// received rows is one weight-only product (q8_matmul.h: its int8 rows streamed once for up to
// 16 of its rows, converted in registers) on its own run of rows of x and y, and all of them
// are one piece of work for the caller and the library's helper threads; an expert with no
// rows is never touched. The numerics are the weight-only product's, per expert, bit for bit.
// With Q8_0 activations (kActQ8, op 'ragged_matmul' with act_qtype='q8_0'), every row of x is
// quantized once (q8_act_int8.h) and each expert's rows are that product's int8 block dots,
// per expert bit for bit with the dense Q8_0 x Q8_0 product on the same rows.

#ifndef Q8RULES_Q8_RAGGED_H_
#define Q8RULES_Q8_RAGGED_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "helper_threads.h"
#include "q8_matmul.h"
#include "xla/ffi/api/ffi.h"

namespace q8ragged {
namespace {

namespace ffi = xla::ffi;

// The routed experts' products as one piece of work shared by the caller and its helpers
// (helper_threads.h, else XLA's pool): each expert's K is cut into units as its own product's
// (q8_matmul.h: BlocksPerUnit, a function of that product alone), and every unit of every
// routed expert is claimed from one counter, so a decode step's experts cost one hand-off, not
// one each. Unit 0 of an expert writes into that expert's own rows of y (no two experts share
// a row); unit i > 0 into its own slice of one buffer, zeroed by the unit; whoever finishes an
// expert's last unit adds its slices into its rows in unit order. The sums, and so y, are each
// expert's weight-only product bit for bit, whatever the threads.
struct Experts final : q8helpers::Task {
  struct Unit {
    int32_t expert;  // into products
    int32_t index;   // the unit within that expert's product
    int64_t offset;  // of its partial sums in `partial` (unit 0: none)
  };
  struct Expert {
    q8mm::Problem p;
    int64_t blocks_per_unit = 1;
    int64_t first_unit = 0;  // its units are [first_unit, first_unit + units)
    int64_t units = 0;
  };
  std::vector<Expert> experts;  // the routed ones
  std::vector<Unit> units;
  std::unique_ptr<float[]> partial;  // every unit i > 0's (M_e, N) sums
  std::unique_ptr<std::atomic<int64_t>[]> left;  // per routed expert: units not yet done
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() override {
    const int64_t count = static_cast<int64_t>(units.size());
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
      const Unit u = units[static_cast<size_t>(i)];
      const Expert& e = experts[static_cast<size_t>(u.expert)];
      const int64_t size = e.p.m * e.p.n;
      float* acc = e.p.y;
      if (u.index > 0) {
        acc = partial.get() + u.offset;
        std::fill(acc, acc + size, 0.0f);
      }
      q8mm::RunUnit(e.p, e.blocks_per_unit, u.index, acc);
      if (left[u.expert].fetch_sub(1, std::memory_order_acq_rel) == 1) {  // its last unit
        for (int64_t j = e.first_unit + 1; j < e.first_unit + e.units; ++j) {
          q8mm::AddInto(e.p.y, partial.get() + units[static_cast<size_t>(j)].offset,
                        static_cast<size_t>(size));
        }
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }

  // Every unit on the caller and up to threads - 1 helpers (threads of `pool` where other
  // callers hold the helpers: q8mm::Share).
  template <typename Pool>
  void Compute(Pool& pool, int64_t threads) {
    auto& helpers = q8helpers::Helpers::Get();
    const int want = static_cast<int>(threads - 1);
    for (int t = want > 0 ? helpers.Post(this, want) : 0; t < want; ++t) {
      Hold();
      pool.Schedule([this] {
        Run();
        Release();
      });
    }
    Run();
    q8helpers::WaitFor(done, static_cast<int64_t>(units.size()));
    if (want > 0) helpers.Retract(this);
  }
};

// x (m, k) f32, q (experts, k, n) int8, scale (experts, k/32, n) f32 or f16 (scale_f16),
// sizes (experts) int32 summing to at most m (rows past their sum get zeros), out (m, n) f32,
// on path `isa` (and its int8 path, q8act::PathFor) and the caller, the helpers and `pool`.
// kActQ8: x quantized to Q8_0 first. An error for sizes that are negative or sum past m.
template <bool kActQ8, typename Pool>
inline ffi::Error Ragged(Pool& pool, const float* x, const int8_t* q, const void* scale,
                         bool scale_f16, const int32_t* sizes, int64_t m, int64_t k,
                         int64_t experts, int64_t n, float* out, q8mm::Isa isa) {
  q8mm::Problem base;
  base.isa = isa;
  base.scale_f16 = scale_f16;
  base.k = k;
  base.n = n;
  base.ldy = n;
  base.ldx = k;
  std::fill(out, out + m * n, 0.0f);
  q8mm::ActivationsQ8 act;
  if (kActQ8 && m > 0 && k > 0) act.Quantize(x, m, k, k, base.isa);  // every row once
  const int64_t scale_bytes = base.scale_f16 ? 2 : 4;
  auto* work = new Experts;  // reference counted: helpers that start late hold it
  int64_t start = 0, total = 0, partial_size = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t rows = sizes[e];
    if (rows < 0 || rows > m - start) {
      work->Release();
      return ffi::Error::InvalidArgument(
          "q8_ragged_matmul: group " + std::to_string(e) + " has " + std::to_string(rows) +
          " rows, past the " + std::to_string(m) + " rows of x (sizes must be >= 0 and sum to M)");
    }
    if (rows > 0 && n > 0 && k > 0) {  // an expert without rows is never read
      q8mm::Problem p = base;
      p.m = rows;
      p.x = x + start * k;
      p.q = q + e * k * n;
      p.scale = static_cast<const char*>(scale) + e * (k / q8mm::kBlock) * n * scale_bytes;
      p.y = out + start * n;
      if (kActQ8) act.Attach(p, start);
      Experts::Expert ex;
      ex.p = p;
      ex.blocks_per_unit = q8mm::BlocksPerUnit(p);
      ex.units = (k / q8mm::kBlock + ex.blocks_per_unit - 1) / ex.blocks_per_unit;
      ex.first_unit = static_cast<int64_t>(work->units.size());
      const auto expert = static_cast<int32_t>(work->experts.size());
      for (int64_t i = 0; i < ex.units; ++i) {
        work->units.push_back({expert, static_cast<int32_t>(i), i > 0 ? partial_size : 0});
        if (i > 0) partial_size += rows * n;
      }
      work->experts.push_back(ex);
      total += q8mm::WorkOf(p);
    }
    start += rows;
  }
  const int64_t count = static_cast<int64_t>(work->units.size());
  int64_t threads = std::max<int64_t>(1, total / q8mm::kWorkPerThread);
  threads = std::min<int64_t>({threads, count, pool.num_threads() + 1});
  if (threads > 1) threads = std::min<int64_t>(threads, q8mm::UsableCpus());
  threads = std::max<int64_t>(threads, 1);
  q8mm::g_last_threads.store(static_cast<int>(threads), std::memory_order_relaxed);
  work->partial.reset(new float[static_cast<size_t>(std::max<int64_t>(partial_size, 1))]);
  work->left.reset(new std::atomic<int64_t>[work->experts.size() + 1]);
  for (size_t e = 0; e < work->experts.size(); ++e) work->left[e].store(work->experts[e].units);
  if (count > 0) work->Compute(pool, threads);
  work->Release();
  if (kActQ8) q8act::UnpermuteColumns(out, m, n);  // y's stretches back in column order
  return ffi::Error::Success();
}

// x (M, K) f32, q (E, K, N) int8, scale (E, K/32, N) f32 or f16, group_sizes (E) int32 summing
// to at most M (rows past their sum get zeros), y (M, N) f32. kActQ8: x quantized to Q8_0
// first (on the int8 path of the ISA the product runs: q8act::PathFor).
template <bool kActQ8>
inline ffi::Error Q8RaggedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<ffi::S8> q, ffi::AnyBuffer scale,
                               ffi::Buffer<ffi::S32> group_sizes, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions();
  const auto gd = group_sizes.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 3 || sd.size() != 3 || gd.size() != 1 || yd.size() != 2 ||
      qd[1] != xd[1] || xd[1] % q8mm::kBlock != 0 || sd[0] != qd[0] ||
      sd[1] != qd[1] / q8mm::kBlock || sd[2] != qd[2] || gd[0] != qd[0] || yd[0] != xd[0] ||
      yd[1] != qd[2]) {
    return ffi::Error::InvalidArgument(
        "q8_ragged_matmul: expected x (M, K), q (E, K, N), scale (E, K/32, N), group_sizes (E), "
        "y (M, N), K a multiple of 32");
  }
  if (scale.element_type() != ffi::DataType::F32 && scale.element_type() != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument("q8_ragged_matmul: scale must be float32 or float16");
  }
  q8mm::Isa isa;
  if (!q8isa::Select(&isa)) {
    return ffi::Error::InvalidArgument(q8isa::BadEnv("q8_ragged_matmul"));
  }
  q8mm::g_last_isa.store(isa, std::memory_order_relaxed);
  return Ragged<kActQ8>(pool, x.typed_data(), q.typed_data(), scale.untyped_data(),
                        scale.element_type() == ffi::DataType::F16, group_sizes.typed_data(),
                        xd[0], xd[1], qd[0], qd[2], y->typed_data(), isa);
}

}  // namespace
}  // namespace q8ragged

#endif  // Q8RULES_Q8_RAGGED_H_
