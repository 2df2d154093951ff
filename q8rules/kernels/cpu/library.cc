// The native library q8rules builds on first use (kernels/native/library.py): XLA FFI handlers
// for each op, and the C functions the Python side calls through ctypes. Each op's code is its
// own header: q8_matmul.h (with q8_tiles.h) the weight-only product, q8_matmul_t.h its
// transpose (the gradient with respect to x), q8_act_int8.h the Q8_0-activation product,
// decode_attention.h one new token's attention, repack.h the GGUF repack, requant.h GGUF's
// other tensor types as float32 and as Q8_0, requant_repack.h both in one pass, q8_ragged.h
// the grouped product of experts (one weight-only product per routed expert). The products'
// helper threads are helper_threads.h's. Every header reaches the SIMD instructions through
// simd.h, the one SIMD layer. The handlers' signatures are declared once each (ffi_bind.h).

// GCC 12's avx512fintrin.h seeds its conversions with _mm512_undefined_*(), which
// -Wuninitialized then reports at every inlined use in this library (GCC bug 105593); on that
// compiler alone those two warnings are off.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <algorithm>
#include <cstdint>
#include <string>

#include "decode_attention.h"
#include "ffi_bind.h"
#include "q8_act_int8.h"
#include "q8_matmul.h"
#include "q8_matmul_t.h"
#include "q8_ragged.h"
#include "repack.h"
#include "requant.h"
#include "requant_repack.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One new token's attention over layer `slot` of the cache, positions [0, pos] (clamped to the
// cache's length; `pos` one position for the batch, or one per row), each head's sink logit in
// its softmax when `sinks` holds H of them (none when it is empty): decode_attention.h.
inline ffi::Error DecodeAttentionImpl(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::S32> pos,
                               ffi::Buffer<ffi::F32> sinks,
                               ffi::Result<ffi::Buffer<ffi::F32>> out, float scale,
                               float softcap) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const auto od = out->dimensions();
  bool ok = qd.size() == 3 && kd.size() == 5 && vd.size() == 5 && od.size() == 3 &&
            k.element_type() == v.element_type();
  for (size_t i = 0; ok && i < 5; ++i) ok = kd[i] == vd[i];
  ok = ok && qd[0] == kd[1] && qd[2] == kd[4] && kd[3] > 0 && qd[1] % kd[3] == 0 &&
       od[0] == qd[0] && od[1] == qd[1] && od[2] == qd[2] && kd[2] > 0;
  if (!ok) {
    return ffi::Error::InvalidArgument(
        "q8_decode_attention: expected q (B, H, D), keys and values (L, B, S, KV, D) of one "
        "type, H a multiple of KV, out (B, H, D)");
  }
  const int64_t layers = kd[0], batch = kd[1], length = kd[2], kv_heads = kd[3], d = kd[4];
  const int64_t layer = slot.typed_data()[0];
  if (layer < 0 || layer >= layers) {
    return ffi::Error::InvalidArgument("q8_decode_attention: the layer is outside the cache");
  }
  const int64_t positions = static_cast<int64_t>(pos.element_count());
  if (positions != 1 && positions != batch) {
    return ffi::Error::InvalidArgument(
        "q8_decode_attention: expected one position, or one per row of the batch");
  }
  const int64_t sink_count = static_cast<int64_t>(sinks.element_count());
  if (sink_count != 0 && sink_count != qd[1]) {
    return ffi::Error::InvalidArgument(
        "q8_decode_attention: expected sinks of one logit per head (H), or none");
  }
  const float* sink = sink_count ? sinks.typed_data() : nullptr;
  std::vector<int64_t> ns(static_cast<size_t>(batch));
  int64_t work = 0;  // multiplications: scores and weighted values, every head
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t at = pos.typed_data()[positions == 1 ? 0 : b];
    ns[b] = std::clamp<int64_t>(at + 1, 1, length);
    work += 2 * ns[b] * qd[1] * d;
  }
  int64_t threads = std::max<int64_t>(1, work / q8mm::kWorkPerThread);
  if (threads > 1) threads = std::min<int64_t>(threads, q8mm::UsableCpus());
  const int64_t offset = layer * batch * length * kv_heads * d;
  q8isa::Isa isa;
  if (!q8isa::Select(&isa)) {
    return ffi::Error::InvalidArgument(q8isa::BadEnv("q8_decode_attention"));
  }
  if (k.element_type() == ffi::DataType::F32) {
    q8attn::DecodeAttention(isa, q.typed_data(),
                            static_cast<const float*>(k.untyped_data()) + offset,
                            static_cast<const float*>(v.untyped_data()) + offset, sink,
                            out->typed_data(), batch, length, kv_heads, qd[1], d, ns.data(), scale,
                            softcap, threads);
  } else if (k.element_type() == ffi::DataType::BF16) {
    q8attn::DecodeAttention(isa, q.typed_data(),
                            static_cast<const uint16_t*>(k.untyped_data()) + offset,
                            static_cast<const uint16_t*>(v.untyped_data()) + offset, sink,
                            out->typed_data(), batch, length, kv_heads, qd[1], d, ns.data(), scale,
                            softcap, threads);
  } else {
    return ffi::Error::InvalidArgument("q8_decode_attention: the cache must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

// The weight-only product (y = x @ W) and the same with Q8_0 activations (q8_act_int8.h), each
// on a whole weight and on one layer of stacked weights read in place.
Q8_PRODUCT_HANDLER(Q8Gemv, q8mm::Q8GemvImpl<false>);
Q8_LAYER_PRODUCT_HANDLER(Q8GemvLayer, q8mm::Q8GemvLayerImpl<false>);
Q8_PRODUCT_HANDLER(Q8GemvActQ8, q8mm::Q8GemvImpl<true>);
Q8_LAYER_PRODUCT_HANDLER(Q8GemvActQ8Layer, q8mm::Q8GemvLayerImpl<true>);

// The transposed product, y (M, K) = dy (M, N) @ W^T (q8_matmul_t.h): the product's operands
// with dy in x's place.
Q8_PRODUCT_HANDLER(Q8MatmulT, q8mmt::Q8MatmulTImpl);

// The grouped product of experts (q8_ragged.h): a layer product's operands, the int32 operand
// being the group sizes (E) and q, scale the experts' (E, K, N) and (E, K/32, N); weight-only
// and with Q8_0 activations.
Q8_LAYER_PRODUCT_HANDLER(Q8RaggedMatmul, q8ragged::Q8RaggedImpl<false>);
Q8_LAYER_PRODUCT_HANDLER(Q8RaggedMatmulActQ8, q8ragged::Q8RaggedImpl<true>);

XLA_FFI_DEFINE_HANDLER_SYMBOL(Q8DecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q (B, H, D)
                                  .Arg<ffi::AnyBuffer>()         // keys (L, B, S, KV, D)
                                  .Arg<ffi::AnyBuffer>()         // values (L, B, S, KV, D)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot () int32: the layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos () or (B,) int32
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks (H,), or (0,): none
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out (B, H, D)
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
);

// Q8_0 tensors as a GGUF file stores them, into the kernel layout (repack.h).
extern "C" void Q8RepackKernelBatch(const uint8_t* const* blocks, int8_t* dq, uint16_t* ds,
                                    int64_t batch, int64_t rows, int64_t nb, int64_t ldq,
                                    int64_t lds, int64_t q_stride, int64_t s_stride,
                                    int64_t threads) {
  q8repack::RepackKernelBatch(blocks, dq, ds, batch, rows, nb, ldq, lds, q_stride, s_stride,
                              threads);
}

// GGUF's other tensor types (requant.h): the block of GGML type `type` (its values and bytes,
// and 1), or 0 when the library does not read that type.
extern "C" int Q8RequantBlock(int type, int64_t* values, int64_t* bytes) {
  q8requant::Format f;
  if (!q8requant::FormatOf(type, &f)) return 0;
  *values = f.values;
  *bytes = f.bytes;
  return 1;
}

// Rows (n_rows, n_cols) of GGML type `type` into n_rows * n_cols float32, as
// gguf.quants.dequantize gives them. 0, or -1 for a type not read here, -2 for rows that are
// not whole blocks.
extern "C" int Q8Dequantize(int type, const uint8_t* src, int64_t n_rows, int64_t n_cols,
                            float* out, int64_t threads) {
  return q8requant::Dequantize(type, src, n_rows, n_cols, out, threads);
}

// The same rows as Q8_0 GGUF blocks (n_rows * n_cols / 32 of 34 bytes), as
// gguf.quants.quantize(dequantize(rows), Q8_0) gives them. Returns as Q8Dequantize (-2 also
// for n_cols not a multiple of 32).
extern "C" int Q8Requantize(int type, const uint8_t* src, int64_t n_rows, int64_t n_cols,
                            uint8_t* out, int64_t threads) {
  return q8requant::Requantize(type, src, n_rows, n_cols, out, threads);
}

// `batch` tensors (rows x n_cols each), tensor i of GGML type types[i], as Q8_0 straight in
// the kernel layout: Q8_0 ones transposed as they are, others requantized on the way; the
// other arguments as Q8RepackKernelBatch's (requant_repack.h). Returns as Q8Requantize.
extern "C" int Q8RequantizeKernelBatch(const int* types, const uint8_t* const* srcs, int8_t* dq,
                                       uint16_t* ds, int64_t batch, int64_t rows,
                                       int64_t n_cols, int64_t ldq, int64_t lds,
                                       int64_t q_stride, int64_t s_stride, int64_t threads) {
  return q8requant::RequantizeKernelBatch(types, srcs, dq, ds, batch, rows, n_cols, ldq, lds,
                                          q_stride, s_stride, threads);
}

// Whether a call would run a SIMD path (not scalar) on this CPU now.
extern "C" int Q8GemvHasAvx2() {
  q8isa::Isa isa;
  return q8isa::Select(&isa) && isa != q8isa::kScalar ? 1 : 0;
}

// Force (1) or stop forcing (0) the scalar path, whatever the CPU supports.
extern "C" void Q8GemvForceScalar(int force) { q8isa::g_force_scalar.store(force != 0); }

// The best path this CPU supports (isa.h's codes: 0 scalar, 1 avx2, 2 avx512, 3 neon,
// 4 neon_dotprod).
extern "C" int Q8GemvBestIsa() { return q8isa::Best(); }

// The path the next call would run (as above), or -1 if $Q8RULES_CPU_ISA is invalid.
extern "C" int Q8GemvSelectedIsa() {
  q8isa::Isa isa;
  return q8isa::Select(&isa) ? isa : -1;
}

// The path the last call ran, or -1 before the first call.
extern "C" int Q8GemvLastIsa() { return q8mm::g_last_isa.load(); }

// The threads the last call used (the caller and pool helpers), 0 before the first call.
extern "C" int Q8GemvLastThreads() { return q8mm::g_last_threads.load(); }

// At most n threads per native call from now on, the caller included (n <= 0: no limit).
extern "C" void Q8SetThreadLimit(int n) { q8mm::g_thread_limit.store(n > 0 ? n : 0); }

// How long the products' helper threads spin for the next product before they sleep (us >= 0).
extern "C" void Q8SetSpinMicroseconds(long long us) {
  q8helpers::g_spin_us.store(us > 0 ? us : 0);
}

// The threads a native call may use now: the process's CPUs, at most the limit.
extern "C" int Q8MaxThreads() { return static_cast<int>(q8mm::UsableCpus()); }

// The int8 path the last Q8_0-activation product ran (isa.h's codes, 2 being AVX-512 VNNI), or
// -1 before the first.
extern "C" int Q8GemvLastActPath() { return q8mm::g_last_act_path.load(); }

// The int8 path a Q8_0-activation product would run now (as above), or -1 if
// $Q8RULES_CPU_ISA is invalid.
extern "C" int Q8GemvSelectedActPath() {
  q8isa::Isa isa;
  return q8isa::Select(&isa) ? q8act::PathFor(isa) : -1;
}

// Q8_0 of x (m, k) as the Q8_0-activation product quantizes it: int8 values, scales (the
// float16 d widened) and -128 * block sums; on the int8 path of `isa` (isa.h's codes, capped at
// what this CPU has), for tests against gguf.quants.
extern "C" void Q8QuantizeActivations(const float* x, int64_t m, int64_t k, int8_t* xq,
                                      float* dx, int32_t* xc, int isa) {
  const q8isa::Isa best = q8isa::Best();
  q8isa::Isa path = q8isa::kScalar;
  if (isa >= 0 && isa < q8isa::kCount && q8isa::Rung(static_cast<q8isa::Isa>(isa)) >= 0 &&
      q8isa::Rung(static_cast<q8isa::Isa>(isa)) <= q8isa::Rung(best)) {
    path = q8act::PathFor(static_cast<q8isa::Isa>(isa));
  }
  q8act::QuantizeRows(x, m, k, k, xq, dx, xc, path);
}

// The name of path `isa` ("scalar", "avx2", "avx512"), or "" if there is none.
extern "C" const char* Q8GemvIsaName(int isa) {
  return isa >= 0 && isa < q8isa::kCount ? q8isa::kNames[isa] : "";
}

