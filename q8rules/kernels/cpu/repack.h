// The GGUF repack: Q8_0 tensors as a GGUF file stores them (rows of 34-byte blocks: a float16
// scale, then 32 int8 values) into the kernel layout (K, N) int8 values and (K/32, N) float16
// scales, read straight from the file's blocks, on threads of its own.

#ifndef Q8RULES_REPACK_H_
#define Q8RULES_REPACK_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "simd.h"

namespace q8repack {

constexpr int64_t kBlock = 32;  // Q8_0 values per block

// The 16 x 16 int8 block at s (row stride ls) transposed into d (row stride ld), element by
// element: the form every SIMD one is checked against (tests/native/kernel_test.cc).
inline void Transpose16Scalar(const int8_t* s, int64_t ls, int8_t* d, int64_t ld) {
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < 16; ++c) d[c * ld + r] = s[r * ls + c];
  }
}

#if Q8_X86 || Q8_ARM
// Transpose16Scalar in 16-byte registers S (simd.h: Sse2, or NeonBytes, whose unpacks are
// zip1 / zip2): four rounds of unpacks; the column a result register holds is its index with
// the four bits reversed.
template <class S>
Q8_ALWAYS_INLINE void Transpose16Simd(const int8_t* s, int64_t ls, int8_t* d, int64_t ld) {
  static constexpr int kColumn[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  typename S::V x[16], t[16];
  for (int i = 0; i < 16; ++i) x[i] = S::Load(s + i * ls);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = S::template UnpackLo<8>(x[2 * i], x[2 * i + 1]);
    t[2 * i + 1] = S::template UnpackHi<8>(x[2 * i], x[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 2; ++j) {
      x[4 * i + j] = S::template UnpackLo<16>(t[4 * i + j], t[4 * i + j + 2]);
      x[4 * i + j + 2] = S::template UnpackHi<16>(t[4 * i + j], t[4 * i + j + 2]);
    }
  }
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = S::template UnpackLo<32>(x[8 * i + j], x[8 * i + j + 4]);
      t[8 * i + j + 4] = S::template UnpackHi<32>(x[8 * i + j], x[8 * i + j + 4]);
    }
  }
  for (int j = 0; j < 8; ++j) {
    x[j] = S::template UnpackLo<64>(t[j], t[j + 8]);
    x[j + 8] = S::template UnpackHi<64>(t[j], t[j + 8]);
  }
  for (int k = 0; k < 16; ++k) S::Store(d + kColumn[k] * ld, x[k]);
}
#endif

// The 16 x 16 int8 block at s (row stride ls) transposed into d (row stride ld): in SSE2 on
// x86-64 and NEON on aarch64 (each baseline there), elsewhere element by element.
inline void Transpose16(const int8_t* s, int64_t ls, int8_t* d, int64_t ld) {
#if Q8_X86
  Transpose16Simd<q8simd::Sse2>(s, ls, d, ld);
#elif Q8_ARM
  Transpose16Simd<q8simd::NeonBytes>(s, ls, d, ld);
#else
  Transpose16Scalar(s, ls, d, ld);
#endif
}

// Rows [r0, r1) of one (N = rows, K = nb * 32) tensor of 34-byte Q8_0 blocks `s` (a float16
// scale, then 32 int8 values), transposed: the values into dq (K, ldq), the scales' bits into
// ds (nb, lds) when ds is not null. Block column by block column for 16 rows at a time (each
// block's 32 values two 16 x 16 tiles), the rows past the last multiple of 16 element by
// element.
inline void RepackRows(const uint8_t* s, int8_t* dq, uint16_t* ds, int64_t r0, int64_t r1, int64_t nb,
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
inline void RepackKernelBatch(const uint8_t* const* blocks, int8_t* dq, uint16_t* ds,
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

}  // namespace q8repack

#endif  // Q8RULES_REPACK_H_
