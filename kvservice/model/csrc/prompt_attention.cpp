// Causal attention of a prompt's first chunk over its own keys: no cached context, query t
// sees keys 0..t. The colocated worker's prompt lane and every prefill step of a fresh prompt
// take this path.
//
// Registered as torch.ops.kvservice.prompt_attention:
//   q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]   float32, each row of heads contiguous (views of
//                                                the fused qkv projection are fine)
// returns [T, Hq, D]: softmax(q k^T * scale, causal) v, accumulated in float32.
//
// Why: torch's SDPA (flash attention for CPU) computes SmolLM2's 256-token prompt, 9 query heads,
// in ~1.0 ms a layer (58 GFLOP/s of the causal half), 11% of a prompt step. Here the scores and
// the weighted sum of values are two small matrix products per (KV head, tile of queries), in
// registers the way a GEMM micro-kernel keeps them, and key tiles past a query tile's last
// query are skipped. Each output's sums run in a fixed order: the same numbers in any batch.
//
// AVX-512 only; elsewhere the same loops in plain C++ (correct, not fast: the model keeps SDPA there).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "thread_pool.h"
#include "vector_exp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kQueryTile = 32;  // queries per task (and per scores buffer)
constexpr int64_t kKeyTile = 16;    // keys per score vector

struct Shapes {
  int64_t num_heads, head_dim, group;
  int64_t q_stride, k_stride, v_stride;  // elements between two tokens' rows
  float scale;
};

// Scores of queries [t0, t1) (their scaled rows in `q_scaled`) against keys [0, padded) of the
// transposed keys; keys past a row's query: -inf.
void scores_scalar(const float* q_scaled, const float* kt, int64_t kt_stride, int64_t head_dim, int64_t t0, int64_t t1,
                   int64_t padded, float* scores) {
  for (int64_t t = t0; t < t1; ++t) {
    float* row = scores + (t - t0) * padded;
    const float* q_row = q_scaled + (t - t0) * head_dim;
    for (int64_t p = 0; p < padded; ++p) {
      float dot = 0.f;
      for (int64_t d = 0; d < head_dim && p <= t; ++d) dot += q_row[d] * kt[d * kt_stride + p];
      row[p] = p <= t ? dot : -std::numeric_limits<float>::infinity();
    }
  }
}

