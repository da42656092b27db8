// The kernels' entry points, for the ops built on them (decode_layer.cpp): each .cpp
// defines its op inside an anonymous namespace and exports it here under the same name.

#pragma once

#include <ATen/ATen.h>

namespace kvservice {

at::Tensor block_quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& mins, const c10::optional<at::Tensor>& bias);
at::Tensor add_rms_norm_(at::Tensor residual, const c10::optional<at::Tensor>& x, const at::Tensor& weight,
                         double eps);
// What rotary_ checks before it rotates anything (shapes, dtypes, every position in the tables).
void check_rotary_args(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_table,
                       const at::Tensor& sin_table, int64_t num_heads, int64_t head_dim);
void rotary_(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos_table, const at::Tensor& sin_table,
             int64_t num_heads, int64_t head_dim);
// SwiGLU's act = silu(gate) * up of the fused [T, 2I] gate/up projection: [T, I].
at::Tensor silu_mul(const at::Tensor& gate_up);
// next_kv_layer: the next layer's cache, whose rows of these requests it starts prefetching.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_table,
                                  const at::Tensor& starts, int64_t num_queries, double scale,
                                  const c10::optional<at::Tensor>& next_kv_layer = c10::nullopt);

}  // namespace kvservice
