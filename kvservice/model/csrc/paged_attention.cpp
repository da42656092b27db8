// Decode attention that reads K/V straight out of the paged cache (no gather).
//
// Registered as torch.ops.kvservice.paged_decode_attention; kvservice/paged_attention.py
// builds it on first use and falls back to PyTorch when the build fails.
//
// q:           [B * Q, Hq, D]   B requests of Q queries each (request-major)
// kv_layer:    [2, num_blocks, block_size, Hkv, D]   K then V, contiguous
// block_table: [B, max_blocks] int64
// starts:      [B] int64   position of each request's first query; query i of
//                          request b sees keys at positions <= starts[b] + i
// returns      [B * Q, Hq, D], softmax(q k^T * scale) v accumulated in float32

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

template <typename scalar_t>
void decode_one(const scalar_t* q, const scalar_t* kv, const int64_t* table, int64_t start, int64_t num_queries,
                int64_t group, int64_t head, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                int64_t block_size, int64_t v_offset, float scale, scalar_t* out, std::vector<float>& scores,
                std::vector<float>& qf, std::vector<float>& acc) {
  // One request, one KV head: the `group` query heads that share it, for each query.
  const int64_t rows = group * num_queries;
  const int64_t context = start + num_queries;  // keys visible to the last query
  scores.assign(rows * context, -std::numeric_limits<float>::infinity());
  qf.resize(rows * head_dim);
  acc.assign(rows * head_dim, 0.f);
  for (int64_t i = 0; i < num_queries; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const scalar_t* src = q + (i * num_heads + head * group + g) * head_dim;
      float* dst = qf.data() + (g * num_queries + i) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * scale;
    }
  }
  const int64_t token_stride = num_kv_heads * head_dim;
  for (int64_t p = 0; p < context; ++p) {
    const int64_t slot = table[p / block_size] * block_size + p % block_size;
    const scalar_t* k = kv + slot * token_stride + head * head_dim;
    const int64_t first = std::max<int64_t>(0, p - start);  // queries before it cannot see p
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t i = first; i < num_queries; ++i) {
        const float* qr = qf.data() + (g * num_queries + i) * head_dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * static_cast<float>(k[d]);
        scores[(g * num_queries + i) * context + p] = dot;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores.data() + r * context;
    const int64_t visible = start + (r % num_queries) + 1;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < visible; ++p) max_score = std::max(max_score, s[p]);
    float total = 0.f;
    for (int64_t p = 0; p < visible; ++p) {
      s[p] = std::exp(s[p] - max_score);
      total += s[p];
    }
    const float inv = 1.f / total;
    for (int64_t p = 0; p < visible; ++p) s[p] *= inv;
    for (int64_t p = visible; p < context; ++p) s[p] = 0.f;
  }
  for (int64_t p = 0; p < context; ++p) {
    const int64_t slot = table[p / block_size] * block_size + p % block_size;
    const scalar_t* v = kv + v_offset + slot * token_stride + head * head_dim;
    for (int64_t r = 0; r < rows; ++r) {
      const float w = scores[r * context + p];
      if (w == 0.f) continue;
      float* a = acc.data() + r * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += w * static_cast<float>(v[d]);
    }
  }
  for (int64_t i = 0; i < num_queries; ++i) {
    for (int64_t g = 0; g < group; ++g) {
      const float* src = acc.data() + (g * num_queries + i) * head_dim;
      scalar_t* dst = out + (i * num_heads + head * group + g) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(src[d]);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// exp(x) for x <= 0 (scores minus their maximum), 8 at a time: x = n ln2 + r with |r| <= ln2 / 2
// (ln2 split in two, Cody and Waite), e^r by its degree-6 Taylor polynomial (relative error
// under 2e-7), times 2^n built in the exponent bits. Below -87 (and -inf, a masked key): 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(-87.0f);
  const __m256 is_tiny = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(is_tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// The 8 sums of a[0..8), each over its 8 lanes, as one vector.
inline __m256 sum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// decode_one for float32 and head_dim = 8 * D8, in AVX2 registers. The scores of a row come 8
// keys at a time (8 dot products reduced together), the softmax's exponentials 8 at a time, and
// each output row stays in registers while it walks the values (~3x the row-at-a-time loop).
// Query heads [g_begin, g_end) of the group: one task per query head spreads a small batch
// over the threads evenly (SmolLM2: 9 query heads, 3 KV heads, 2 threads).
template <int D8>
void decode_one_avx2(const float* q, const float* kv, const int64_t* table, int64_t start, int64_t num_queries,
                     int64_t group, int64_t g_begin, int64_t g_end, int64_t head, int64_t num_heads,
                     int64_t num_kv_heads, int64_t block_size, int64_t v_offset, float scale, float* out,
                     std::vector<float>& scores, std::vector<const float*>& keys) {
  constexpr int64_t head_dim = 8 * D8;
  const int64_t context = start + num_queries;
  const int64_t padded = (context + 7) / 8 * 8;
  const int64_t token_stride = num_kv_heads * head_dim;
  keys.resize(padded);
  for (int64_t p = 0; p < padded; ++p) {  // past the context: the last key again, masked below
    const int64_t at = std::min(p, context - 1);
    keys[p] = kv + (table[at / block_size] * block_size + at % block_size) * token_stride + head * head_dim;
  }
  scores.resize(padded);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < num_queries; ++i) {
    const int64_t visible = start + i + 1;  // query i sees keys at positions <= start + i
    for (int64_t g = g_begin; g < g_end; ++g) {
      const int64_t row = i * num_heads + head * group + g;
      __m256 qv[D8];
      for (int d = 0; d < D8; ++d) qv[d] = _mm256_mul_ps(_mm256_loadu_ps(q + row * head_dim + 8 * d), _mm256_set1_ps(scale));
      __m256 max8 = minus_inf;
      for (int64_t p0 = 0; p0 < visible; p0 += 8) {
        __m256 acc[8];
        for (int j = 0; j < 8; ++j) {
          const float* k = keys[p0 + j];
          __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
          for (int d = 1; d < D8; ++d) a = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(k + 8 * d), a);
          acc[j] = a;
        }
        __m256 s = sum8x8(acc);
        if (p0 + 8 > visible) {  // keys past this query's last: -inf
          const __m256 position = _mm256_add_ps(_mm256_set1_ps(static_cast<float>(p0)),
                                                _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
          s = _mm256_blendv_ps(s, minus_inf, _mm256_cmp_ps(position, _mm256_set1_ps(static_cast<float>(visible)), _CMP_GE_OQ));
        }
        _mm256_storeu_ps(scores.data() + p0, s);
        max8 = _mm256_max_ps(max8, s);
      }
      float lanes[8];
      _mm256_storeu_ps(lanes, max8);
      const __m256 max_score = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
      __m256 total8 = _mm256_setzero_ps();
      for (int64_t p0 = 0; p0 < visible; p0 += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores.data() + p0), max_score));
        _mm256_storeu_ps(scores.data() + p0, e);
        total8 = _mm256_add_ps(total8, e);
      }
      _mm256_storeu_ps(lanes, total8);
      float total = 0.f;
      for (float lane : lanes) total += lane;
      __m256 acc[D8];
      for (int d = 0; d < D8; ++d) acc[d] = _mm256_setzero_ps();
      for (int64_t p = 0; p < visible; ++p) {
        const float* v = keys[p] + v_offset;
        const __m256 w = _mm256_set1_ps(scores[p]);
        for (int d = 0; d < D8; ++d) acc[d] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * d), acc[d]);
      }
      const __m256 inv = _mm256_set1_ps(1.f / total);
      for (int d = 0; d < D8; ++d) _mm256_storeu_ps(out + row * head_dim + 8 * d, _mm256_mul_ps(acc[d], inv));
    }
  }
}
#endif

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_table,
                                  const at::Tensor& starts, int64_t num_queries, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B * Q, Hq, D] tensor");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(0) == 2 && kv_layer.is_contiguous(),
              "kv_layer must be a contiguous [2, num_blocks, block_size, Hkv, D] tensor");
  TORCH_CHECK(kv_layer.scalar_type() == q.scalar_type(), "q and kv_layer must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() && block_table.dim() == 2,
              "block_table must be a contiguous [B, max_blocks] int64 tensor");
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts.is_contiguous() && starts.dim() == 1,
              "starts must be a contiguous [B] int64 tensor");
  const int64_t batch = block_table.size(0);
  TORCH_CHECK(starts.size(0) == batch && q.size(0) == batch * num_queries, "q, block_table and starts disagree on B");
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = kv_layer.size(2), num_kv_heads = kv_layer.size(3);
  TORCH_CHECK(kv_layer.size(4) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1);
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* start_ptr = starts.data_ptr<int64_t>();
  const int64_t num_blocks = kv_layer.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t context = start_ptr[b] + num_queries;
    TORCH_CHECK(start_ptr[b] >= 0 && context <= max_blocks * block_size, "a request's context runs past its block table");
    for (int64_t j = 0; j < (context + block_size - 1) / block_size; ++j) {
      const int64_t block = table[b * max_blocks + j];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " outside the cache");
    }
  }
  const int64_t v_offset = kv_layer.stride(0);
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* q_ptr = q.data_ptr<scalar_t>();
    const scalar_t* kv_ptr = kv_layer.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
