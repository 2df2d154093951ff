// GGUF's other tensor types as float32 and as Q8_0: each type's blocks decoded to float32
// exactly as gguf-py's gguf.quants.dequantize does (the same float32 operations in the same
// order, each rounded on its own), and those floats quantized to Q8_0's 34-byte GGUF blocks
// exactly as gguf.quants.quantize(..., Q8_0) does (the rule of q8rules/q8_0.py). Types:
// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, F16, BF16 and F32, by
// their GGML type ids.
//
// A tensor is a run of rows that are runs of blocks, so both directions walk it as one flat
// stream in chunks of kChunk values (a multiple of every block size and of Q8_0's 32): a
// requantize decodes one chunk into a float buffer on its thread's stack, then quantizes it,
// so no float copy of the tensor is ever made. Runs of chunks are taken in turn by the
// call's threads, each run with IEEE float32 (no flush to zero, whatever the caller's MXCSR
// holds).
//
// Exactness: every product and sum is its own statement, and this file's functions are
// compiled with no FP contraction whatever the flags: GCC's default for C++ fuses a * b + c
// into one FMA (one rounding where numpy rounds twice) wherever FMA is enabled, in the
// AVX-512 function here or under -march=native; clang contracts within one expression only.

#ifndef Q8RULES_REQUANT_H_
#define Q8RULES_REQUANT_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "isa.h"
#include "q8_0_blocks.h"  // float32 -> Q8_0 GGUF blocks, on every path
#include "simd.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

namespace q8requant {

// GGML type ids (ggml.h's enum ggml_type) of the types this file reads.
enum GgmlType : int {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30, kMXFP4 = 39,
};

// What the C functions return.
enum Status : int { kOk = 0, kUnsupported = -1, kBadShape = -2 };

constexpr int64_t kSuper = 256;        // values of a K-quant super-block (QK_K)
constexpr int64_t kChunk = 4096;       // values a thread decodes before it quantizes them

inline float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

inline uint32_t ToBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// Little-endian fields of a block (x86 and every GGUF host is little-endian).
inline uint16_t Load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// IEEE half bits -> float32, exactly as numpy's astype(float32): exponent and mantissa moved
// into float32's places, then scaled by 2^112 (exact: a half subnormal is a float32
// subnormal there, made normal, with denormals-are-zero off: IeeeFloat); exponent 31
// (infinity, NaN with its payload) lands at 2^16 or above and gets float32's all-ones
// exponent. No branch, so loops of it vectorize.
inline float Half(uint16_t h) {
  const float scaled = FromBits(static_cast<uint32_t>(h & 0x7fffu) << 13) * 0x1p112f;
  uint32_t bits = ToBits(scaled);
  if (scaled >= 65536.0f) bits |= 0x7f800000u;
  return FromBits(bits | static_cast<uint32_t>(h & 0x8000u) << 16);
}

// The last step of every quantized type, as gguf.quants writes it: value i of group g is
// scale[g] * q[i] (float32), plus add[g] when kAdd (Q4_1 and Q5_1 add their min; Q2_K, Q4_K
// and Q5_K subtract dmin * m, stored negated: x - y and x + (-y) round alike).
template <int64_t kValues, int64_t kGroup, bool kAdd>
inline void Scale(const int8_t* q, const float* scale, const float* add, float* y) {
  for (int64_t g = 0; g < kValues / kGroup; ++g) {
    for (int64_t i = 0; i < kGroup; ++i) {
      const float v = scale[g] * static_cast<float>(q[g * kGroup + i]);
      if (kAdd) {
        y[g * kGroup + i] = v + add[g];
      } else {
        y[g * kGroup + i] = v;
      }
    }
  }
}

// 1 << i for bit i of a 32-bit field (a table, so that loops over the bits vectorize).
constexpr uint32_t kBit[32] = {
    1u << 0,  1u << 1,  1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
    1u << 8,  1u << 9,  1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15,
    1u << 16, 1u << 17, 1u << 18, 1u << 19, 1u << 20, 1u << 21, 1u << 22, 1u << 23,
    1u << 24, 1u << 25, 1u << 26, 1u << 27, 1u << 28, 1u << 29, 1u << 30, 1u << 31,
};

// Q4_0, Q4_1, Q5_0, Q5_1: d (float16), then m (float16) when kMin, then 32 fifth bits (a
// little-endian uint32, bit i for value i) when kHigh, then 16 bytes: value j's low four
// bits in byte j's low nibble, value j + 16's in its high one. Without m the value is
// d * (q - 8) (Q4_0) or d * (q - 16) (Q5_0); with it d * q + m.
template <bool kMin, bool kHigh>
inline void DecodeLegacy(const uint8_t* b, float* y) {
  const float d = Half(Load16(b));
  const float m = kMin ? Half(Load16(b + 2)) : 0.0f;
  const uint8_t* p = b + (kMin ? 4 : 2);
  uint32_t qh = 0;
  if (kHigh) std::memcpy(&qh, p, sizeof qh);
  const uint8_t* qs = p + (kHigh ? 4 : 0);
  const int offset = kMin ? 0 : (kHigh ? 16 : 8);
  int8_t q[kQ8Block];
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < 16; ++j) {
      const int fifth = (qh & kBit[16 * h + j]) != 0 ? 16 : 0;
      q[16 * h + j] = static_cast<int8_t>((((qs[j] >> (4 * h)) & 0xF) | fifth) - offset);
    }
  }
  Scale<kQ8Block, kQ8Block, kMin>(q, &d, &m, y);
}

