// The aarch64 half of the native library's one SIMD layer (simd.h includes it, inside
// namespace q8simd, after <arm_neon.h>; no other file may: tests/test_architecture.py checks).
// Advanced SIMD is baseline on aarch64; ARMv8.2's sdot carries a target attribute:
//   - Neon (4 float lanes, 32 registers): the same operations as simd.h's Avx2 and Avx512, for
//     the same tiles (q8_tiles.h, q8_matmul_t.h);
//   - NeonInt (4 floats, 4 int32 or 16 int8): the Q8_0 quantizers (q8_0_blocks.h,
//     q8_act_neon.h), and the Q8_0-activation product's byte interleave and int8 dots, with sdot
//     and without (q8_act_neon.h);
//   - NeonBytes (16 bytes): Sse2's operations, for the repack's transposes (repack.h);
// and the prefetches and the spin-wait hint, as simd.h has them for x86.

#ifndef Q8RULES_SIMD_NEON_H_
#define Q8RULES_SIMD_NEON_H_

// ARMv8.2's int8 dot product (sdot). GCC's arm_neon.h declares vdotq_s32 under this
// architecture level, so a function that calls it must carry the whole of it ("+dotprod" alone
// is refused as a target mismatch).
#define Q8_NEON_DOT __attribute__((target("arch=armv8.2-a+dotprod")))

// The next cache lines' hints: into L1 (prfm pldl1keep) and into L2 (prfm pldl2keep).
Q8_ALWAYS_INLINE void PrefetchL1(const void* p) { __builtin_prefetch(p, 0, 3); }
Q8_ALWAYS_INLINE void PrefetchL2(const void* p) { __builtin_prefetch(p, 0, 2); }
// A spin-wait loop's hint (yield).
Q8_ALWAYS_INLINE void Pause() { asm volatile("yield" ::: "memory"); }

// Advanced SIMD (baseline on aarch64): 4 float lanes, 32 registers.
struct Neon {
  using V = float32x4_t;
  static constexpr int kLanes = 4;
  static constexpr int64_t kTileRows = 6;  // x rows per register tile (6 x 4 accumulators)
  Q8_ALWAYS_INLINE static V Zero() { return vdupq_n_f32(0.0f); }
  // 4 int8 at p -> 4 floats (sxtl, sxtl, scvtf).
  Q8_ALWAYS_INLINE static V Load(const int8_t* p) {
    int32_t quad;
    __builtin_memcpy(&quad, p, sizeof quad);
    const int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(quad)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
  }
  Q8_ALWAYS_INLINE static V LoadU(const float* p) { return vld1q_f32(p); }
  Q8_ALWAYS_INLINE static V LoadA(const float* p) { return vld1q_f32(p); }
  Q8_ALWAYS_INLINE static void StoreU(float* p, V v) { vst1q_f32(p, v); }
  Q8_ALWAYS_INLINE static void StoreA(float* p, V v) { vst1q_f32(p, v); }
  // a * b + c, rounded once (fmla).
  Q8_ALWAYS_INLINE static V Fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
  Q8_ALWAYS_INLINE static V Mul(V a, V b) { return vmulq_f32(a, b); }
  // The 4 lanes' sum: halves added, then the pair (AVX2's order on 4 lanes).
  Q8_ALWAYS_INLINE static float Sum(V v) {
    const float32x2_t s = vadd_f32(vget_low_f32(v), vget_high_f32(v));
    return vget_lane_f32(s, 0) + vget_lane_f32(s, 1);
  }
  Q8_ALWAYS_INLINE static V Broadcast(const float* p) { return vld1q_dup_f32(p); }
  // 4 scales from element i of a float32 or float16 array (fcvtl: exact).
  Q8_ALWAYS_INLINE static V Scale(const void* scale, bool f16, int64_t i) {
    if (f16) {
      const uint16x4_t h = vld1_u16(static_cast<const uint16_t*>(scale) + i);
      return vcvt_f32_f16(vreinterpret_f16_u16(h));
    }
    return vld1q_f32(static_cast<const float*>(scale) + i);
  }
};

