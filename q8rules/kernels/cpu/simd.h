// SIMD helpers of the native library: the x86 target attributes and, for the weight-only
// product's tiles (q8_tiles.h) and its transpose (q8_matmul_t.h), one vector type per path
// with the same operations, so each tile is written once: Avx2 (8 float lanes, __m256) and Avx512 (16, __m512). Every
// operation is the instruction the path's hand-written code used, so a tile computes the
// same FMAs in the same order on either type.

#ifndef Q8RULES_SIMD_H_
#define Q8RULES_SIMD_H_

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define Q8_X86 1
#else
#define Q8_X86 0
#endif

// A helper the compiler must inline (a tile's accumulators stay in registers across it).
#define Q8_ALWAYS_INLINE inline __attribute__((always_inline))

namespace q8simd {

constexpr int64_t kPrefetch = 128;  // bytes ahead in each q row stream (RESULTS.md)

#if Q8_X86
#define Q8_AVX2 __attribute__((target("avx2,fma,f16c")))
#define Q8_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

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
#endif  // Q8_X86

}  // namespace q8simd

#endif  // Q8RULES_SIMD_H_