#if defined(__AVX512F__)
// R queries' scores against keys [p0, p0 + 16 * C), from the transposed keys: one broadcast
// query value and C key vectors per d, R * C sums in registers. Rows of `q_scaled` are
// head_dim floats apart, rows of `out` (the scores) `padded`.
template <int R, int C>
inline void score_tile(const float* q_scaled, const float* kt, int64_t kt_stride, int64_t padded, int64_t head_dim, int64_t p0,
                       float* out) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    __m512 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = _mm512_loadu_ps(kt + d * kt_stride + p0 + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 qd = _mm512_set1_ps(q_scaled[r * head_dim + d]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(qd, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + r * padded + p0 + 16 * c, acc[r][c]);
}

// score_tile for n (1 to 8) rows.
template <int C>
inline void score_rows(int64_t n, const float* q_scaled, int64_t head_dim, const float* kt, int64_t kt_stride, int64_t padded,
                       int64_t p0, float* out) {
#define KVSERVICE_SCORE(R) return score_tile<R, C>(q_scaled, kt, kt_stride, padded, head_dim, p0, out)
  switch (n) {
    case 1: KVSERVICE_SCORE(1);
    case 2: KVSERVICE_SCORE(2);
    case 3: KVSERVICE_SCORE(3);
    case 4: KVSERVICE_SCORE(4);
    case 5: KVSERVICE_SCORE(5);
    case 6: KVSERVICE_SCORE(6);
    case 7: KVSERVICE_SCORE(7);
    default: KVSERVICE_SCORE(8);
  }
#undef KVSERVICE_SCORE
}

// R rows of output (D16 vectors each) += probabilities [R, keys [0, p_end)] times values.
template <int R, int D16>
inline void value_tile(const float* probs, int64_t padded, const float* v, int64_t v_stride, int64_t p_end,
                       const float* inv_total, float* out, int64_t out_ld) {
  __m512 acc[R][D16];
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < D16; ++d) acc[r][d] = _mm512_setzero_ps();
  for (int64_t p = 0; p < p_end; ++p) {
    __m512 vv[D16];
    for (int d = 0; d < D16; ++d) vv[d] = _mm512_loadu_ps(v + p * v_stride + 16 * d);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(probs[r * padded + p]);
      for (int d = 0; d < D16; ++d) acc[r][d] = _mm512_fmadd_ps(w, vv[d], acc[r][d]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(inv_total[r]);
    for (int d = 0; d < D16; ++d) _mm512_storeu_ps(out + r * out_ld + 16 * d, _mm512_mul_ps(acc[r][d], inv));
  }
}
#endif

// One task: KV head h, queries [t0, t1) of each of its query heads; kt: that head's K^T, [D,
// kt_stride] (keys past a query's own are masked).
template <int D16>
void attend_tile(const float* q, const float* kt, int64_t kt_stride, const float* v, const Shapes& s, int64_t h,
                 int64_t t0, int64_t t1, float* out, std::vector<float>& q_scaled, std::vector<float>& scores) {
  const int64_t head_dim = s.head_dim, rows = t1 - t0;
  const int64_t padded = (t1 + kKeyTile - 1) / kKeyTile * kKeyTile;
  scores.resize(rows * padded);
  q_scaled.resize(rows * head_dim);
  std::vector<float> inv_total(rows);
  for (int64_t g = 0; g < s.group; ++g) {
    const int64_t hq = h * s.group + g;
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t d = 0; d < head_dim; ++d)
        q_scaled[(t - t0) * head_dim + d] = q[t * s.q_stride + hq * head_dim + d] * s.scale;
#if defined(__AVX512F__)
    if constexpr (D16 > 0) {
      // Scores, 8 queries x 32 keys a tile; only the key tiles a query of the 8 can see.
      for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        const int64_t n = std::min<int64_t>(8, rows - r0);
        const int64_t visible = t0 + r0 + n;  // keys [0, visible) for the last of them
        const float* qs = q_scaled.data() + r0 * head_dim;
        float* out_rows = scores.data() + r0 * padded;
        for (int64_t p0 = 0; p0 < visible; p0 += 32) {
          if (p0 + 32 <= padded) {
            score_rows<2>(n, qs, head_dim, kt, kt_stride, padded, p0, out_rows);
          } else {
            score_rows<1>(n, qs, head_dim, kt, kt_stride, padded, p0, out_rows);
          }
        }
      }
      // Softmax of each row over keys [0, t]; the rest of the row becomes 0.
      const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      for (int64_t r = 0; r < rows; ++r) {
        float* row = scores.data() + r * padded;
        const int64_t visible = t0 + r + 1, end = (visible + 15) / 16 * 16;
        const __m512 limit = _mm512_set1_ps(static_cast<float>(visible));
        __m512 max16 = minus_inf;
        for (int64_t p0 = 0; p0 < end; p0 += 16) {
          const __mmask16 past = _mm512_cmp_ps_mask(_mm512_add_ps(_mm512_set1_ps(static_cast<float>(p0)), lane), limit, _CMP_GE_OQ);
          const __m512 x = _mm512_mask_blend_ps(past, _mm512_loadu_ps(row + p0), minus_inf);
          _mm512_storeu_ps(row + p0, x);
          max16 = _mm512_max_ps(max16, x);
        }
        const __m512 max_score = _mm512_set1_ps(_mm512_reduce_max_ps(max16));
        __m512 total16 = _mm512_setzero_ps();
        for (int64_t p0 = 0; p0 < end; p0 += 16) {
          const __m512 e = kvservice::exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(row + p0), max_score));
          _mm512_storeu_ps(row + p0, e);
          total16 = _mm512_add_ps(total16, e);
        }
        std::fill(row + end, row + padded, 0.f);
        inv_total[r] = 1.f / _mm512_reduce_add_ps(total16);
      }
      // Outputs, 16 / D16 queries a tile, over the keys the tile's last query sees.
      constexpr int kRows = 16 / D16;
      const float* v_head = v + h * head_dim;
      float* out_head = out + hq * head_dim;
      const int64_t out_ld = s.num_heads * head_dim;
      for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
        const int64_t n = std::min<int64_t>(kRows, rows - r0), p_end = t0 + r0 + n;
        const float* probs = scores.data() + r0 * padded;
        float* dst = out_head + (t0 + r0) * out_ld;
        if (n == kRows) {
          value_tile<kRows, D16>(probs, padded, v_head, s.v_stride, p_end, inv_total.data() + r0, dst, out_ld);
        } else {
          for (int64_t r = 0; r < n; ++r)
            value_tile<1, D16>(probs + r * padded, padded, v_head, s.v_stride, p_end, inv_total.data() + r0 + r,
                               dst + r * out_ld, out_ld);
        }
      }
      continue;
    }
