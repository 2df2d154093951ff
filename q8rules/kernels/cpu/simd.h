// The native library's one SIMD layer: with its aarch64 half (simd_neon.h), the only header that
// includes <immintrin.h> or <arm_neon.h>, names an intrinsic, or holds inline assembly or a
// prefetch (tests/test_architecture.py checks), as ggml keeps its SIMD in one place. It holds the target
// attributes and, per instruction set, a type with the operations the kernels use. On x86-64:
//   - Avx2 (8 float lanes, __m256) and Avx512 (16), the same operations on either, so each of
//     the weight-only product's tiles (q8_tiles.h) and its transpose's (q8_matmul_t.h) is
//     written once;
//   - Avx512F (16 floats, 16 int32 and their masks): the Q8_0 quantizers of requant.h and
//     q8_act_int8.h, on AVX-512 F alone;
//   - Avx512Vnni: the Q8_0-activation product's byte interleave and int8 dots (q8_act_int8.h);
//   - Avx2Int (8 floats, 8 int32 or 32 int8): the Q8_0 quantizers and the int8 dots on AVX2;
//   - Sse2 (16 bytes, baseline on x86-64): the repack's 16 x 16 transposes (repack.h).
// On aarch64, simd_neon.h (this layer's other half, included here alone): Neon (4 float
// lanes) for the same tiles, NeonInt for the quantizers and the int8 dots, NeonBytes for the
// same transposes.
// And the prefetches, the spin-wait hint and the floating-point control guard every path
// shares. Every x86 operation is one instruction (or the fixed sequence) the kernels'
// hand-written code used, so a kernel computes the same bits through this layer as it did with
// the intrinsics inline.

#ifndef Q8RULES_SIMD_H_
#define Q8RULES_SIMD_H_

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define Q8_X86 1
#define Q8_ARM 0
#elif defined(__aarch64__)
#include <arm_neon.h>
#define Q8_X86 0
#define Q8_ARM 1
#else
#define Q8_X86 0
#define Q8_ARM 0
#endif

// A helper the compiler must inline (a tile's accumulators stay in registers across it).
#define Q8_ALWAYS_INLINE inline __attribute__((always_inline))

namespace q8simd {

constexpr int64_t kPrefetch = 128;  // bytes ahead in each q row stream (RESULTS.md)

#if Q8_X86
#define Q8_AVX2 __attribute__((target("avx2,fma,f16c")))
#define Q8_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
// AVX-512 F alone: requant.h's Q8_0 quantizer, on any AVX-512 CPU.
#define Q8_AVX512F __attribute__((target("avx512f")))
// AVX-512 F, BW and VNNI, with F16C: the Q8_0-activation product (q8_act_int8.h).
#define Q8_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,f16c")))

// The next cache lines' hints: into L1 (prefetcht0) and into L2 (prefetcht1).
Q8_ALWAYS_INLINE void PrefetchL1(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}
Q8_ALWAYS_INLINE void PrefetchL2(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
}
// A spin-wait loop's hint (pause).
Q8_ALWAYS_INLINE void Pause() { _mm_pause(); }

// AVX2 + FMA + F16C: 8 lanes.
struct Avx2 {
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr int64_t kTileRows = 6;  // x rows per register tile (16 registers)
  Q8_AVX2 static V Zero() { return _mm256_setzero_ps(); }
  // 8 int8 at p -> 8 floats.
  Q8_AVX2 static V Load(const int8_t* p) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  }
  Q8_AVX2 static V LoadU(const float* p) { return _mm256_loadu_ps(p); }
  Q8_AVX2 static V LoadA(const float* p) { return _mm256_load_ps(p); }
  Q8_AVX2 static void StoreU(float* p, V v) { _mm256_storeu_ps(p, v); }
  Q8_AVX2 static void StoreA(float* p, V v) { _mm256_store_ps(p, v); }
  Q8_AVX2 static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  Q8_AVX2 static V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  // The 8 lanes' sum: halves added, then pairs (a fixed order).
  Q8_AVX2 static float Sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  Q8_AVX2 static V Broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  // 8 scales from element i of a float32 or float16 array.
  Q8_AVX2 static V Scale(const void* scale, bool f16, int64_t i) {
    if (f16) {
      const __m128i h =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(scale) + i));
      return _mm256_cvtph_ps(h);
    }
    return _mm256_loadu_ps(static_cast<const float*>(scale) + i);
  }
};

