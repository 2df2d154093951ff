// The weight-only product's column loop alone (q8rules/kernels/cpu/q8_matmul.h), called from
// C++ on weights read from DRAM: no XLA, no FFI, no thread pool. Built and run by
// kernel_stream.py.
//
//   kernel_stream K N THREADS  ->  prints "us GB/s" for one product of x (1, K) and q (K, N)
//
// THREADS 1: the caller runs `Columns` over all of K. THREADS 2: K in two halves of whole
// blocks, the second half on a helper thread that spins between products (so no wake-up is in
// the time), its sums added in order afterwards, as the library's units are. Weight copies
// (distinct random int8, float16 scales) total >= 512 MiB, so each product reads its weight
// from DRAM; the time is the best of 7 passes' mean per product.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "q8_matmul.h"

namespace {

std::atomic<int> g_generation{0};
std::atomic<int> g_finished{0};
std::function<void()> g_job;

void Helper() {
  int seen = 0;
  for (;;) {
    int g;
    while ((g = g_generation.load(std::memory_order_acquire)) == seen) _mm_pause();
    seen = g;
    if (g < 0) return;
    g_job();
    g_finished.fetch_add(1, std::memory_order_release);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: kernel_stream K N THREADS(1|2)\n");
    return 2;
  }
  using namespace q8mm;
  const int64_t k = std::atoll(argv[1]), n = std::atoll(argv[2]);
  const int threads = std::atoi(argv[3]);
  if (k <= 0 || n <= 0 || k % kBlock != 0 || (threads != 1 && threads != 2)) {
    std::fprintf(stderr, "K a positive multiple of 32, N > 0, THREADS 1 or 2\n");
    return 2;
  }
  const int64_t bytes = k * n * 34 / 32;
  const int copies = static_cast<int>(std::max<int64_t>(4, (int64_t{512} << 20) / bytes));
  std::mt19937 gen(1);
  std::vector<std::vector<int8_t>> qs(copies, std::vector<int8_t>(k * n));
  std::vector<std::vector<uint16_t>> scales(copies, std::vector<uint16_t>(k / kBlock * n, 0x2000));
  for (auto& q : qs)
    for (auto& v : q) v = static_cast<int8_t>(static_cast<int>(gen() % 255) - 127);
  std::vector<float> x(k), y(n), half(n);
  for (auto& v : x) v = static_cast<float>(gen() % 2001) / 1000.0f - 1.0f;
  Problem p;
  p.m = 1;
  p.k = k;
  p.n = n;
  p.ldx = k;
  p.ldy = n;
  p.scale_f16 = true;
  p.x = x.data();
  p.y = y.data();
  if (!q8isa::Select(&p.isa)) return 2;
  std::thread helper(Helper);
  const int64_t blocks = k / kBlock, split = blocks / 2;
  double best = 1e30;
  for (int pass = 0; pass < 7; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    for (int c = 0; c < copies; ++c) {
      p.q = qs[c].data();
      p.scale = scales[c].data();
      std::fill(y.begin(), y.end(), 0.0f);
      if (threads == 1 || split == 0) {
        Columns(p);
        continue;
      }
      std::fill(half.begin(), half.end(), 0.0f);
      const int before = g_finished.load(std::memory_order_acquire);
      g_job = [&] { Columns(Blocks(p, split, blocks, half.data())); };
      g_generation.fetch_add(1, std::memory_order_release);
      Columns(Blocks(p, 0, split, y.data()));
      while (g_finished.load(std::memory_order_acquire) == before) _mm_pause();
      AddInto(y.data(), half.data(), static_cast<size_t>(n));
    }
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - start;
    best = std::min(best, dt.count() / copies);
  }
  g_generation.store(-1, std::memory_order_release);
  helper.join();
  std::printf("%.2f %.2f\n", best * 1e6, bytes / best / 1e9);
  return 0;
}
