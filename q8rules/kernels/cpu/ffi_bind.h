// The FFI bindings of the products, declared once: a product's handler takes the pool, x, q
// and the scales (and, on stacked weights, the layer index) and returns y.

#ifndef Q8RULES_FFI_BIND_H_
#define Q8RULES_FFI_BIND_H_

#include "xla/ffi/api/ffi.h"

// x (M, K) f32, q (K, N) int8 (stacked: (L, K, N)), scale (K/32, N) f32 / f16 (stacked:
// (L, K/32, N)), on the CPU's thread pool. The transposed product (q8_matmul_t.h) takes the
// same operands with dy (M, N) f32 in x's place.
#define Q8_PRODUCT_OPERANDS                      \
  ::xla::ffi::Ffi::Bind()                        \
      .Ctx<::xla::ffi::ThreadPool>()             \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>() \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S8>>()  \
      .Arg<::xla::ffi::AnyBuffer>()

// name(x, q, scale) -> y (M, N) f32, computed by impl.
#define Q8_PRODUCT_HANDLER(name, impl) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl, Q8_PRODUCT_OPERANDS.Ret<::xla::ffi::Buffer<::xla::ffi::F32>>())

// name(x, q, scale, layer () int32) -> y (M, N) f32: layer `layer` of stacked q and scale.
#define Q8_LAYER_PRODUCT_HANDLER(name, impl)                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl,                                   \
                                Q8_PRODUCT_OPERANDS                           \
                                    .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() \
                                    .Ret<::xla::ffi::Buffer<::xla::ffi::F32>>())

#endif  // Q8RULES_FFI_BIND_H_
