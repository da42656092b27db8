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
// AVX-512 and AVX2: the same tiles over 16 or 8 lanes, sized to the register file. On 2 Zen 3
// cores (AVX2), SmolLM2's 256-token prompt, all 9 heads of a layer: SDPA 1.34-1.66 ms, this
// 0.76-0.92 ms; 1,024 tokens 14.4-15.2 against 13.3. Elsewhere the same loops in plain C++
// (correct, not fast: the model keeps SDPA there).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "thread_pool.h"
#include "vector_exp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kKeyTile = 16;  // keys come padded to a multiple of this: one AVX-512 vector, two AVX2

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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define KVSERVICE_PROMPT_LANES 1
// One vector of float32 lanes and what the kernel does with it: 16 lanes on AVX-512, 8 on AVX2.
// The tiles below are written once over these; their sizes follow the register file.
#if defined(__AVX512F__)
struct Lanes {
  using V = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kQueryTile = 32;  // queries per task (and per scores buffer)
  static constexpr int kScoreRows = 8;   // queries per score tile: 8 x 2 sums of the 32 registers
  static constexpr int kValueSums = 16;   // output vectors a value tile keeps in registers
  static constexpr int kValueVectors = 8;  // of them, at most this many along one query's row
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V exp(V x) { return kvservice::exp_nonpositive16(x); }
  static float reduce_max(V a) { return _mm512_reduce_max_ps(a); }
  static float reduce_add(V a) { return _mm512_reduce_add_ps(a); }
  // x with its lanes at key p0 + i >= limit set to -inf.
  static V mask_past(V x, int64_t p0, int64_t limit) {
    const V lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __mmask16 past = _mm512_cmp_ps_mask(_mm512_add_ps(set1(static_cast<float>(p0)), lane),
                                              set1(static_cast<float>(limit)), _CMP_GE_OQ);
    return _mm512_mask_blend_ps(past, x, set1(-std::numeric_limits<float>::infinity()));
  }
};
#else
struct Lanes {
  using V = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kQueryTile = 24;  // queries per task: 4 score tiles, 8 value tiles
  static constexpr int kScoreRows = 6;   // queries per score tile: 6 x 2 sums of the 16 registers
  static constexpr int kValueSums = 12;  // 3 queries x 4 vectors
  static constexpr int kValueVectors = 4;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V exp(V x) { return kvservice::exp_nonpositive(x); }
  static float reduce_max(V a) {  // the 8 lanes' maximum
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static float reduce_add(V a) {  // lanes i and i + 4, then pairs, then the two left: a fixed order
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static V mask_past(V x, int64_t p0, int64_t limit) {
    const V lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const V past = _mm256_cmp_ps(_mm256_add_ps(set1(static_cast<float>(p0)), lane), set1(static_cast<float>(limit)), _CMP_GE_OQ);
    return _mm256_blendv_ps(x, set1(-std::numeric_limits<float>::infinity()), past);
  }
};
#endif
using V = Lanes::V;
constexpr int kWidth = Lanes::kWidth;

// R queries' scores against keys [p0, p0 + kWidth * C), from the transposed keys: one broadcast
// query value and C key vectors per d, R * C sums in registers. Rows of `q_scaled` are
// head_dim floats apart, rows of `out` (the scores) `padded`.
template <int R, int C>
inline void score_tile(const float* q_scaled, const float* kt, int64_t kt_stride, int64_t padded, int64_t head_dim, int64_t p0,
                       float* out) {
  V acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = Lanes::zero();
  for (int64_t d = 0; d < head_dim; ++d) {
    V kv[C];
    for (int c = 0; c < C; ++c) kv[c] = Lanes::load(kt + d * kt_stride + p0 + kWidth * c);
    for (int r = 0; r < R; ++r) {
      const V qd = Lanes::set1(q_scaled[r * head_dim + d]);
      for (int c = 0; c < C; ++c) acc[r][c] = Lanes::fmadd(qd, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) Lanes::store(out + r * padded + p0 + kWidth * c, acc[r][c]);
}

// score_tile for n (1 to kScoreRows) rows.
template <int C>
inline void score_rows(int64_t n, const float* q_scaled, int64_t head_dim, const float* kt, int64_t kt_stride, int64_t padded,
                       int64_t p0, float* out) {
#define KVSERVICE_SCORE(R) return score_tile<R, C>(q_scaled, kt, kt_stride, padded, head_dim, p0, out)
  static_assert(Lanes::kScoreRows == 6 || Lanes::kScoreRows == 8, "score_rows serves 6 or 8 rows");
  switch (n) {
    case 1: KVSERVICE_SCORE(1);
    case 2: KVSERVICE_SCORE(2);
    case 3: KVSERVICE_SCORE(3);
    case 4: KVSERVICE_SCORE(4);
    case 5: KVSERVICE_SCORE(5);
#if defined(__AVX512F__)
    case 6: KVSERVICE_SCORE(6);
    case 7: KVSERVICE_SCORE(7);
    default: KVSERVICE_SCORE(8);
#else
    default: KVSERVICE_SCORE(6);
#endif
  }
#undef KVSERVICE_SCORE
}

// R rows of output (DV vectors each, from dimension `dim0`) += probabilities [R, keys [0,
// p_end)] times values, then times each row's 1 / total.
template <int R, int DV>
inline void value_tile(const float* probs, int64_t padded, const float* v, int64_t v_stride, int64_t p_end,
                       const float* inv_total, float* out, int64_t out_ld, int64_t dim0) {
  V acc[R][DV];
  for (int r = 0; r < R; ++r)
    for (int d = 0; d < DV; ++d) acc[r][d] = Lanes::zero();
  for (int64_t p = 0; p < p_end; ++p) {
    V vv[DV];
    for (int d = 0; d < DV; ++d) vv[d] = Lanes::load(v + p * v_stride + dim0 + kWidth * d);
    for (int r = 0; r < R; ++r) {
      const V w = Lanes::set1(probs[r * padded + p]);
      for (int d = 0; d < DV; ++d) acc[r][d] = Lanes::fmadd(w, vv[d], acc[r][d]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const V inv = Lanes::set1(inv_total[r]);
    for (int d = 0; d < DV; ++d) Lanes::store(out + r * out_ld + dim0 + kWidth * d, Lanes::mul(acc[r][d], inv));
  }
}
#endif

#if defined(KVSERVICE_PROMPT_LANES)
constexpr int64_t kQueryTile = Lanes::kQueryTile;
#else
constexpr int64_t kQueryTile = 32;  // queries per task (and per scores buffer)
#endif

// One task: KV head h, queries [t0, t1) of each of its query heads; kt: that head's K^T, [D,
// kt_stride] (keys past a query's own are masked).
template <int D>
void attend_tile(const float* q, const float* kt, int64_t kt_stride, const float* v_head, int64_t v_stride, const Shapes& s,
                 int64_t h, int64_t t0, int64_t t1, float* out, std::vector<float>& q_scaled, std::vector<float>& scores) {
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
#if defined(KVSERVICE_PROMPT_LANES)
    if constexpr (D > 0) {
      // Scores, kScoreRows queries x 2 vectors of keys a tile (a last single vector where the
      // padded keys end), key tiles outermost: each tile's slice of K^T (head_dim lines) stays
      // in L1 for every query of the task that sees it, rather than K^T streaming from L2 once
      // per group of queries (AVX2, a layer of 1,024 tokens: 18.2 -> 16.4 ms).
      constexpr int64_t kKeys = 2 * kWidth;
      for (int64_t p0 = 0; p0 < t1; p0 += kKeys) {
        for (int64_t r0 = std::max<int64_t>(0, p0 - t0 - (Lanes::kScoreRows - 1)) / Lanes::kScoreRows * Lanes::kScoreRows;
             r0 < rows; r0 += Lanes::kScoreRows) {
          const int64_t n = std::min<int64_t>(Lanes::kScoreRows, rows - r0);
          if (p0 >= t0 + r0 + n) continue;  // past the keys the last of these queries sees
          const float* qs = q_scaled.data() + r0 * head_dim;
          float* out_rows = scores.data() + r0 * padded;
          if (p0 + kKeys <= padded) {
            score_rows<2>(n, qs, head_dim, kt, kt_stride, padded, p0, out_rows);
          } else {
            score_rows<1>(n, qs, head_dim, kt, kt_stride, padded, p0, out_rows);
          }
        }
      }
      // Softmax of each row over keys [0, t]; the rest of the row becomes 0.
      for (int64_t r = 0; r < rows; ++r) {
        float* row = scores.data() + r * padded;
        const int64_t visible = t0 + r + 1, end = (visible + kWidth - 1) / kWidth * kWidth;
        V max_lanes = Lanes::set1(-std::numeric_limits<float>::infinity());
        for (int64_t p0 = 0; p0 < end; p0 += kWidth) {
          const V x = Lanes::mask_past(Lanes::load(row + p0), p0, visible);
          Lanes::store(row + p0, x);
          max_lanes = Lanes::max(max_lanes, x);
        }
        const V max_score = Lanes::set1(Lanes::reduce_max(max_lanes));
        V total = Lanes::zero();
        for (int64_t p0 = 0; p0 < end; p0 += kWidth) {
          const V e = Lanes::exp(Lanes::sub(Lanes::load(row + p0), max_score));
          Lanes::store(row + p0, e);
          total = Lanes::add(total, e);
        }
        std::fill(row + end, row + padded, 0.f);
        inv_total[r] = 1.f / Lanes::reduce_add(total);
      }
      // Outputs: tiles of kRows queries x DV vectors of dimensions (the whole head on AVX-512,
      // half or a quarter of it on AVX2), over the keys the tile's last query sees.
      constexpr int kDV = std::min(D, Lanes::kValueVectors);
      constexpr int kRows = Lanes::kValueSums / kDV;
      float* out_head = out + hq * head_dim;
      const int64_t out_ld = s.num_heads * head_dim;
      for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
        const int64_t n = std::min<int64_t>(kRows, rows - r0), p_end = t0 + r0 + n;
        const float* probs = scores.data() + r0 * padded;
        float* dst = out_head + (t0 + r0) * out_ld;
        for (int64_t dim0 = 0; dim0 < head_dim; dim0 += kDV * kWidth) {
          if (n == kRows) {
            value_tile<kRows, kDV>(probs, padded, v_head, v_stride, p_end, inv_total.data() + r0, dst, out_ld, dim0);
          } else {
            for (int64_t r = 0; r < n; ++r)
              value_tile<1, kDV>(probs + r * padded, padded, v_head, v_stride, p_end, inv_total.data() + r0 + r,
                                 dst + r * out_ld, out_ld, dim0);
          }
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
        for (int64_t p = 0; p < visible; ++p) sum += row[p] * v_head[p * v_stride + d];
        dst[d] = sum / total;
      }
    }
  }
}

// kt[d, p] = k[p, d] for dimensions [d0, d1) of one head (k's rows k_stride apart), and 0
// for p in [num_tokens, kt_stride): 8 x 8 blocks in registers where a block is whole.
void transpose_keys(const float* k, int64_t k_stride, int64_t num_tokens, int64_t d0, int64_t d1, float* kt,
                    int64_t kt_stride) {
  int64_t p0 = 0;
#if defined(__AVX2__)
  if (d1 - d0 == 8) {
    for (; p0 + 8 <= num_tokens; p0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(k + (p0 + i) * k_stride + d0);
      // 8 x 8 transpose: pairs of rows interleaved, then 64-bit pairs, then 128-bit halves.
      __m256 t[8];
      for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      __m256 u[8];
      for (int i = 0; i < 2; ++i) {
        const int a = 4 * i;
        u[a] = _mm256_shuffle_ps(t[a], t[a + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[a + 1] = _mm256_shuffle_ps(t[a], t[a + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[a + 2] = _mm256_shuffle_ps(t[a + 1], t[a + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[a + 3] = _mm256_shuffle_ps(t[a + 1], t[a + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(kt + (d0 + i) * kt_stride + p0, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(kt + (d0 + i + 4) * kt_stride + p0, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
      }
    }
  }
#endif
  for (int64_t d = d0; d < d1; ++d) {
    float* row = kt + d * kt_stride;
    for (int64_t p = p0; p < num_tokens; ++p) row[p] = k[p * k_stride + d];
    std::fill(row + num_tokens, row + kt_stride, 0.f);
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
#if defined(KVSERVICE_PROMPT_LANES)
  auto* tile = head_dim == 64 ? &attend_tile<64 / kWidth> : head_dim == 128 ? &attend_tile<128 / kWidth> : &attend_tile<0>;
#else
  auto* tile = &attend_tile<0>;
#endif
  // Once for all query tiles (a transpose per task took ~4x the copies), each KV head's K^T, [D,
  // kt_stride], zero past the last key, and its V, [T, D], contiguous: in the fused qkv rows a
  // head's keys and values are a 256-byte slice of every 3.8 KiB, spread over 3.8 MiB at 1,024
  // tokens, past L2. K^T's rows are kept off multiples of 256 bytes apart: at 4 KiB apart (1,024
  // tokens) every row of a key tile fell in the same L1 set. With both, on AVX2: 512 tokens 3.3
  // -> 2.8 ms, 1,024 16.4 -> 13.3 ms. Tasks of 8 dimensions of a head share SmolLM2's 3 KV
  // heads evenly between the threads.
  const int64_t keys = (num_tokens + kKeyTile - 1) / kKeyTile * kKeyTile;
  const int64_t kt_stride = keys % 64 == 0 ? keys + kKeyTile : keys;
  std::vector<float> kt(num_kv_heads * head_dim * kt_stride), vt(num_kv_heads * num_tokens * head_dim);
  const int64_t dim_blocks = (head_dim + 7) / 8;
  kvservice::parallel_for(num_kv_heads * dim_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / dim_blocks, d0 = task % dim_blocks * 8, d1 = std::min(head_dim, d0 + 8);
      transpose_keys(k_ptr + h * head_dim, s.k_stride, num_tokens, d0, d1, kt.data() + h * head_dim * kt_stride, kt_stride);
      float* v_head = vt.data() + h * num_tokens * head_dim;
      for (int64_t p = 0; p < num_tokens; ++p)
        std::copy(v_ptr + p * s.v_stride + h * head_dim + d0, v_ptr + p * s.v_stride + h * head_dim + d1, v_head + p * head_dim + d0);
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
      tile(q_ptr, kt.data() + h * head_dim * kt_stride, kt_stride, vt.data() + h * num_tokens * head_dim, head_dim, s, h,
           t0, t1, out_ptr, q_scaled, scores);
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