// Q8_0: d (float16), then 32 int8; the value is x * d.
inline void DecodeQ8_0(const uint8_t* b, float* y) {
  const float d = Half(Load16(b));
  Scale<kQ8Block, kQ8Block, false>(reinterpret_cast<const int8_t*>(b + 2), &d, nullptr, y);
}

// MXFP4 (gpt-oss's experts): one E8M0 byte e, then 16 bytes: value j's 4-bit code in byte j's
// low nibble, value j + 16's in its high one. The value is d * kMxfp4[code] with d = 2^(e - 128)
// (gguf.quants' e8m0_to_fp32_half: the float32 of bits (e - 1) << 23, or 0x00200000 << e, a
// subnormal, for e < 2), the codes E2M1 values doubled.
constexpr int8_t kMxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

inline void DecodeMXFP4(const uint8_t* b, float* y) {
  const uint32_t e = b[0];
  const float d = FromBits(e < 2 ? 0x00200000u << e : (e - 1) << 23);
  int8_t q[kQ8Block];
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < 16; ++j) q[16 * h + j] = kMxfp4[(b[1 + j] >> (4 * h)) & 0xF];
  }
  Scale<kQ8Block, kQ8Block, false>(q, &d, nullptr, y);
}

// Q2_K: 16 bytes of scales (low nibble: the group's scale, high: its min), 64 bytes of 2-bit
// values, d and dmin (float16). Value 128 h + 32 s + l is bits 2s..2s+1 of byte 32 h + l;
// group g (16 values) is d * sc[g] * q - dmin * m[g].
inline void DecodeQ2_K(const uint8_t* b, float* y) {
  const uint8_t* sc = b;
  const uint8_t* qs = b + 16;
  const float d = Half(Load16(b + 80)), dmin = Half(Load16(b + 82));
  float scale[16], add[16];
  for (int g = 0; g < 16; ++g) {
    scale[g] = d * static_cast<float>(sc[g] & 0xF);
    add[g] = -(dmin * static_cast<float>(sc[g] >> 4));
  }
  int8_t q[kSuper];
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      for (int l = 0; l < 32; ++l) q[128 * h + 32 * s + l] = (qs[32 * h + l] >> (2 * s)) & 3;
    }
  }
  Scale<kSuper, 16, true>(q, scale, add, y);
}

// Q3_K: 32 bytes of high bits (bit s of byte l for value 32 s + l), 64 bytes of low 2-bit
// values (as Q2_K's), 12 bytes of 6-bit scales (low nibbles of bytes 0-7, then their high
// nibbles; the top two bits from bytes 8-11, two at a time), d (float16). The value is
// d * (sc[g] - 32) * (low - 4 * !high), group g of 16 values.
inline void DecodeQ3_K(const uint8_t* b, float* y) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* sc = b + 96;
  const float d = Half(Load16(b + 108));
  float scale[16];
  for (int k = 0; k < 16; ++k) {
    const int low = (sc[k % 8] >> (4 * (k / 8))) & 0xF;
    const int high = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
    scale[k] = d * static_cast<float>((low | high << 4) - 32);
  }
  int8_t q[kSuper];
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      for (int l = 0; l < 32; ++l) {
        const int high = (hmask[l] >> (4 * h + s)) & 1;
        q[128 * h + 32 * s + l] =
            static_cast<int8_t>(((qs[32 * h + l] >> (2 * s)) & 3) - ((high ^ 1) << 2));
      }
    }
  }
  Scale<kSuper, 16, false>(q, scale, nullptr, y);
}