// 4 floats, 4 int32 (or 16 int8) and 4-lane masks of Advanced SIMD: the Q8_0 quantizers and
// the Q8_0-activation product's byte interleave and int8 dots.
using F32x4 = float32x4_t;
using I32x4 = int32x4_t;
using I8x16 = int8x16_t;
using Mask4 = uint32x4_t;
struct NeonInt {
  Q8_ALWAYS_INLINE static F32x4 Zero() { return vdupq_n_f32(0.0f); }
  Q8_ALWAYS_INLINE static F32x4 Set1(float v) { return vdupq_n_f32(v); }
  Q8_ALWAYS_INLINE static F32x4 LoadU(const float* p) { return vld1q_f32(p); }
  Q8_ALWAYS_INLINE static void StoreU(float* p, F32x4 v) { vst1q_f32(p, v); }
  // 4 float16 at p widened to float32 (fcvtl: exact).
  Q8_ALWAYS_INLINE static F32x4 LoadHalves(const uint16_t* p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
  }
  Q8_ALWAYS_INLINE static F32x4 Abs(F32x4 a) { return vabsq_f32(a); }
  // IEEE maxNum / minNum (fmaxnm, fminnm): a NaN operand gives the other one, as C's fmax and
  // fmin do.
  Q8_ALWAYS_INLINE static F32x4 MaxNum(F32x4 a, F32x4 b) { return vmaxnmq_f32(a, b); }
  Q8_ALWAYS_INLINE static F32x4 MinNum(F32x4 a, F32x4 b) { return vminnmq_f32(a, b); }
  Q8_ALWAYS_INLINE static float ReduceMaxNum(F32x4 a) { return vmaxnmvq_f32(a); }
  Q8_ALWAYS_INLINE static F32x4 Add(F32x4 a, F32x4 b) { return vaddq_f32(a, b); }
  Q8_ALWAYS_INLINE static F32x4 Sub(F32x4 a, F32x4 b) { return vsubq_f32(a, b); }
  Q8_ALWAYS_INLINE static F32x4 Mul(F32x4 a, F32x4 b) { return vmulq_f32(a, b); }
  // a * b + c, rounded once (fmla).
  Q8_ALWAYS_INLINE static F32x4 Fma(F32x4 a, F32x4 b, F32x4 c) { return vfmaq_f32(c, a, b); }
  // Each lane rounded down to an integer (frintm).
  Q8_ALWAYS_INLINE static F32x4 Floor(F32x4 a) { return vrndmq_f32(a); }
  // mag with the sign bit of sign (C's copysign).
  Q8_ALWAYS_INLINE static F32x4 CopySign(F32x4 mag, F32x4 sign) {
    return vbslq_f32(vdupq_n_u32(0x80000000u), sign, mag);
  }
  // All-ones lanes where a < b, where a >= b (false where either is NaN), where a is NaN.
  Q8_ALWAYS_INLINE static Mask4 Less(F32x4 a, F32x4 b) { return vcltq_f32(a, b); }
  Q8_ALWAYS_INLINE static Mask4 GreaterEqual(F32x4 a, F32x4 b) { return vcgeq_f32(a, b); }
  Q8_ALWAYS_INLINE static Mask4 IsNan(F32x4 a) { return vmvnq_u32(vceqq_f32(a, a)); }
  Q8_ALWAYS_INLINE static Mask4 And(Mask4 a, Mask4 b) { return vandq_u32(a, b); }
  Q8_ALWAYS_INLINE static Mask4 Or(Mask4 a, Mask4 b) { return vorrq_u32(a, b); }
  // Whether any lane of a mask is set.
  Q8_ALWAYS_INLINE static bool Any(Mask4 m) { return vmaxvq_u32(m) != 0; }
  // Float to int32 truncated toward zero (fcvtzs); int32 to float (scvtf).
  Q8_ALWAYS_INLINE static I32x4 TruncToInt32(F32x4 a) { return vcvtq_s32_f32(a); }
  Q8_ALWAYS_INLINE static F32x4 ToFloat(I32x4 a) { return vcvtq_f32_s32(a); }
  Q8_ALWAYS_INLINE static I32x4 ZeroInt() { return vdupq_n_s32(0); }
  Q8_ALWAYS_INLINE static I32x4 AddInt32(I32x4 a, I32x4 b) { return vaddq_s32(a, b); }
  Q8_ALWAYS_INLINE static I32x4 SubInt32(I32x4 a, I32x4 b) { return vsubq_s32(a, b); }
  // a where the mask is set, 0 elsewhere; the mask's lanes as int32 (-1 where set).
  Q8_ALWAYS_INLINE static I32x4 KeepWhere(Mask4 m, I32x4 a) {
    return vandq_s32(vreinterpretq_s32_u32(m), a);
  }
  Q8_ALWAYS_INLINE static I32x4 MaskToInt32(Mask4 m) { return vreinterpretq_s32_u32(m); }
  // 0 - a where the mask is set, a elsewhere.
  Q8_ALWAYS_INLINE static I32x4 NegateInt32Where(Mask4 m, I32x4 a) {
    return vbslq_s32(m, vnegq_s32(a), a);
  }
  Q8_ALWAYS_INLINE static int32_t ReduceAddInt32(I32x4 a) { return vaddvq_s32(a); }
  // 4 int32 at p; stored to p.
  Q8_ALWAYS_INLINE static I32x4 LoadInt32(const int32_t* p) { return vld1q_s32(p); }
  Q8_ALWAYS_INLINE static void StoreInt32(int32_t* p, I32x4 v) { vst1q_s32(p, v); }
  // Four vectors of 4 int32 as 16 int8 stored at p in order, each truncated to its low byte
  // (xtn, xtn: as a C cast to int8_t).
  Q8_ALWAYS_INLINE static void StoreInt8x16(void* p, I32x4 a, I32x4 b, I32x4 c, I32x4 d) {
    const int16x8_t ab = vcombine_s16(vmovn_s32(a), vmovn_s32(b));
    const int16x8_t cd = vcombine_s16(vmovn_s32(c), vmovn_s32(d));
    vst1q_s8(static_cast<int8_t*>(p), vcombine_s8(vmovn_s16(ab), vmovn_s16(cd)));
  }
  // 16 bytes at p, unaligned.
  Q8_ALWAYS_INLINE static I8x16 LoadBytes(const int8_t* p) { return vld1q_s8(p); }
  // The low (Zip1) or high (Zip2) halves of a and b interleaved in units of kBits (8, 16, 32 or
  // 64) bits (zip1, zip2: SSE2's punpckl / punpckh).
  template <int kBits>
  Q8_ALWAYS_INLINE static I8x16 Zip1(I8x16 a, I8x16 b) {
    static_assert(kBits == 8 || kBits == 16 || kBits == 32 || kBits == 64);
    if constexpr (kBits == 8) {
      return vzip1q_s8(a, b);
    } else if constexpr (kBits == 16) {
      return vreinterpretq_s8_s16(vzip1q_s16(vreinterpretq_s16_s8(a), vreinterpretq_s16_s8(b)));
    } else if constexpr (kBits == 32) {
      return vreinterpretq_s8_s32(vzip1q_s32(vreinterpretq_s32_s8(a), vreinterpretq_s32_s8(b)));
    } else {
      return vreinterpretq_s8_s64(vzip1q_s64(vreinterpretq_s64_s8(a), vreinterpretq_s64_s8(b)));
    }
  }
  template <int kBits>
  Q8_ALWAYS_INLINE static I8x16 Zip2(I8x16 a, I8x16 b) {
    static_assert(kBits == 8 || kBits == 16 || kBits == 32 || kBits == 64);
    if constexpr (kBits == 8) {
      return vzip2q_s8(a, b);
    } else if constexpr (kBits == 16) {
      return vreinterpretq_s8_s16(vzip2q_s16(vreinterpretq_s16_s8(a), vreinterpretq_s16_s8(b)));
    } else if constexpr (kBits == 32) {
      return vreinterpretq_s8_s32(vzip2q_s32(vreinterpretq_s32_s8(a), vreinterpretq_s32_s8(b)));
    } else {
      return vreinterpretq_s8_s64(vzip2q_s64(vreinterpretq_s64_s8(a), vreinterpretq_s64_s8(b)));
    }
  }
  // The 4 bytes at p in every 32-bit lane.
  Q8_ALWAYS_INLINE static I8x16 BroadcastQuad(const int8_t* p) {
    int32_t quad;
    __builtin_memcpy(&quad, p, sizeof quad);
    return vreinterpretq_s8_s32(vdupq_n_s32(quad));
  }
  // acc + per 32-bit lane the sum of the four products of w's and x's signed bytes: sdot. Not
  // always_inline: it carries the dotprod target, and is inlined into the Q8_NEON_DOT callers.
  Q8_NEON_DOT static inline I32x4 DotInt8Sdot(I32x4 acc, I8x16 w, I8x16 x) {
    return vdotq_s32(acc, w, x);
  }
  // The same sums without sdot: the bytes' products as int16 (smull, smull2), adjacent pairs
  // added (addp: at most 2 * 128 * 127 in magnitude, inside int16), then each lane's two pairs
  // added into its int32 (sadalp). Exact for any int8 w and x in [-127, 127].
  Q8_ALWAYS_INLINE static I32x4 DotInt8Plain(I32x4 acc, I8x16 w, I8x16 x) {
    const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(x));
    const int16x8_t hi = vmull_high_s8(w, x);
    return vpadalq_s16(acc, vpaddq_s16(lo, hi));
  }
  // f rounded to float16 (nearest even) and widened back (fcvtn, fcvtl).
  Q8_ALWAYS_INLINE static float RoundToHalf(float f) {
    return vgetq_lane_f32(vcvt_f32_f16(vcvt_f16_f32(vdupq_n_f32(f))), 0);
  }
};

// 16 bytes in a NEON register with Sse2's operations (UnpackLo / UnpackHi are zip1 / zip2): the
// repack's 16 x 16 transposes (repack.h), written once for both.
struct NeonBytes {
  using V = int8x16_t;
  Q8_ALWAYS_INLINE static V Load(const int8_t* p) { return vld1q_s8(p); }
  Q8_ALWAYS_INLINE static void Store(int8_t* p, V v) { vst1q_s8(p, v); }
  template <int kBits>
  Q8_ALWAYS_INLINE static V UnpackLo(V a, V b) { return NeonInt::Zip1<kBits>(a, b); }
  template <int kBits>
  Q8_ALWAYS_INLINE static V UnpackHi(V a, V b) { return NeonInt::Zip2<kBits>(a, b); }
};

#endif  // Q8RULES_SIMD_NEON_H_