#if defined(__AVX2__) && defined(__FMA__)
    // The casts are no-ops: this branch runs for float32 only (a plain `if`: the lambda is no template).
    if (std::is_same_v<scalar_t, float> && (head_dim == 64 || head_dim == 128)) {
      auto* kernel = head_dim == 64 ? &decode_one_avx2<8> : &decode_one_avx2<16>;
      kvservice::parallel_for(batch * num_heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        std::vector<const float*> keys;
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / num_heads, h = task % num_heads / group, g = task % group;
          const int64_t offset = b * num_queries * num_heads * head_dim;
          kernel(reinterpret_cast<const float*>(q_ptr + offset), reinterpret_cast<const float*>(kv_ptr),
                 table + b * max_blocks, start_ptr[b], num_queries, group, g, g + 1, h, num_heads, num_kv_heads,
                 block_size, v_offset, static_cast<float>(scale), reinterpret_cast<float*>(out_ptr + offset), scores,
                 keys);
        }
      });
      return;
    }
#endif
    kvservice::parallel_for(batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, qf, acc;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
        const int64_t offset = b * num_queries * num_heads * head_dim;
        decode_one<scalar_t>(q_ptr + offset, kv_ptr, table + b * max_blocks, start_ptr[b], num_queries, group, h,
                             num_heads, num_kv_heads, head_dim, block_size, v_offset, static_cast<float>(scale),
                             out_ptr + offset, scores, qf, acc);
      }
    });
  });
  return out;
}

}  // namespace

namespace kvservice {
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_table,
                                  const at::Tensor& starts, int64_t num_queries, double scale) {
  return ::paged_decode_attention(q, kv_layer, block_table, starts, num_queries, scale);
}
}  // namespace kvservice

TORCH_LIBRARY_FRAGMENT(kvservice, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_layer, Tensor block_table, Tensor starts, int num_queries, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvservice, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