// Q4_K's and Q5_K's 12 bytes of 6-bit scales and mins for 8 groups of 32 into
// scale[g] = d * sc[g] and add[g] = -(dmin * m[g]) (gguf.quants' Q4_K.get_scale_min).
inline void ScaleMin(const uint8_t* b, float* scale, float* add) {
  const float d = Half(Load16(b)), dmin = Half(Load16(b + 2));
  const uint8_t* s = b + 4;
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? s[j] & 0x3F : (s[j + 4] & 0xF) | ((s[j - 4] >> 2) & 0x30);
    const int m = j < 4 ? s[j + 4] & 0x3F : (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    scale[j] = d * static_cast<float>(sc);
    add[j] = -(dmin * static_cast<float>(m));
  }
}

// Q4_K (kHigh false) and Q5_K: d, dmin (float16), 12 bytes of scales and mins (ScaleMin);
// Q5_K then 32 bytes of fifth bits (bit s of byte l for value 32 s + l); then 128 bytes of
// nibbles: value 64 c + 32 s + l in nibble s of byte 32 c + l. Group g (32 values) is
// d * sc[g] * q - dmin * m[g].
template <bool kHigh>
inline void DecodeQ4_KQ5_K(const uint8_t* b, float* y) {
  float scale[8], add[8];
  ScaleMin(b, scale, add);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (kHigh ? 48 : 16);
  int8_t q[kSuper];
  for (int c = 0; c < 4; ++c) {
    for (int s = 0; s < 2; ++s) {
      for (int l = 0; l < 32; ++l) {
        const int fifth = kHigh ? ((qh[l] >> (2 * c + s)) & 1) << 4 : 0;
        q[64 * c + 32 * s + l] = static_cast<int8_t>(((qs[32 * c + l] >> (4 * s)) & 0xF) | fifth);
      }
    }
  }
  Scale<kSuper, 32, true>(q, scale, add, y);
}

// Q6_K: 128 bytes of low nibbles (value 128 h + 64 s + l in nibble s of byte 64 h + l), 64
// of high 2-bit pairs (value 128 h + 32 s + l in bits 2s..2s+1 of byte 32 h + l), 16 int8
// scales, d (float16). Group g (16 values) is d * sc[g] * (q - 32).
inline void DecodeQ6_K(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = Half(Load16(b + 208));
  float scale[16];
  for (int g = 0; g < 16; ++g) scale[g] = d * static_cast<float>(sc[g]);
  int8_t low[kSuper], q[kSuper];
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 2; ++s) {
      for (int l = 0; l < 64; ++l) low[128 * h + 64 * s + l] = (ql[64 * h + l] >> (4 * s)) & 0xF;
    }
    for (int s = 0; s < 4; ++s) {
      for (int l = 0; l < 32; ++l) {
        const int i = 128 * h + 32 * s + l;
        q[i] = static_cast<int8_t>((low[i] | ((qh[32 * h + l] >> (2 * s)) & 3) << 4) - 32);
      }
    }
  }
  Scale<kSuper, 16, false>(q, scale, nullptr, y);
}

// The float types, one value a block: F32 as it is, F16 widened, BF16 as the top 16 bits.
inline void DecodeF32(const uint8_t* b, float* y) { std::memcpy(y, b, sizeof *y); }
inline void DecodeF16(const uint8_t* b, float* y) { *y = Half(Load16(b)); }
inline void DecodeBF16(const uint8_t* b, float* y) {
  *y = FromBits(static_cast<uint32_t>(Load16(b)) << 16);
}

// `n` consecutive blocks of one type from s into y, with its block decoder inlined.
template <void (*kDecode)(const uint8_t*, float*), int64_t kValues, int64_t kBytes>
void DecodeBlocks(const uint8_t* s, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) kDecode(s + i * kBytes, y + i * kValues);
}

// A type's block: its values and bytes, and the decoder of a run of its blocks.
struct Format {
  int64_t values = 0;
  int64_t bytes = 0;
  void (*decode)(const uint8_t*, int64_t, float*) = nullptr;
};

template <void (*kDecode)(const uint8_t*, float*), int64_t kValues, int64_t kBytes>
constexpr Format Make() {
  return {kValues, kBytes, DecodeBlocks<kDecode, kValues, kBytes>};
}

// The format of GGML type `type`; false when this file does not read it.
inline bool FormatOf(int type, Format* f) {
  switch (type) {
    case kF32: *f = Make<DecodeF32, 1, 4>(); return true;
    case kF16: *f = Make<DecodeF16, 1, 2>(); return true;
    case kBF16: *f = Make<DecodeBF16, 1, 2>(); return true;
    case kQ4_0: *f = Make<DecodeLegacy<false, false>, 32, 18>(); return true;
    case kQ4_1: *f = Make<DecodeLegacy<true, false>, 32, 20>(); return true;
    case kQ5_0: *f = Make<DecodeLegacy<false, true>, 32, 22>(); return true;
    case kQ5_1: *f = Make<DecodeLegacy<true, true>, 32, 24>(); return true;
    case kQ8_0: *f = Make<DecodeQ8_0, 32, 34>(); return true;
    case kQ2_K: *f = Make<DecodeQ2_K, kSuper, 84>(); return true;
    case kQ3_K: *f = Make<DecodeQ3_K, kSuper, 110>(); return true;
    case kQ4_K: *f = Make<DecodeQ4_KQ5_K<false>, kSuper, 144>(); return true;
    case kQ5_K: *f = Make<DecodeQ4_KQ5_K<true>, kSuper, 176>(); return true;
    case kQ6_K: *f = Make<DecodeQ6_K, kSuper, 210>(); return true;
    case kMXFP4: *f = Make<DecodeMXFP4, 32, 17>(); return true;
    default: return false;
  }
}

