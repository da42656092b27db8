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
//                     (the compute dtype, or bfloat16: kv_row.h)
//   next_kv_layer     the next layer's cache (none for the last): attention starts prefetching its rows
// returns next_norm(residual): the next layer's input (or the final norm's output).
//
// torch.ops.kvservice.decode_layers_ runs every layer of the step in one call (for a step whose
// KV connector has no per-layer hooks): the same calls in the same order, so the same numbers,
// without the ~10 us of Python and argument conversion between two layers' calls, during which
// one core idles (SmolLM2: 30 layers, ~0.3 ms a step). Per layer l, `weights` holds
// 14 tensors from l * 14 on (qkv, o, gate_up and down's (codes, scales, mins), post_norm,
// next_norm), `biases` 2 (qkv, o) and `eps` 2 (post, next); kv_caches[l] is its cache.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "kv_row.h"
#include "ops.h"
#include "rotary.h"
#include "thread_pool.h"

#include <cstring>

namespace {

at::Tensor linear(const at::Tensor& x, at::TensorList w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.size() == 3, "a block-quantized weight is (codes, scales, mins)");
  return kvservice::block_quant_linear(x, w[0], w[1], w[2], bias);
}

// Checks that kv_layer is a contiguous [2, num_blocks, block_size, Hkv, D] cache whose rows hold
// num_kv_heads heads of head_dim values (kv_row.h), and that every one of the `num_tokens` slots lies in it.
void check_cache_slots(const at::Tensor& kv_layer, int64_t num_kv_heads, int64_t head_dim,
                       const at::Tensor& slot_mapping, int64_t num_tokens) {
  TORCH_CHECK(kv_layer.is_contiguous() && kv_layer.dim() == 5 && kv_layer.size(0) == 2,
              "kv_layer must be a contiguous [2, num_blocks, block_size, Hkv, D] tensor");
  TORCH_CHECK(kv_layer.size(3) == num_kv_heads && kv_layer.size(4) == kvservice::row_width(kv_layer.scalar_type(), head_dim),
              "the K and V rows must match kv_layer's [Hkv, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == num_tokens,
              "slot_mapping must be a contiguous int64 tensor, a slot per token");
  const int64_t num_slots = kv_layer.size(1) * kv_layer.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " outside the cache's ", num_slots);
  }
}

}  // namespace

namespace kvservice {

// A step's new K and V rows ([T, Hkv, D] each, a token's row contiguous, any token stride: the
// qkv projection's columns in place) into the cache rows at slot_mapping: a row copy each where
// the cache has their dtype, else each value rounded to the cache's (kv_row.h). What two
// index_copy_ calls do, without their ~9 us a layer (16 requests; SmolLM2's 30 layers: ~0.25 ms
// of a step). Every slot is checked before anything is written.
void write_kv_(at::Tensor kv_layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot_mapping) {
  const int64_t num_tokens = slot_mapping.numel();
  TORCH_CHECK(kv_layer.dim() == 5, "kv_layer must be a contiguous [2, num_blocks, block_size, Hkv, D] tensor");
  const int64_t num_kv_heads = k.dim() == 3 ? k.size(1) : 0, head_dim = k.dim() == 3 ? k.size(2) : 0;
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == num_tokens && t->size(1) == num_kv_heads && t->size(2) == head_dim &&
                    t->stride(2) == 1 && t->stride(1) == t->size(2) && t->scalar_type() == k.scalar_type(),
                "k and v must be [T, Hkv, D] of one dtype and kv_layer's shape, each token's row contiguous");
  }
  check_cache_slots(kv_layer, num_kv_heads, head_dim, slot_mapping, num_tokens);
  const int64_t num_slots = kv_layer.size(1) * kv_layer.size(2), token_row = kv_layer.size(3) * kv_layer.size(4);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_", [&] {
    const scalar_t* k_src = k.data_ptr<scalar_t>();
    const scalar_t* v_src = v.data_ptr<scalar_t>();
    kvservice::visit_kv_type<scalar_t>(kv_layer.scalar_type(), [&](auto kv_tag) {
      using kv_t = std::remove_cv_t<std::remove_pointer_t<decltype(kv_tag)>>;
      kv_t* keys = static_cast<kv_t*>(kv_layer.data_ptr());
      kv_t* values = keys + num_slots * token_row;
      for (int64_t t = 0; t < num_tokens; ++t) {
        kvservice::store_token(keys + slots[t] * token_row, k_src + t * k.stride(0), num_kv_heads, head_dim);
        kvservice::store_token(values + slots[t] * token_row, v_src + t * v.stride(0), num_kv_heads, head_dim);
      }
    });
  });
}

}  // namespace kvservice

