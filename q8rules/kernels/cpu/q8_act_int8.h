// The Q8_0 x Q8_0 product of the native CPU kernel (included through q8_matmul.h): activations
// quantized to Q8_0 blocks of 32 along K, as llama.cpp quantizes them for its Q8_0 weights,
// then exact int32 block dots against the weight's int8 values:
//   y[r, n] = sum_b (dx[r, b] * dw[b, n]) * sum_{i < 32} xq[r, 32b + i] * q[32b + i, n]
// folded block by block into float32 with one FMA each. xq and dx are gguf.quants' Q8_0 of
// the float32 row, bit for bit: d = amax / 127 (float32), q = roundf(x * (1 / d)) (half away
// from zero; a zero block has d = 0 and q = 0), and d as the float16 it is stored in.
//
// One path a call, from the ISA the product runs (isa.h): AVX-512 VNNI (q8_act_vnni.h), AVX2
// (q8_act_avx2.h: also AVX-512 CPUs without VNNI), NEON with or without sdot (q8_act_neon.h),
// else scalar (q8_act_common.h). Every path computes the same integers and the same float32
// folds in the same order, so y is the same bits on each. y is accumulated in the stretch
// order `StoredColumn` gives and put back in order once at the end (`UnpermuteColumns`).

#ifndef Q8RULES_Q8_ACT_INT8_H_
#define Q8RULES_Q8_ACT_INT8_H_

#include <cstdint>

#include "isa.h"
#include "q8_act_avx2.h"
#include "q8_act_common.h"
#include "q8_act_neon.h"
#include "q8_act_vnni.h"
#include "simd.h"

namespace q8act {

using q8isa::Isa;

// The int8 path a product on `isa` runs: the ISA itself, but AVX-512 without VNNI runs AVX2's
// dots. Its code names it (isa.h; kAvx512 is the VNNI path).
inline Isa PathFor(Isa isa) {
#if Q8_X86
  if (isa == q8isa::kAvx512 && !vnni::Has()) return q8isa::kAvx2;
#endif
  return isa;
}

// Rows [0, m) of x (m, k), row stride ldx, as Q8_0: xq (m, k) int8, dx (m, k / 32) the
// float16 scales widened, xc (m, k / 32) -128 * each block's sum of values; the quantizer of
// `path` (a PathFor result), each bit for bit the scalar one. Run with IEEE float32 (no flush
// to zero: the caller's MXCSR or FPCR may have it on; it is restored).
inline void QuantizeRows(const float* x, int64_t m, int64_t k, int64_t ldx, int8_t* xq,
                         float* dx, int32_t* xc, Isa path) {
  const q8simd::IeeeFloat ieee;
  const int64_t nb = k / kBlock;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * ldx + b * kBlock;
      int8_t* qb = xq + r * k + b * kBlock;
      float* d = dx + r * nb + b;
      int32_t* c = xc + r * nb + b;
      switch (path) {
#if Q8_X86
        case q8isa::kAvx512: vnni::QuantizeBlock(xb, qb, d, c); continue;
        case q8isa::kAvx2: avx2::QuantizeBlock(xb, qb, d, c); continue;
#elif Q8_ARM
        case q8isa::kNeonDot:
        case q8isa::kNeon: neon::QuantizeBlock(xb, qb, d, c); continue;
#endif
        default: QuantizeBlockScalar(xb, qb, d, c);
      }
    }
  }
}

// y (p.m, p.n, stretch-permuted) += the blocks of p on `path` (a PathFor result).
inline void ColumnsInt8(const Int8Operands& p, Isa path) {
  switch (path) {
#if Q8_X86
    case q8isa::kAvx512: return vnni::Columns(p);
    case q8isa::kAvx2: return avx2::Columns(p);
#elif Q8_ARM
    case q8isa::kNeonDot: return neon::Columns<true>(p);
    case q8isa::kNeon: return neon::Columns<false>(p);
#endif
    default: return ColumnsInt8Scalar(p, 0, p.n);
  }
}

}  // namespace q8act

#endif  // Q8RULES_Q8_ACT_INT8_H_
