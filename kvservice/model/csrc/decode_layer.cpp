// One decoder layer of a decode step in one call: the same kernels and ATen ops, in the same
// order, as CausalLM.forward's per-op path (so the same numbers), without the ~20 Python
// dispatches a layer costs there (and the GIL hand-offs between them, which a server's
// event loop thread turns into waits). For a batch of decode queries only (no prompt
// chunks), with block-quantized weights.
//
// Registered as torch.ops.kvservice.decode_layer_:
//   residual [T, H]   the residual stream, updated in place (+= attention, += MLP)
//   x        [T, H]   input_layernorm(residual), as the previous layer's call returned it
//   *_w      each weight's (codes, scales, mins) of kvservice.model.block_quant
//   kv_layer          [2, num_blocks, block_size, Hkv, D]; this step's K/V are written at slot_mapping
//   next_kv_layer     the next layer's cache (none for the last): attention starts prefetching its rows
// returns next_norm(residual): the next layer's input (or the final norm's output).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

namespace {

at::Tensor linear(const at::Tensor& x, at::TensorList w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.size() == 3, "a block-quantized weight is (codes, scales, mins)");
  return kvservice::block_quant_linear(x, w[0], w[1], w[2], bias);
}

at::Tensor decode_layer_(at::Tensor residual, const at::Tensor& x, at::TensorList qkv_w,
                         const c10::optional<at::Tensor>& qkv_bias, at::TensorList o_w,
                         const c10::optional<at::Tensor>& o_bias, at::TensorList gate_up_w, at::TensorList down_w,
                         const at::Tensor& post_norm, double post_eps, const at::Tensor& next_norm, double next_eps,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::Tensor kv_layer,
                         const at::Tensor& positions, const at::Tensor& cos_table, const at::Tensor& sin_table,
                         const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& starts,
                         int64_t num_queries, double scale, const c10::optional<at::Tensor>& next_kv_layer) {
  const int64_t num_tokens = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(block_table.size(0) * num_queries == num_tokens, "every token must be a decode query");
  // Attention: qkv, rotary on q and k, this step's K/V into the cache, attention over the cache.
  at::Tensor qkv = linear(x, qkv_w, qkv_bias);  // [T, (Hq + 2 Hkv) * D]
  kvservice::rotary_(qkv, positions, cos_table, sin_table, num_heads + num_kv_heads, head_dim);
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
  at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({num_tokens, num_kv_heads, head_dim});
  at::Tensor flat = kv_layer.flatten(1, 2);  // [2, num_blocks * block_size, Hkv, D]
  flat.select(0, 0).index_copy_(0, slot_mapping, k);
  flat.select(0, 1).index_copy_(0, slot_mapping, v);
  at::Tensor q = qkv.narrow(1, 0, q_size).view({num_tokens, num_heads, head_dim}).contiguous();
  at::Tensor attn = kvservice::paged_decode_attention(q, kv_layer, block_table, starts, num_queries, scale, next_kv_layer);
  at::Tensor attn_out = linear(attn.view({num_tokens, q_size}), o_w, o_bias);
  at::Tensor h = kvservice::add_rms_norm_(residual, attn_out, post_norm, post_eps);
  // MLP: SwiGLU, as the Python path computes it.
  at::Tensor act = kvservice::silu_mul(linear(h, gate_up_w, c10::nullopt));
  at::Tensor mlp_out = linear(act, down_w, c10::nullopt);
  return kvservice::add_rms_norm_(residual, mlp_out, next_norm, next_eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvservice, m) {
  m.def(
      "decode_layer_(Tensor(a!) residual, Tensor x, Tensor[] qkv_w, Tensor? qkv_bias, Tensor[] o_w, Tensor? o_bias, "
      "Tensor[] gate_up_w, Tensor[] down_w, Tensor post_norm, float post_eps, Tensor next_norm, float next_eps, "
      "int num_heads, int num_kv_heads, int head_dim, Tensor(b!) kv_layer, Tensor positions, Tensor cos_table, "
      "Tensor sin_table, Tensor slot_mapping, Tensor block_table, Tensor starts, int num_queries, float scale, "
      "Tensor? next_kv_layer=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvservice, CPU, m) { m.impl("decode_layer_", &decode_layer_); }