namespace {

// A decode step's qkv [T, (Hq + 2 Hkv) * D] after its projection: q and k rotated (as rotary_),
// this step's K and V rows into the cache at slot_mapping (as write_kv_), and q returned as a
// contiguous [T, Hq, D] tensor for attention, in one pass over the tokens on the pool. Done as
// rotary_, write_kv_ and a copy of q, the second and third ran on one thread and the op calls
// between them cost more than the work (SmolLM2, 14 requests: ~14 us a layer, 0.4 ms a step, the
// other thread spinning meanwhile). qkv's k columns are rotated in place.
at::Tensor rotary_write_kv(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_table,
                           const at::Tensor& sin_table, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           at::Tensor& kv_layer, const at::Tensor& slot_mapping) {
  const int64_t num_tokens = qkv.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  kvservice::check_rotary_args(qkv, positions, cos_table, sin_table, num_heads + num_kv_heads, head_dim);
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "qkv must be [T, (Hq + 2 Hkv) * D]");
  check_cache_slots(kv_layer, num_kv_heads, head_dim, slot_mapping, num_tokens);
  auto q = at::empty({num_tokens, num_heads, head_dim}, qkv.options());
  const int64_t num_slots = kv_layer.size(1) * kv_layer.size(2), token_row = kv_layer.size(3) * kv_layer.size(4);
  const int64_t row_stride = qkv.stride(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cos_ptr = cos_table.data_ptr<float>();
  const float* sin_ptr = sin_table.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_write_kv", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    scalar_t* q_out = q.data_ptr<scalar_t>();
    kvservice::visit_kv_type<scalar_t>(kv_layer.scalar_type(), [&](auto kv_tag) {
      using kv_t = std::remove_cv_t<std::remove_pointer_t<decltype(kv_tag)>>;
      kv_t* keys = static_cast<kv_t*>(kv_layer.data_ptr());
      kv_t* values = keys + num_slots * token_row;
      kvservice::parallel_for(num_tokens, 4, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          scalar_t* row = base + t * row_stride;
          kvservice::rotate_heads(row, cos_ptr + pos[t] * head_dim, sin_ptr + pos[t] * head_dim,
                                  num_heads + num_kv_heads, head_dim);
          std::memcpy(q_out + t * q_size, row, q_size * sizeof(scalar_t));
          kvservice::store_token(keys + slots[t] * token_row, row + q_size, num_kv_heads, head_dim);
          kvservice::store_token(values + slots[t] * token_row, row + q_size + kv_size, num_kv_heads, head_dim);
        }
      });
    });
  });
  return q;
}

at::Tensor decode_layer_(at::Tensor residual, const at::Tensor& x, at::TensorList qkv_w,
                         const c10::optional<at::Tensor>& qkv_bias, at::TensorList o_w,
                         const c10::optional<at::Tensor>& o_bias, at::TensorList gate_up_w, at::TensorList down_w,
                         const at::Tensor& post_norm, double post_eps, const at::Tensor& next_norm, double next_eps,
                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::Tensor kv_layer,
                         const at::Tensor& positions, const at::Tensor& cos_table, const at::Tensor& sin_table,
                         const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& starts,
                         int64_t num_queries, double scale, const c10::optional<at::Tensor>& next_kv_layer) {
  const int64_t num_tokens = x.size(0), q_size = num_heads * head_dim;
  TORCH_CHECK(block_table.size(0) * num_queries == num_tokens, "every token must be a decode query");
  // Attention: qkv, rotary on q and k, this step's K/V into the cache, attention over the cache.
  at::Tensor qkv = linear(x, qkv_w, qkv_bias);  // [T, (Hq + 2 Hkv) * D]
  at::Tensor q = rotary_write_kv(qkv, positions, cos_table, sin_table, num_heads, num_kv_heads, head_dim, kv_layer,
                                 slot_mapping);
  at::Tensor attn = kvservice::paged_decode_attention(q, kv_layer, block_table, starts, num_queries, scale, next_kv_layer);
  at::Tensor attn_out = linear(attn.view({num_tokens, q_size}), o_w, o_bias);
  at::Tensor h = kvservice::add_rms_norm_(residual, attn_out, post_norm, post_eps);
  // MLP: SwiGLU, as the Python path computes it.
  at::Tensor act = kvservice::silu_mul(linear(h, gate_up_w, c10::nullopt));
  at::Tensor mlp_out = linear(act, down_w, c10::nullopt);
  return kvservice::add_rms_norm_(residual, mlp_out, next_norm, next_eps);
}

