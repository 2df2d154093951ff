// GGUF tensors of any type the library reads (Q4_1, Q4_K, ... F16) as Q8_0 straight in the
// kernel layout, in one pass: a run of 64 rows of a tensor is decoded and quantized into a
// buffer of 34-byte Q8_0 blocks that stays in the thread's cache (requant.h, bit for bit
// gguf.quants), then transposed from it into (K, N) int8 values and (K/32, N) float16 scales
// (repack.h). The tensor's Q8_0 blocks are never written to memory whole, and no float copy
// of it is made.

#ifndef Q8RULES_REQUANT_REPACK_H_
#define Q8RULES_REQUANT_REPACK_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "isa.h"
#include "repack.h"
#include "requant.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

namespace q8requant {

constexpr int64_t kRepackRun = 64;  // rows a unit: one cache line of each value row of dq

// Values [v0, v1) of a tensor of format f at src (v0 and v1 on whole blocks of f and of Q8_0)
// as Q8_0 blocks at out, through a float buffer of kChunk values.
inline void RequantizeValues(const Format& f, const uint8_t* src, int64_t v0, int64_t v1,
                             uint8_t* out, q8isa::Isa isa) {
  alignas(64) float buf[kChunk];
  for (int64_t v = v0; v < v1; v += kChunk) {
    const int64_t n = std::min(kChunk, v1 - v);
    f.decode(src + v / f.values * f.bytes, n / f.values, buf);
    QuantizeRun(buf, n, out + (v - v0) / kQ8Block * kQ8Bytes, isa);
  }
}

// `batch` tensors, tensor i of GGML type types[i] at srcs[i] (rows = N rows of n_cols = K
// values each), as Q8_0 in the kernel layout: its int8 values into dq + i * q_stride ((K, rows)
// with row stride ldq >= rows), its scales' float16 bits into ds + i * s_stride ((K / 32, rows)
// with row stride lds >= rows). A Q8_0 tensor's blocks are transposed as they are
// (`RepackKernelBatch`'s bytes); another type's are requantized on the way (`Requantize` then
// `RepackKernelBatch`'s bytes). Units (whole tensors when there are several, else runs of
// kRepackRun rows) are taken one at a time by the caller and up to threads - 1 started threads
// (`OnThreads`). A block that decodes to a non-finite value gets gguf.quants' scale (NaN or
// infinity): the caller checks the scales.
inline Status RequantizeKernelBatch(const int* types, const uint8_t* const* srcs, int8_t* dq,
                                    uint16_t* ds, int64_t batch, int64_t rows, int64_t n_cols,
                                    int64_t ldq, int64_t lds, int64_t q_stride,
                                    int64_t s_stride, int64_t threads) {
  std::vector<Format> formats(static_cast<size_t>(batch));
  for (int64_t i = 0; i < batch; ++i) {
    const Status ok = Check(types[i], rows, n_cols, true, &formats[i]);
    if (ok != kOk) return ok;
  }
  q8isa::Isa isa = q8isa::kScalar;
  if (!q8isa::Select(&isa)) isa = q8isa::kScalar;
  const int64_t nb = n_cols / kQ8Block, row_bytes = nb * kQ8Bytes;
  const int64_t runs = (rows + kRepackRun - 1) / kRepackRun;
  // A unit: a whole tensor when there are several, so that a thread writes (and first touches)
  // the pages of its own tensors only; else one run of the one tensor.
  const bool whole = batch > 1;
  const int64_t per_unit = whole ? runs : 1, units = whole ? batch : batch * runs;
  OnThreads(
      units, threads,
      [&](int64_t u0, int64_t u1) {
        thread_local std::vector<uint8_t> blocks;  // a run's Q8_0 blocks, reused by the thread
        blocks.resize(std::max(blocks.size(), static_cast<size_t>(kRepackRun * row_bytes)));
        for (int64_t v = u0 * per_unit; v < u1 * per_unit; ++v) {
          const int64_t i = v / runs, r0 = v % runs * kRepackRun;
          const int64_t r1 = std::min(rows, r0 + kRepackRun);
          int8_t* q = dq + i * q_stride;
          uint16_t* d = ds + i * s_stride;
          if (types[i] == kQ8_0) {
            q8repack::RepackRows(srcs[i], q, d, r0, r1, nb, ldq, lds);
            continue;
          }
          RequantizeValues(formats[i], srcs[i], r0 * n_cols, r1 * n_cols, blocks.data(), isa);
          q8repack::RepackRows(blocks.data(), q + r0, d + r0, 0, r1 - r0, nb, ldq, lds);
        }
      },
      1);
  return kOk;
}

}  // namespace q8requant

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

#endif  // Q8RULES_REQUANT_REPACK_H_