// fn(c0, c1) over chunks [0, chunks), in runs of `run` chunks that the caller and up to
// threads - 1 started threads take in turn from one counter, so a thread whose core is busy
// with other work takes fewer (a fixed split waits for its slowest share).
constexpr int64_t kRun = 8;  // chunks a take: 32768 values, some 20-40 us of work

template <class Fn>
void OnThreads(int64_t chunks, int64_t threads, const Fn& fn, int64_t run = kRun) {
  const int64_t runs = (chunks + run - 1) / run;
  std::atomic<int64_t> next{0};
  auto work = [&fn, &next, chunks, runs, run] {
    const q8simd::IeeeFloat ieee;
    for (int64_t r = next.fetch_add(1); r < runs; r = next.fetch_add(1)) {
      fn(r * run, std::min(chunks, (r + 1) * run));
    }
  };
  std::vector<std::thread> helpers;
  for (int64_t t = 1; t < std::min(threads, runs); ++t) helpers.emplace_back(work);
  work();
  for (auto& h : helpers) h.join();
}

// The checks both directions share: the type is read here, and rows of n_cols values are
// whole blocks of it (and of Q8_0 when `q8`).
inline Status Check(int type, int64_t n_rows, int64_t n_cols, bool q8, Format* f) {
  if (!FormatOf(type, f)) return kUnsupported;
  if (n_rows < 0 || n_cols <= 0 || n_cols % f->values != 0) return kBadShape;
  if (q8 && n_cols % kQ8Block != 0) return kBadShape;
  return kOk;
}

// fn(f, v0, v1) over the n_rows * n_cols values of rows of GGML type `type` (f its Format),
// once Check has passed, in runs of chunks on up to `threads` threads (OnThreads): [v0, v1)
// a run's values, whole chunks of kChunk but the last.
template <class Fn>
inline Status OnValues(int type, int64_t n_rows, int64_t n_cols, bool q8, int64_t threads,
                       const Fn& fn) {
  Format f;
  const Status ok = Check(type, n_rows, n_cols, q8, &f);
  if (ok != kOk) return ok;
  const int64_t total = n_rows * n_cols;
  OnThreads((total + kChunk - 1) / kChunk, threads, [&](int64_t c0, int64_t c1) {
    fn(f, c0 * kChunk, std::min(total, c1 * kChunk));
  });
  return kOk;
}

// Rows (n_rows, n_cols) of GGML type `type` at src (n_rows * n_cols / block * block bytes)
// into out (n_rows * n_cols float32), on up to `threads` threads.
inline Status Dequantize(int type, const uint8_t* src, int64_t n_rows, int64_t n_cols,
                         float* out, int64_t threads) {
  const auto decode = [&](const Format& f, int64_t v0, int64_t v1) {
    f.decode(src + v0 / f.values * f.bytes, (v1 - v0) / f.values, out + v0);
  };
  return OnValues(type, n_rows, n_cols, false, threads, decode);
}

// The same rows as Q8_0 GGUF blocks into out (n_rows * n_cols / 32 blocks of 34 bytes): each
// chunk decoded into a buffer of kChunk floats on its thread's stack, then quantized.
inline Status Requantize(int type, const uint8_t* src, int64_t n_rows, int64_t n_cols,
                         uint8_t* out, int64_t threads) {
  q8isa::Isa isa = q8isa::kScalar;
  if (!q8isa::Select(&isa)) isa = q8isa::kScalar;
  const auto requantize = [&](const Format& f, int64_t v0, int64_t v1) {
    alignas(64) float buf[kChunk];
    for (int64_t v = v0; v < v1; v += kChunk) {
      const int64_t n = std::min(kChunk, v1 - v);
      f.decode(src + v / f.values * f.bytes, n / f.values, buf);
      QuantizeRun(buf, n, out + v / kQ8Block * kQ8Bytes, isa);
    }
  };
  return OnValues(type, n_rows, n_cols, true, threads, requantize);
}

}  // namespace q8requant

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

#endif  // Q8RULES_REQUANT_H_