constexpr int64_t kWeightsPerLayer = 14, kBiasesPerLayer = 2, kEpsPerLayer = 2;

at::Tensor decode_layers_(at::Tensor residual, const at::Tensor& x, at::TensorList weights,
                          const c10::List<c10::optional<at::Tensor>>& biases, at::ArrayRef<double> eps,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, at::TensorList kv_caches,
                          const at::Tensor& positions, const at::Tensor& cos_table, const at::Tensor& sin_table,
                          const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& starts,
                          int64_t num_queries, double scale) {
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(num_layers > 0, "decode_layers_ needs at least one layer");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == num_layers * kWeightsPerLayer &&
                  static_cast<int64_t>(biases.size()) == num_layers * kBiasesPerLayer &&
                  static_cast<int64_t>(eps.size()) == num_layers * kEpsPerLayer,
              "decode_layers_: per layer 14 weights, 2 biases and 2 eps, and one cache");
  at::Tensor hidden = x;
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::TensorList w = weights.slice(l * kWeightsPerLayer, kWeightsPerLayer);
    const c10::optional<at::Tensor> next_kv =
        l + 1 < num_layers ? c10::optional<at::Tensor>(kv_caches[l + 1]) : c10::nullopt;
    hidden = decode_layer_(residual, hidden, w.slice(0, 3), biases.get(l * kBiasesPerLayer), w.slice(3, 3),
                           biases.get(l * kBiasesPerLayer + 1), w.slice(6, 3), w.slice(9, 3), w[12],
                           eps[l * kEpsPerLayer], w[13], eps[l * kEpsPerLayer + 1], num_heads, num_kv_heads,
                           head_dim, kv_caches[l], positions, cos_table, sin_table, slot_mapping, block_table,
                           starts, num_queries, scale, next_kv);
  }
  return hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvservice, m) {
  m.def("write_kv_(Tensor(a!) kv_layer, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
  m.def(
      "decode_layer_(Tensor(a!) residual, Tensor x, Tensor[] qkv_w, Tensor? qkv_bias, Tensor[] o_w, Tensor? o_bias, "
      "Tensor[] gate_up_w, Tensor[] down_w, Tensor post_norm, float post_eps, Tensor next_norm, float next_eps, "
      "int num_heads, int num_kv_heads, int head_dim, Tensor(b!) kv_layer, Tensor positions, Tensor cos_table, "
      "Tensor sin_table, Tensor slot_mapping, Tensor block_table, Tensor starts, int num_queries, float scale, "
      "Tensor? next_kv_layer=None) -> Tensor");
  m.def(
      "decode_layers_(Tensor(a!) residual, Tensor x, Tensor[] weights, Tensor?[] biases, float[] eps, int num_heads, "
      "int num_kv_heads, int head_dim, Tensor(b!)[] kv_caches, Tensor positions, Tensor cos_table, Tensor sin_table, "
      "Tensor slot_mapping, Tensor block_table, Tensor starts, int num_queries, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvservice, CPU, m) {
  m.impl("write_kv_", &kvservice::write_kv_);
  m.impl("decode_layer_", &decode_layer_);
  m.impl("decode_layers_", &decode_layers_);
}