#endif
    // Plain C++: the same steps, a scalar at a time.
    scores_scalar(q_scaled.data(), kt, kt_stride, head_dim, t0, t1, padded, scores.data());
    for (int64_t r = 0; r < rows; ++r) {
      float* row = scores.data() + r * padded;
      const int64_t visible = t0 + r + 1;
      float max_score = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < visible; ++p) max_score = std::max(max_score, row[p]);
      float total = 0.f;
      for (int64_t p = 0; p < padded; ++p) {
        row[p] = p < visible ? std::exp(row[p] - max_score) : 0.f;
        total += row[p];
      }
      float* dst = out + (t0 + r) * s.num_heads * head_dim + hq * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        float sum = 0.f;
        for (int64_t p = 0; p < visible; ++p) sum += row[p] * v[p * s.v_stride + h * head_dim + d];
        dst[d] = sum / total;
      }
    }
  }
}

// Writes softmax(q k^T * scale, causal) v into out, a contiguous [T, Hq, D] float32 tensor.
void prompt_attention_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [T, heads, D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "prompt_attention is for float32");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == num_tokens && k.size(2) == head_dim, "q, k, v shapes disagree");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == head_dim, "each token's heads must be one contiguous row");
  Shapes s{num_heads, head_dim, num_heads / num_kv_heads,
           q.stride(0), k.stride(0), v.stride(0), static_cast<float>(scale)};
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == at::kFloat,
              "out must be a contiguous float32 tensor of q's shape");
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = k.data_ptr<float>();
  const float* v_ptr = v.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  auto* tile = head_dim == 64 ? &attend_tile<4> : head_dim == 128 ? &attend_tile<8> : &attend_tile<0>;
  // Each KV head's K^T, [D, kt_stride], once for all its query tiles (a transpose per task took
  // ~4x the copies), zero past the last key.
  const int64_t kt_stride = (num_tokens + kKeyTile - 1) / kKeyTile * kKeyTile;
  std::vector<float> kt(num_kv_heads * head_dim * kt_stride, 0.f);
  kvservice::parallel_for(num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      float* kt_head = kt.data() + h * head_dim * kt_stride;
      for (int64_t p = 0; p < num_tokens; ++p) {
        const float* k_row = k_ptr + p * s.k_stride + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) kt_head[d * kt_stride + p] = k_row[d];
      }
    }
  });
  // Tasks: (query tile, KV head). A tile's work grows with its index (its keys), and the pool
  // hands each thread a contiguous range of tasks: so tiles go heaviest, lightest, next
  // heaviest, next lightest, ..., and any contiguous half holds about half the work (in index
  // order the first half held 26 of 36 units: 8 tiles, 2 threads).
  const int64_t num_tiles = (num_tokens + kQueryTile - 1) / kQueryTile;
  kvservice::parallel_for(num_tiles * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_scaled, scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t tile_index = i % 2 == 0 ? num_tiles - 1 - i / 2 : i / 2;
      const int64_t t0 = tile_index * kQueryTile, t1 = std::min(num_tokens, t0 + kQueryTile);
      tile(q_ptr, kt.data() + h * head_dim * kt_stride, kt_stride, v_ptr, s, h, t0, t1, out_ptr, q_scaled, scores);
    }
  });
}

at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  auto out = at::empty(q.sizes(), q.options());  // prompt_attention_out checks the shapes
  prompt_attention_out(q, k, v, scale, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvservice, m) {
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  // The same into a given tensor (a slice of the step's output: no copy after, which from the
  // engine's step thread cost an OpenMP region a prompt and layer).
  m.def("prompt_attention_out(Tensor q, Tensor k, Tensor v, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kvservice, CPU, m) {
  m.impl("prompt_attention", &prompt_attention);
  m.impl("prompt_attention_out", &prompt_attention_out);
}