// AVX2's 8 floats and 8 int32 (or 32 int8) for the Q8_0 quantizers and the Q8_0-activation
// product's int8 dots where there is no AVX-512 VNNI (llama.cpp's AVX2 dots: vpsignb, vpmaddubsw,
// vpmaddwd).
using F32x8 = __m256;
using I32x8 = __m256i;
struct Avx2Int {
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 Zero() { return _mm256_setzero_ps(); }
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 Set1(float v) { return _mm256_set1_ps(v); }
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 LoadU(const float* p) { return _mm256_loadu_ps(p); }
  Q8_AVX2 Q8_ALWAYS_INLINE static void StoreU(float* p, F32x8 v) { _mm256_storeu_ps(p, v); }
  // 8 float16 at p widened to float32 (vcvtph2ps).
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 LoadHalves(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 Abs(F32x8 a) {
    return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a);
  }
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 Max(F32x8 a, F32x8 b) { return _mm256_max_ps(a, b); }
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 Min(F32x8 a, F32x8 b) { return _mm256_min_ps(a, b); }
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 Add(F32x8 a, F32x8 b) { return _mm256_add_ps(a, b); }
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 Sub(F32x8 a, F32x8 b) { return _mm256_sub_ps(a, b); }
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 Mul(F32x8 a, F32x8 b) { return _mm256_mul_ps(a, b); }
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 Fma(F32x8 a, F32x8 b, F32x8 c) {
    return _mm256_fmadd_ps(a, b, c);
  }
  // Each lane rounded down to an integer (vroundps, no exceptions).
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 Floor(F32x8 a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  }
  // The largest lane (vmaxps over halves, pairs, then lanes: exact, any order).
  Q8_AVX2 Q8_ALWAYS_INLINE static float ReduceMax(F32x8 a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  // All-ones lanes where a < b (ordered, quiet), where a or b is NaN, where a >= b (ordered).
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 Less(F32x8 a, F32x8 b) {
    return _mm256_cmp_ps(a, b, _CMP_LT_OQ);
  }
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 Unordered(F32x8 a, F32x8 b) {
    return _mm256_cmp_ps(a, b, _CMP_UNORD_Q);
  }
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 GreaterEqual(F32x8 a, F32x8 b) {
    return _mm256_cmp_ps(a, b, _CMP_GE_OQ);
  }
  // Whether any lane of a comparison's result is set.
  Q8_AVX2 Q8_ALWAYS_INLINE static bool Any(F32x8 mask) { return _mm256_movemask_ps(mask) != 0; }
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 And(F32x8 a, F32x8 b) { return _mm256_and_ps(a, b); }
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 Or(F32x8 a, F32x8 b) { return _mm256_or_ps(a, b); }
  // -a where mask is set, a elsewhere (the sign bit flipped: exact).
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 NegateWhere(F32x8 mask, F32x8 a) {
    return _mm256_xor_ps(a, _mm256_and_ps(mask, _mm256_set1_ps(-0.0f)));
  }
  // Float to int32 truncated (vcvttps2dq); int32 to float.
  Q8_AVX2 Q8_ALWAYS_INLINE static I32x8 TruncToInt32(F32x8 a) { return _mm256_cvttps_epi32(a); }
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 ToFloat(I32x8 a) { return _mm256_cvtepi32_ps(a); }
  Q8_AVX2 Q8_ALWAYS_INLINE static I32x8 ZeroInt() { return _mm256_setzero_si256(); }
  Q8_AVX2 Q8_ALWAYS_INLINE static I32x8 Set1Int32(int32_t v) { return _mm256_set1_epi32(v); }
  Q8_AVX2 Q8_ALWAYS_INLINE static I32x8 AddInt32(I32x8 a, I32x8 b) {
    return _mm256_add_epi32(a, b);
  }
  Q8_AVX2 Q8_ALWAYS_INLINE static I32x8 SubInt32(I32x8 a, I32x8 b) {
    return _mm256_sub_epi32(a, b);
  }
  // a where the float mask is set, 0 elsewhere (bitwise).
  Q8_AVX2 Q8_ALWAYS_INLINE static I32x8 KeepWhere(F32x8 mask, I32x8 a) {
    return _mm256_and_si256(_mm256_castps_si256(mask), a);
  }
  // The float mask's lanes as int32: -1 where set, 0 elsewhere.
  Q8_AVX2 Q8_ALWAYS_INLINE static I32x8 MaskToInt32(F32x8 mask) {
    return _mm256_castps_si256(mask);
  }
  // 0 - a where the float mask is set, a elsewhere ((a ^ m) - m, m = -1 there).
  Q8_AVX2 Q8_ALWAYS_INLINE static I32x8 NegateInt32Where(F32x8 mask, I32x8 a) {
    const __m256i m = _mm256_castps_si256(mask);
    return _mm256_sub_epi32(_mm256_xor_si256(a, m), m);
  }
  Q8_AVX2 Q8_ALWAYS_INLINE static int32_t ReduceAddInt32(I32x8 a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
  }
  // Four vectors of 8 int32, each in [-128, 127], as 32 int8 stored at p in order (vpackssdw,
  // vpacksswb, then vpermd undoing the packs' 128-bit lane interleave).
  Q8_AVX2 Q8_ALWAYS_INLINE static void StoreInt8x32(void* p, I32x8 a, I32x8 b, I32x8 c,
                                                    I32x8 d) {
    const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
    const __m256i bytes = _mm256_packs_epi16(ab, cd);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_si256(static_cast<__m256i*>(p), _mm256_permutevar8x32_epi32(bytes, order));
  }
  // 32 bytes at p, unaligned; stored to p.
  Q8_AVX2 Q8_ALWAYS_INLINE static I32x8 LoadBytes(const void* p) {
    return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  }
  Q8_AVX2 Q8_ALWAYS_INLINE static void StoreBytes(void* p, I32x8 v) {
    _mm256_storeu_si256(static_cast<__m256i*>(p), v);
  }
  // The low (high) halves of each 128-bit lane of a and b interleaved, in units of kBits (8 or
  // 16) bits (vpunpckl/hbw, vpunpckl/hwd).
  template <int kBits>
  Q8_AVX2 Q8_ALWAYS_INLINE static I32x8 UnpackLo(I32x8 a, I32x8 b) {
    static_assert(kBits == 8 || kBits == 16);
    if constexpr (kBits == 8) return _mm256_unpacklo_epi8(a, b);
    else return _mm256_unpacklo_epi16(a, b);
  }
  template <int kBits>
  Q8_AVX2 Q8_ALWAYS_INLINE static I32x8 UnpackHi(I32x8 a, I32x8 b) {
    static_assert(kBits == 8 || kBits == 16);
    if constexpr (kBits == 8) return _mm256_unpackhi_epi8(a, b);
    else return _mm256_unpackhi_epi16(a, b);
  }
  // Each byte's magnitude as an unsigned byte (vpabsb: -128 gives 128).
  Q8_AVX2 Q8_ALWAYS_INLINE static I32x8 AbsInt8(I32x8 a) { return _mm256_abs_epi8(a); }
  // acc + per 32-bit lane the sum of the four products of w's and x's signed bytes, given
  // w_abs = AbsInt8(w): |w| times x with w's sign (vpsignb, vpmaddubsw), pairs of int16 into
  // int32 (vpmaddwd). Exact for any w and x in [-127, 127]: a pair's sum is at most
  // 2 * 128 * 127 in magnitude, inside int16.
  Q8_AVX2 Q8_ALWAYS_INLINE static I32x8 DotInt8(I32x8 acc, I32x8 w_abs, I32x8 w, I32x8 x) {
    const __m256i pairs = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  // The 128-bit halves kImm picks from a and b (vperm2f128).
  template <int kImm>
  Q8_AVX2 Q8_ALWAYS_INLINE static F32x8 Permute128(F32x8 a, F32x8 b) {
    return _mm256_permute2f128_ps(a, b, kImm);
  }
  // f rounded to float16 (nearest even) and widened back (vcvtps2ph, vcvtph2ps).
  Q8_AVX2 Q8_ALWAYS_INLINE static float RoundToHalf(float f) {
    return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

// AVX-512 F (plus the AVX2/FMA/F16C set): 16 lanes, 32 registers for wider tiles.
struct Avx512 {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int64_t kTileRows = 8;
  Q8_AVX512 static V Zero() { return _mm512_setzero_ps(); }
  // 16 int8 at p -> 16 floats (vpmovsxbd zmm + vcvtdq2ps).
  Q8_AVX512 static V Load(const int8_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
  }
  Q8_AVX512 static V LoadU(const float* p) { return _mm512_loadu_ps(p); }
  Q8_AVX512 static V LoadA(const float* p) { return _mm512_load_ps(p); }
  Q8_AVX512 static void StoreU(float* p, V v) { _mm512_storeu_ps(p, v); }
  Q8_AVX512 static void StoreA(float* p, V v) { _mm512_store_ps(p, v); }
  Q8_AVX512 static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  Q8_AVX512 static V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  Q8_AVX512 static float Sum(V v) { return _mm512_reduce_add_ps(v); }
  Q8_AVX512 static V Broadcast(const float* p) { return _mm512_set1_ps(*p); }
  Q8_AVX512 static V Scale(const void* scale, bool f16, int64_t i) {
    if (f16) {
      const __m256i h = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(scale) + i));
      return _mm512_cvtph_ps(h);
    }
    return _mm512_loadu_ps(static_cast<const float*>(scale) + i);
  }
};

// 16 floats, 16 int32 (or 64 int8) and a 16-lane mask of AVX-512.
using F32x16 = __m512;
using I32x16 = __m512i;
using Mask16 = __mmask16;

// AVX-512 F alone (no FMA or F16C assumed: requant.h's quantizer runs on any AVX-512 CPU).
struct Avx512F {
  Q8_AVX512F Q8_ALWAYS_INLINE static F32x16 Zero() { return _mm512_setzero_ps(); }
  Q8_AVX512F Q8_ALWAYS_INLINE static F32x16 Set1(float v) { return _mm512_set1_ps(v); }
  Q8_AVX512F Q8_ALWAYS_INLINE static F32x16 LoadU(const float* p) { return _mm512_loadu_ps(p); }
  Q8_AVX512F Q8_ALWAYS_INLINE static void StoreU(float* p, F32x16 v) { _mm512_storeu_ps(p, v); }
  // 16 float16 at p widened to float32 (vcvtph2ps).
  Q8_AVX512F Q8_ALWAYS_INLINE static F32x16 LoadHalves(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  Q8_AVX512F Q8_ALWAYS_INLINE static F32x16 Abs(F32x16 a) { return _mm512_abs_ps(a); }
  Q8_AVX512F Q8_ALWAYS_INLINE static F32x16 Max(F32x16 a, F32x16 b) { return _mm512_max_ps(a, b); }
  Q8_AVX512F Q8_ALWAYS_INLINE static F32x16 Min(F32x16 a, F32x16 b) { return _mm512_min_ps(a, b); }
  Q8_AVX512F Q8_ALWAYS_INLINE static F32x16 Add(F32x16 a, F32x16 b) { return _mm512_add_ps(a, b); }
  Q8_AVX512F Q8_ALWAYS_INLINE static F32x16 Sub(F32x16 a, F32x16 b) { return _mm512_sub_ps(a, b); }
  Q8_AVX512F Q8_ALWAYS_INLINE static F32x16 Mul(F32x16 a, F32x16 b) { return _mm512_mul_ps(a, b); }
  // a * b + c, rounded once (vfmadd).
  Q8_AVX512F Q8_ALWAYS_INLINE static F32x16 Fma(F32x16 a, F32x16 b, F32x16 c) {
    return _mm512_fmadd_ps(a, b, c);
  }
  // Each lane rounded down to an integer (vrndscaleps, no exceptions).
  Q8_AVX512F Q8_ALWAYS_INLINE static F32x16 Floor(F32x16 a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  }
  Q8_AVX512F Q8_ALWAYS_INLINE static float ReduceMax(F32x16 a) { return _mm512_reduce_max_ps(a); }
  // The 128-bit lanes of a and b picked by kImm (vshuff32x4).
  template <int kImm>
  Q8_AVX512F Q8_ALWAYS_INLINE static F32x16 Shuffle128(F32x16 a, F32x16 b) {
    return _mm512_shuffle_f32x4(a, b, kImm);
  }
  // Masks: a < b (ordered, quiet); either lane NaN; a >= b (ordered, quiet) where m is set.
  Q8_AVX512F Q8_ALWAYS_INLINE static Mask16 Less(F32x16 a, F32x16 b) {
    return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ);
  }
  Q8_AVX512F Q8_ALWAYS_INLINE static Mask16 Unordered(F32x16 a, F32x16 b) {
    return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
  }
  Q8_AVX512F Q8_ALWAYS_INLINE static Mask16 GreaterEqualWhere(Mask16 m, F32x16 a, F32x16 b) {
    return _mm512_mask_cmp_ps_mask(m, a, b, _CMP_GE_OQ);
  }
  // 0 - a where m is set, a elsewhere.
  Q8_AVX512F Q8_ALWAYS_INLINE static F32x16 NegateWhere(Mask16 m, F32x16 a) {
    return _mm512_mask_sub_ps(a, m, _mm512_setzero_ps(), a);
  }
  // Float to int32 truncated (vcvttps2dq), and that where m is set, 0 elsewhere; int32 to float.
  Q8_AVX512F Q8_ALWAYS_INLINE static I32x16 TruncToInt32(F32x16 a) {
    return _mm512_cvttps_epi32(a);
  }
  Q8_AVX512F Q8_ALWAYS_INLINE static I32x16 TruncToInt32Where(Mask16 m, F32x16 a) {
    return _mm512_maskz_cvttps_epi32(m, a);
  }
  Q8_AVX512F Q8_ALWAYS_INLINE static F32x16 ToFloat(I32x16 a) { return _mm512_cvtepi32_ps(a); }
  Q8_AVX512F Q8_ALWAYS_INLINE static I32x16 Set1Int32(int32_t v) { return _mm512_set1_epi32(v); }
  Q8_AVX512F Q8_ALWAYS_INLINE static I32x16 Set1Int8(int8_t v) {
    return _mm512_set1_epi8(static_cast<char>(v));
  }
  Q8_AVX512F Q8_ALWAYS_INLINE static I32x16 AddInt32(I32x16 a, I32x16 b) {
    return _mm512_add_epi32(a, b);
  }
  // a + b where m is set, a elsewhere; 0 - a where m is set, a elsewhere.
  Q8_AVX512F Q8_ALWAYS_INLINE static I32x16 AddInt32Where(Mask16 m, I32x16 a, I32x16 b) {
    return _mm512_mask_add_epi32(a, m, a, b);
  }
  Q8_AVX512F Q8_ALWAYS_INLINE static I32x16 NegateInt32Where(Mask16 m, I32x16 a) {
    return _mm512_mask_sub_epi32(a, m, _mm512_setzero_si512(), a);
  }
  Q8_AVX512F Q8_ALWAYS_INLINE static int32_t ReduceAddInt32(I32x16 a) {
    return _mm512_reduce_add_epi32(a);
  }
  Q8_AVX512F Q8_ALWAYS_INLINE static I32x16 Xor(I32x16 a, I32x16 b) {
    return _mm512_xor_si512(a, b);
  }
  // 64 bytes at p, unaligned; stored to p.
  Q8_AVX512F Q8_ALWAYS_INLINE static I32x16 LoadBytes(const void* p) {
    return _mm512_loadu_si512(p);
  }
  Q8_AVX512F Q8_ALWAYS_INLINE static void StoreBytes(void* p, I32x16 v) {
    _mm512_storeu_si512(p, v);
  }
  // The 16 int32 lanes truncated to int8 (vpmovdb), stored as 16 bytes at p.
  Q8_AVX512F Q8_ALWAYS_INLINE static void StoreInt8(void* p, I32x16 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
  }
};

// The Q8_0-activation product's operations past AVX-512 F: BW's byte and word interleaves,
// VNNI's int8 dots and F16C's float16 rounding.
struct Avx512Vnni {
  // The low (high) halves of each 128-bit lane of a and b interleaved, in units of kBits (8 or
  // 16) bits (vpunpckl/hbw, vpunpckl/hwd).
  template <int kBits>
  Q8_VNNI Q8_ALWAYS_INLINE static I32x16 UnpackLo(I32x16 a, I32x16 b) {
    static_assert(kBits == 8 || kBits == 16);
    if constexpr (kBits == 8) return _mm512_unpacklo_epi8(a, b);
    else return _mm512_unpacklo_epi16(a, b);
  }
  template <int kBits>
  Q8_VNNI Q8_ALWAYS_INLINE static I32x16 UnpackHi(I32x16 a, I32x16 b) {
    static_assert(kBits == 8 || kBits == 16);
    if constexpr (kBits == 8) return _mm512_unpackhi_epi8(a, b);
    else return _mm512_unpackhi_epi16(a, b);
  }
  // acc + per 32-bit lane the sum of the four products of u's unsigned bytes and s's signed
  // bytes (vpdpbusd: exact in int32).
  Q8_VNNI Q8_ALWAYS_INLINE static I32x16 DotBytes(I32x16 acc, I32x16 u, I32x16 s) {
    return _mm512_dpbusd_epi32(acc, u, s);
  }
  // f rounded to float16 (nearest even) and widened back (vcvtps2ph, vcvtph2ps).
  Q8_VNNI Q8_ALWAYS_INLINE static float RoundToHalf(float f) {
    return _cvtsh_ss(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

// 16 bytes in an SSE2 register (baseline on x86-64: no target attribute).
struct Sse2 {
  using V = __m128i;
  Q8_ALWAYS_INLINE static V Load(const int8_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  }
  Q8_ALWAYS_INLINE static void Store(int8_t* p, V v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v);
  }
  // The low (high) halves of a and b interleaved in units of kBits (8, 16, 32 or 64) bits
  // (punpckl/h).
  template <int kBits>
  Q8_ALWAYS_INLINE static V UnpackLo(V a, V b) {
    static_assert(kBits == 8 || kBits == 16 || kBits == 32 || kBits == 64);
    if constexpr (kBits == 8) return _mm_unpacklo_epi8(a, b);
    else if constexpr (kBits == 16) return _mm_unpacklo_epi16(a, b);
    else if constexpr (kBits == 32) return _mm_unpacklo_epi32(a, b);
    else return _mm_unpacklo_epi64(a, b);
  }
  template <int kBits>
  Q8_ALWAYS_INLINE static V UnpackHi(V a, V b) {
    static_assert(kBits == 8 || kBits == 16 || kBits == 32 || kBits == 64);
    if constexpr (kBits == 8) return _mm_unpackhi_epi8(a, b);
    else if constexpr (kBits == 16) return _mm_unpackhi_epi16(a, b);
    else if constexpr (kBits == 32) return _mm_unpackhi_epi32(a, b);
    else return _mm_unpackhi_epi64(a, b);
  }
};
#endif  // Q8_X86

#if Q8_ARM
#include "simd_neon.h"  // Neon, NeonInt, NeonBytes, the prefetches and the spin-wait hint
#endif

// The target of code written once over Avx2Int or NeonInt (AVX2's on x86-64; none on aarch64,
// where Advanced SIMD is baseline): a helper templated on either carries it, as their ops do.
#if Q8_X86
#define Q8_INT_LANES Q8_AVX2
#else
#define Q8_INT_LANES
#endif

// IEEE float32 while it lives: flush-to-zero and denormals-are-zero off (the caller's MXCSR,
// or FPCR on aarch64, may have them on), the caller's setting back at the end. Nothing to do
// elsewhere.
class IeeeFloat {
 public:
  IeeeFloat() {
#if Q8_X86
    csr_ = _mm_getcsr();
    _mm_setcsr(csr_ & ~0x8040u);  // FTZ is bit 15, DAZ bit 6
#elif Q8_ARM
    asm volatile("mrs %0, fpcr" : "=r"(fpcr_));
    const uint64_t ieee = fpcr_ & ~kFlush;
    if (ieee != fpcr_) asm volatile("msr fpcr, %0" : : "r"(ieee));
#endif
  }
  ~IeeeFloat() {
#if Q8_X86
    _mm_setcsr(csr_);
#elif Q8_ARM
    if ((fpcr_ & kFlush) != 0) asm volatile("msr fpcr, %0" : : "r"(fpcr_));
#endif
  }
  IeeeFloat(const IeeeFloat&) = delete;
  IeeeFloat& operator=(const IeeeFloat&) = delete;

  // Whether the calling thread flushes subnormals to zero now (FTZ or DAZ on x86, FZ on
  // aarch64), and turning that on or off: what a caller may have set, for the guard's tests
  // (tests/native/kernel_test.cc).
  static bool Flushing() {
#if Q8_X86
    return (_mm_getcsr() & 0x8040u) != 0;
#elif Q8_ARM
    uint64_t fpcr;
    asm volatile("mrs %0, fpcr" : "=r"(fpcr));
    return (fpcr & (uint64_t{1} << 24)) != 0;
#else
    return false;
#endif
  }
  static void SetFlushing(bool on) {
#if Q8_X86
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(on ? csr | 0x8040u : csr & ~0x8040u);
#elif Q8_ARM
    uint64_t fpcr;
    asm volatile("mrs %0, fpcr" : "=r"(fpcr));
    const uint64_t fz = uint64_t{1} << 24;
    fpcr = on ? fpcr | fz : fpcr & ~fz;
    asm volatile("msr fpcr, %0" : : "r"(fpcr));
#else
    (void)on;
#endif
  }

 private:
  unsigned csr_ = 0;
#if Q8_ARM
  // FPCR's flush-to-zero bits: FZ (bit 24, single and double precision) and FZ16 (bit 19, half
  // precision, where the CPU has it; RES0 and ignored where not).
  static constexpr uint64_t kFlush = (uint64_t{1} << 24) | (uint64_t{1} << 19);
  uint64_t fpcr_ = 0;
#endif
};

}  // namespace q8simd

#endif  // Q8RULES_SIMD_H_
