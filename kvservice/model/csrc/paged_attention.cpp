// Decode attention that reads K/V straight out of the paged cache (no gather).
//
// Registered as torch.ops.kvservice.paged_decode_attention; kvservice/paged_attention.py
// builds it on first use and falls back to PyTorch when the build fails.
//
// q:           [B * Q, Hq, D]   B requests of Q queries each (request-major)
// kv_layer:    [2, num_blocks, block_size, Hkv, D]   K then V, contiguous: q's dtype, or a
//              narrower one (--kv-cache-dtype, kv_row.h) read as float32 on the fly
// block_table: [B, max_blocks] int64
// starts:      [B] int64   position of each request's first query; query i of
//                          request b sees keys at positions <= starts[b] + i
// returns      [B * Q, Hq, D], softmax(q k^T * scale) v accumulated in float32

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "kv_row.h"
#include "ops.h"

#include "thread_pool.h"
#include "vector_exp.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// The cache lines of one request's K (or V) blocks, prefetched into L2 a few at a time as the
// kernel works (the AVX-512 kernel: a fixed distance ahead, see LineStream). From DRAM the
// kernel alone overlapped little of its memory traffic with its arithmetic (SmolLM2, 16
// requests of 320 tokens, 30 layers, 2 Zen 4 cores: 14 ms, against ~6 ms for a plain read of
// those rows and ~5.5 ms for the kernel on rows already in the caches). Prefetching the next
// request's rows spread over this one's loops (a few lines per query head of a key tile, per
// value row): 14.1 -> 9.1 ms then. Into L1 instead (T0) it gained nothing, and issued in
// bursts of ~200 lines neither: the lines must arrive at about the rate the work consumes
// them. The AVX2 kernel for small batches (a task per query head) prefetches the next request
// a share per task: 15.1-15.5 -> 11.8-12.2 ms there then.
class BlockLines {
 public:
  static constexpr int64_t kLine = 64;

  BlockLines() = default;
  // num_blocks blocks of block_bytes each, block j at base + table[j] * block_bytes; of their
  // lines, the share `part` of `parts` (a request's tasks each take one).
  BlockLines(const char* base, const int64_t* table, int64_t num_blocks, int64_t block_bytes, int64_t part = 0,
             int64_t parts = 1)
      : base_(base), table_(table), block_bytes_(block_bytes), lines_per_block_(block_bytes / kLine),
        next_(num_blocks * (block_bytes / kLine) * part / parts),
        end_(num_blocks * (block_bytes / kLine) * (part + 1) / parts) {}

  int64_t size() const { return end_ - next_; }

  // Prefetch the next `count` lines (or what is left) into L2.
  void issue(int64_t count) {
    const int64_t last = std::min(next_ + count, end_);
    while (next_ < last) {
      const int64_t block = next_ / lines_per_block_, offset = next_ % lines_per_block_;
      const int64_t run = std::min(lines_per_block_ - offset, last - next_);
      const char* p = base_ + table_[block] * block_bytes_ + offset * kLine;
      for (int64_t i = 0; i < run; ++i) __builtin_prefetch(p + i * kLine, 0, 1);
      next_ += run;
    }
  }

 private:
  const char* base_ = nullptr;
  const int64_t* table_ = nullptr;
  int64_t block_bytes_ = 0, lines_per_block_ = 1, next_ = 0, end_ = 0;
};

// Each request's K and V blocks in one layer's cache, as BlockLines to prefetch.
struct RequestBlocks {
  const char* k_base;  // the layer's [2, num_blocks, block_size, Hkv, D] tensor
  int64_t v_offset_bytes, block_bytes, block_size, num_queries, max_blocks;
  const int64_t* table;   // [B, max_blocks]
  const int64_t* starts;  // [B]

  BlockLines lines(int64_t b, bool values, int64_t part = 0, int64_t parts = 1) const {
    const int64_t num_blocks = (starts[b] + num_queries + block_size - 1) / block_size;
    return BlockLines(k_base + (values ? v_offset_bytes : 0), table + b * max_blocks, num_blocks, block_bytes, part, parts);
  }
};

// A request's K lines, then its V lines, then those of the request the thread computes next,
// as one stream the kernel prefetches a fixed distance ahead of its reads (kAheadLines). The
// stream's order is the kernel's: the keys a tile of 16 tokens at a time, then the values so.
class LineStream {
 public:
  static constexpr int64_t kAheadLines = 256;  // 16 KiB: 128 to 768 measured alike (decode steps)

  void add(const BlockLines& lines) {
    if (count_ < kMaxParts) parts_[count_++] = lines;
  }
  // Prefetch the stream's next `count` lines (or what is left).
  void issue(int64_t count) {
    while (count > 0 && current_ < count_) {
      BlockLines& part = parts_[current_];
      const int64_t take = std::min(count, part.size());
      part.issue(take);
      count -= take;
      if (part.size() == 0) ++current_;
    }
  }

 private:
  static constexpr int kMaxParts = 4;
  std::array<BlockLines, kMaxParts> parts_{};
  int count_ = 0, current_ = 0;
};

// What a task of the balanced request loop prefetches: request b's rows, then those of the
// request its thread computes next (`next`), or after its range's last, the range's first
// (`first`) in the next layer, where there is one (the same threads take the same ranges there).
[[maybe_unused]] LineStream request_stream(const RequestBlocks& layer, const RequestBlocks* next_layer, int64_t b,
                                           int64_t next, int64_t first) {
  LineStream ahead;
  ahead.add(layer.lines(b, false));
  ahead.add(layer.lines(b, true));
  if (next >= 0 || next_layer != nullptr) {
    const RequestBlocks& cache = next >= 0 ? layer : *next_layer;
    const int64_t then = next >= 0 ? next : first;
    ahead.add(cache.lines(then, false));
    ahead.add(cache.lines(then, true));
  }
  return ahead;
}

#if defined(__AVX2__) && defined(__FMA__)
using kvservice::exp_nonpositive;
using kvservice::load8;
#endif
#if defined(__AVX512F__)
using kvservice::exp_nonpositive16;
using kvservice::load16;
#endif

using kvservice::scaled;

template <typename scalar_t, typename kv_t>
void decode_one(const scalar_t* q, const kv_t* kv, const int64_t* table, int64_t start, int64_t num_queries,
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
  const int64_t kv_row = kvservice::row_width<kv_t>(head_dim);
  const int64_t token_stride = num_kv_heads * kv_row;
  for (int64_t p = 0; p < context; ++p) {
    const int64_t slot = table[p / block_size] * block_size + p % block_size;
    const kv_t* k = kv + slot * token_stride + head * kv_row;
    const int64_t first = std::max<int64_t>(0, p - start);  // queries before it cannot see p
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t i = first; i < num_queries; ++i) {
        const float* qr = qf.data() + (g * num_queries + i) * head_dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * static_cast<float>(k[d]);
        scores[(g * num_queries + i) * context + p] = scaled(dot, k, head_dim);
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
    const kv_t* v = kv + v_offset + slot * token_stride + head * kv_row;
    for (int64_t r = 0; r < rows; ++r) {
      if (scores[r * context + p] == 0.f) continue;
      const float w = scaled(scores[r * context + p], v, head_dim);
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
// The 8 sums of a[0..8), each over its 8 lanes, as one vector.
inline __m256 sum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// One query row's scores against keys[p0, p0 + 8) (each `offset` elements into its row): 8 dot
// products reduced together, the keys past `visible` -inf.
template <int D8, typename kv_t>
inline __m256 score_tile_avx2(const __m256* qv, const kv_t* const* keys, int64_t offset, int64_t p0, int64_t visible) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) {
    const kv_t* k = keys[p0 + j] + offset;
    __m256 a = _mm256_mul_ps(qv[0], load8(k));
    for (int d = 1; d < D8; ++d) a = _mm256_fmadd_ps(qv[d], load8(k + 8 * d), a);
    acc[j] = a;
  }
  __m256 s = sum8x8(acc);
  if constexpr (kvservice::kScaledRows<kv_t>) {
    float row_scales[8];
    for (int j = 0; j < 8; ++j) row_scales[j] = scaled(1.f, keys[p0 + j] + offset, 8 * D8);
    s = _mm256_mul_ps(s, _mm256_loadu_ps(row_scales));
  }
  if (p0 + 8 <= visible) return s;
  const __m256 position = _mm256_add_ps(_mm256_set1_ps(static_cast<float>(p0)), _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_blendv_ps(s, _mm256_set1_ps(-std::numeric_limits<float>::infinity()),
                          _mm256_cmp_ps(position, _mm256_set1_ps(static_cast<float>(visible)), _CMP_GE_OQ));
}

// A row's scores over [0, visible), stored a tile of 8 at a time, become its softmax's
// numerators in place; returns their sum (the 8 lanes' partial sums added in lane order).
inline float softmax_numerators_avx2(float* row, int64_t visible) {
  __m256 max8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t p0 = 0; p0 < visible; p0 += 8) max8 = _mm256_max_ps(max8, _mm256_loadu_ps(row + p0));
  float lanes[8];
  _mm256_storeu_ps(lanes, max8);
  const __m256 max_score = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
  __m256 total8 = _mm256_setzero_ps();
  for (int64_t p0 = 0; p0 < visible; p0 += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(row + p0), max_score));
    _mm256_storeu_ps(row + p0, e);
    total8 = _mm256_add_ps(total8, e);
  }
  _mm256_storeu_ps(lanes, total8);
  float total = 0.f;
  for (float lane : lanes) total += lane;
  return total;
}

// decode_one for float32 queries over a cache of kv_t, head_dim = 8 * D8, in AVX2 registers. The scores of a row come 8
// keys at a time (8 dot products reduced together), the softmax's exponentials 8 at a time, and
// each output row stays in registers while it walks the values (~3x the row-at-a-time loop).
// Query heads [g_begin, g_end) of the group: one task per query head spreads a small batch
// over the threads evenly (SmolLM2: 9 query heads, 3 KV heads, 2 threads).
template <int D8, typename kv_t>
void decode_one_avx2(const float* q, const kv_t* kv, const int64_t* table, int64_t start, int64_t num_queries,
                     int64_t group, int64_t g_begin, int64_t g_end, int64_t head, int64_t num_heads,
                     int64_t num_kv_heads, int64_t block_size, int64_t v_offset, float scale, float* out,
                     std::vector<float>& scores, std::vector<const kv_t*>& keys, BlockLines& next_k,
                     BlockLines& next_v) {
  constexpr int64_t head_dim = 8 * D8, kv_row = kvservice::row_width<kv_t>(head_dim);
  const int64_t context = start + num_queries;
  const int64_t padded = (context + 7) / 8 * 8;
  const int64_t token_stride = num_kv_heads * kv_row;
  keys.resize(padded);
  for (int64_t p = 0; p < padded; ++p) {  // past the context: the last key again, masked below
    const int64_t at = std::min(p, context - 1);
    keys[p] = kv + (table[at / block_size] * block_size + at % block_size) * token_stride + head * kv_row;
  }
  scores.resize(padded);
  for (int64_t i = 0; i < num_queries; ++i) {
    const int64_t visible = start + i + 1;  // query i sees keys at positions <= start + i
    for (int64_t g = g_begin; g < g_end; ++g) {
      const int64_t row = i * num_heads + head * group + g;
      __m256 qv[D8];
      for (int d = 0; d < D8; ++d) qv[d] = _mm256_mul_ps(_mm256_loadu_ps(q + row * head_dim + 8 * d), _mm256_set1_ps(scale));
      const int64_t next_k_per_group = (next_k.size() * 8 + visible + 7) / (visible + 7);
      for (int64_t p0 = 0; p0 < visible; p0 += 8) {
        next_k.issue(next_k_per_group);
        _mm256_storeu_ps(scores.data() + p0, score_tile_avx2<D8, kv_t>(qv, keys.data(), 0, p0, visible));
      }
      const float total = softmax_numerators_avx2(scores.data(), visible);
      __m256 acc[D8];
      for (int d = 0; d < D8; ++d) acc[d] = _mm256_setzero_ps();
      const int64_t next_v_per_row = (next_v.size() + visible - 1) / visible;
      for (int64_t p = 0; p < visible; ++p) {
        next_v.issue(next_v_per_row);
        const kv_t* v = keys[p] + v_offset;
        const __m256 w = _mm256_set1_ps(scaled(scores[p], v, head_dim));
        for (int d = 0; d < D8; ++d) acc[d] = _mm256_fmadd_ps(w, load8(v + 8 * d), acc[d]);
      }
      const __m256 inv = _mm256_set1_ps(1.f / total);
      for (int d = 0; d < D8; ++d) _mm256_storeu_ps(out + row * head_dim + 8 * d, _mm256_mul_ps(acc[d], inv));
    }
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// One request, every head and query, for batches that give each thread requests of their own:
// decode_one_avx2's arithmetic (each row's sums in the same order: the same results to the
// bit), but laid out as decode_group_avx512 (below) reads the cache: the keys a tile of 8
// tokens at a time for every head, the values a tile of 16 for every row (their sums kept in
// `scores` between tiles), and `ahead` prefetched a fixed distance ahead of the reads. A task
// per query head read each head's third of every row three times, and prefetched the next
// request's rows a whole request ahead: more than a Zen 3 core's 512 KB L2 with this one's.
template <int D8, typename kv_t>
void decode_request_avx2(const float* q, const kv_t* kv, const int64_t* table, int64_t start, int64_t num_queries,
                         int64_t group, int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t v_offset,
                         float scale, float* out, std::vector<float>& scores, std::vector<const kv_t*>& tokens,
                         LineStream& ahead) {
  constexpr int64_t head_dim = 8 * D8, kv_row = kvservice::row_width<kv_t>(head_dim);
  const int64_t context = start + num_queries;
  const int64_t padded = (context + 15) / 16 * 16;
  const int64_t token_stride = num_kv_heads * kv_row;
  const int64_t rows = num_queries * num_heads;  // row = i * num_heads + h * group + g, as out's
  tokens.resize(padded);
  for (int64_t p = 0; p < padded; ++p) {  // past the context: the last token again, masked
    const int64_t at = std::min(p, context - 1);
    tokens[p] = kv + (table[at / block_size] * block_size + at % block_size) * token_stride;
  }
  scores.resize(rows * padded + rows + rows * head_dim);
  float* total = scores.data() + rows * padded;
  float* sums = total + rows;  // the value rows' sums between tiles
  const int64_t tile_lines = 8 * token_stride * static_cast<int64_t>(sizeof(kv_t)) / BlockLines::kLine;
  const int64_t k_per_row = (tile_lines + rows - 1) / rows;
  ahead.issue(LineStream::kAheadLines);
  for (int64_t p0 = 0; p0 < context; p0 += 8) {
    for (int64_t row = 0; row < rows; ++row) {
      ahead.issue(k_per_row);
      const int64_t i = row / num_heads, head = row % num_heads / group;
      const int64_t visible = start + i + 1;  // query i sees keys at positions <= start + i
      if (p0 >= visible) continue;
      __m256 qv[D8];
      for (int d = 0; d < D8; ++d) qv[d] = _mm256_mul_ps(_mm256_loadu_ps(q + row * head_dim + 8 * d), _mm256_set1_ps(scale));
      _mm256_storeu_ps(scores.data() + row * padded + p0, score_tile_avx2<D8, kv_t>(qv, tokens.data(), head * kv_row, p0, visible));
    }
  }
  for (int64_t row = 0; row < rows; ++row) {  // softmax numerators in place
    total[row] = softmax_numerators_avx2(scores.data() + row * padded, start + row / num_heads + 1);
  }
  const int64_t v_per_token = (2 * tile_lines + 16 * rows - 1) / (16 * rows);
  for (int64_t p0 = 0; p0 < context; p0 += 16) {
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t visible = start + row / num_heads + 1;
      const int64_t p1 = std::min(p0 + 16, visible);
      const float* w_row = scores.data() + row * padded;
      const int64_t v_head = v_offset + row % num_heads / group * kv_row;
      __m256 acc[D8];
      for (int d = 0; d < D8; ++d) acc[d] = p0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + row * head_dim + 8 * d);
      for (int64_t p = p0; p < p1; ++p) {
        ahead.issue(v_per_token);
        const kv_t* v = tokens[p] + v_head;
        const __m256 w = _mm256_set1_ps(scaled(w_row[p], v, head_dim));
        for (int d = 0; d < D8; ++d) acc[d] = _mm256_fmadd_ps(w, load8(v + 8 * d), acc[d]);
      }
      if (p0 + 16 < visible) {
        for (int d = 0; d < D8; ++d) _mm256_storeu_ps(sums + row * head_dim + 8 * d, acc[d]);
      } else if (p0 < visible) {
        const __m256 inv = _mm256_set1_ps(1.f / total[row]);
        for (int d = 0; d < D8; ++d) _mm256_storeu_ps(out + row * head_dim + 8 * d, _mm256_mul_ps(acc[d], inv));
      }
    }
  }
}
#endif

#if defined(__AVX512F__)
// Lane j of the result: the sum of a[j]'s 16 lanes (pairs, then quads within 128-bit lanes, then across them).
inline __m512 sum16x16(const __m512* a) {
  __m512 r[8];
  for (int j = 0; j < 8; ++j) r[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
  __m512 s[4];
  for (int j = 0; j < 4; ++j) {
    const __m512d x = _mm512_castps_pd(r[2 * j]), y = _mm512_castps_pd(r[2 * j + 1]);
    s[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], 0x44), _mm512_shuffle_f32x4(s[0], s[1], 0xEE));
  const __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], 0x44), _mm512_shuffle_f32x4(s[2], s[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, 0x88), _mm512_shuffle_f32x4(v01, v23, 0xDD));
}

// One request: KV heads [h_begin, h_end) and, of each, query heads [g_begin, g_end), for every
// query; float32 queries over a cache of kv_t, head_dim = 16 * D16, in AVX-512 registers. Decode attention streams the whole
// cache once a step, so the memory traffic decides its time: the scores walk the keys once for
// all the heads (a token's K row, every head, is contiguous), and 16 keys' dot products are
// reduced together; the values go a tile of 16 tokens at a time too, every head's rows taking
// the tile (their sums wait in `scores` between tiles, each still over p in order), so each
// tile's V rows are read whole, once.
//
// `ahead` is prefetched into L2 as the kernel reads, a fixed distance ahead: first this
// request's rows, then the next one's. Before, the next request's rows were spread over this
// one's loops (a whole request ahead, ~490 KB at 320 tokens: with this one's, about all of a
// core's 1 MB L2) and each head's values walked on their own (a third of each row's lines at a
// time). SmolLM2, 2 Zen 5 threads: 16 requests of 320 tokens, 30 layers, blocks in order, from
// DRAM 7.0 -> 5.6 ms (31 -> 41 GB/s; 74 is what a plain sum reads); in-process decode steps of
// 16 requests 19.2-19.3 -> 17.3-17.8 ms. Every output the same to the bit.
template <int D16, typename kv_t>
void decode_group_avx512(const float* q, const kv_t* kv, const int64_t* table, int64_t start, int64_t num_queries,
                         int64_t group, int64_t h_begin, int64_t h_end, int64_t g_begin, int64_t g_end,
                         int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t v_offset, float scale,
                         float* out, std::vector<float>& scores, std::vector<const kv_t*>& tokens, LineStream& ahead) {
  constexpr int64_t head_dim = 16 * D16, kv_row = kvservice::row_width<kv_t>(head_dim);
  constexpr int64_t kRows = 16 / D16;
  const int64_t context = start + num_queries;
  const int64_t padded = (context + 15) / 16 * 16;
  const int64_t token_stride = num_kv_heads * kv_row;
  const int64_t heads = g_end - g_begin;
  const int64_t rows_per_head = heads * num_queries;  // row = (h - h_begin) * rows_per_head + i * heads + g - g_begin
  const int64_t rows = (h_end - h_begin) * rows_per_head;
  tokens.resize(padded);
  for (int64_t p = 0; p < padded; ++p) {  // past the context: the last token again, masked
    const int64_t at = std::min(p, context - 1);
    tokens[p] = kv + (table[at / block_size] * block_size + at % block_size) * token_stride + h_begin * kv_row;
  }
  scores.resize(rows * padded + rows + rows * head_dim);
  float* inv_total = scores.data() + rows * padded;
  float* sums = inv_total + rows;  // the value rows' sums between tiles
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // The stream's lines a tile of 16 tokens holds (K or V), issued in even shares over its loops.
  const int64_t tile_lines = 16 * token_stride * static_cast<int64_t>(sizeof(kv_t)) / BlockLines::kLine;
  const int64_t score_steps = (h_end - h_begin) * num_queries * heads;
  const int64_t k_per_step = (tile_lines + score_steps - 1) / score_steps;
  ahead.issue(LineStream::kAheadLines);
  for (int64_t p0 = 0; p0 < context; p0 += 16) {
    for (int64_t h = h_begin; h < h_end; ++h) {
      const int64_t h_offset = (h - h_begin) * kv_row;
      for (int64_t i = 0; i < num_queries; ++i) {
        const int64_t visible = start + i + 1;  // query i sees keys at positions <= start + i
        for (int64_t g = g_begin; g < g_end; ++g) {
          ahead.issue(k_per_step);
          const float* q_row = q + (i * num_heads + h * group + g) * head_dim;
          __m512 qv[D16];
          for (int d = 0; d < D16; ++d) qv[d] = _mm512_mul_ps(_mm512_loadu_ps(q_row + 16 * d), _mm512_set1_ps(scale));
          __m512 acc[16];
          for (int j = 0; j < 16; ++j) {
            const kv_t* k = tokens[p0 + j] + h_offset;
            __m512 a = _mm512_mul_ps(qv[0], load16(k));
            for (int d = 1; d < D16; ++d) a = _mm512_fmadd_ps(qv[d], load16(k + 16 * d), a);
            acc[j] = a;
          }
          __m512 s = sum16x16(acc);
          if constexpr (kvservice::kScaledRows<kv_t>) {
            float row_scales[16];
            for (int j = 0; j < 16; ++j) row_scales[j] = scaled(1.f, tokens[p0 + j] + h_offset, head_dim);
            s = _mm512_mul_ps(s, _mm512_loadu_ps(row_scales));
          }
          if (p0 + 16 > visible) {  // keys past this query's last: -inf
            const __m512 position = _mm512_add_ps(_mm512_set1_ps(static_cast<float>(p0)), lane);
            s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(position, _mm512_set1_ps(static_cast<float>(visible)), _CMP_GE_OQ), s, minus_inf);
          }
          const int64_t row = (h - h_begin) * rows_per_head + i * heads + g - g_begin;
          _mm512_storeu_ps(scores.data() + row * padded + p0, s);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // softmax numerators in place; masked keys become 0
    float* row = scores.data() + r * padded;
    __m512 max16 = minus_inf;
    for (int64_t p0 = 0; p0 < padded; p0 += 16) max16 = _mm512_max_ps(max16, _mm512_loadu_ps(row + p0));
    const __m512 max_score = _mm512_set1_ps(_mm512_reduce_max_ps(max16));
    __m512 total16 = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < padded; p0 += 16) {
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(row + p0), max_score));
      _mm512_storeu_ps(row + p0, e);
      total16 = _mm512_add_ps(total16, e);
    }
    inv_total[r] = 1.f / _mm512_reduce_add_ps(total16);
  }
  const int64_t chunks = (h_end - h_begin) * ((rows_per_head + kRows - 1) / kRows);  // of rows of one head
  const int64_t v_per_token = (tile_lines + 16 * chunks - 1) / (16 * chunks);
  for (int64_t p0 = 0; p0 < context; p0 += 16) {
    const int64_t p1 = std::min(p0 + 16, context);
    for (int64_t r0 = 0, n = 0; r0 < rows; r0 += n) {
      n = std::min(kRows, rows_per_head - r0 % rows_per_head);
      const int64_t h_offset = r0 / rows_per_head * kv_row;
      __m512 acc[kRows][D16];
      for (int64_t r = 0; r < kRows; ++r)
        for (int d = 0; d < D16; ++d)
          acc[r][d] = p0 == 0 || r >= n ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + (r0 + r) * head_dim + 16 * d);
      for (int64_t p = p0; p < p1; ++p) {
        ahead.issue(v_per_token);
        const kv_t* v = tokens[p] + v_offset + h_offset;
        __m512 vv[D16];
        for (int d = 0; d < D16; ++d) vv[d] = load16(v + 16 * d);
        for (int64_t r = 0; r < n; ++r) {
          const __m512 w = _mm512_set1_ps(scaled(scores[(r0 + r) * padded + p], v, head_dim));
          for (int d = 0; d < D16; ++d) acc[r][d] = _mm512_fmadd_ps(w, vv[d], acc[r][d]);
        }
      }
      if (p1 < context) {
        for (int64_t r = 0; r < n; ++r)
          for (int d = 0; d < D16; ++d) _mm512_storeu_ps(sums + (r0 + r) * head_dim + 16 * d, acc[r][d]);
        continue;
      }
      for (int64_t r = 0; r < n; ++r) {
        const int64_t row = r0 + r, in_head = row % rows_per_head;
        const int64_t h = h_begin + row / rows_per_head, i = in_head / heads, g = g_begin + in_head % heads;
        float* dst = out + (i * num_heads + h * group + g) * head_dim;
        const __m512 inv = _mm512_set1_ps(inv_total[row]);
        for (int d = 0; d < D16; ++d) _mm512_storeu_ps(dst + 16 * d, _mm512_mul_ps(acc[r][d], inv));
      }
    }
  }
}
#endif

// next_kv_layer: the next layer's cache (kv_layer's shape), or none. Each thread's last request
// then prefetches the next layer's rows of its first one, which nothing else would.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_table,
                                  const at::Tensor& starts, int64_t num_queries, double scale,
                                  const c10::optional<at::Tensor>& next_kv_layer) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B * Q, Hq, D] tensor");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(0) == 2 && kv_layer.is_contiguous(),
              "kv_layer must be a contiguous [2, num_blocks, block_size, Hkv, D] tensor");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() && block_table.dim() == 2,
              "block_table must be a contiguous [B, max_blocks] int64 tensor");
  TORCH_CHECK(starts.scalar_type() == at::kLong && starts.is_contiguous() && starts.dim() == 1,
              "starts must be a contiguous [B] int64 tensor");
  const int64_t batch = block_table.size(0);
  TORCH_CHECK(starts.size(0) == batch && q.size(0) == batch * num_queries, "q, block_table and starts disagree on B");
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = kv_layer.size(2), num_kv_heads = kv_layer.size(3);
  TORCH_CHECK(kv_layer.size(4) == kvservice::row_width(kv_layer.scalar_type(), head_dim) && num_heads % num_kv_heads == 0,
              "head shapes disagree");
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
  const bool has_next = next_kv_layer.has_value() && next_kv_layer->defined();
  TORCH_CHECK(!has_next || (next_kv_layer->sizes() == kv_layer.sizes() && next_kv_layer->is_contiguous() &&
                            next_kv_layer->scalar_type() == kv_layer.scalar_type()),
              "next_kv_layer must be a contiguous tensor of kv_layer's shape and dtype");
  const int64_t v_offset_bytes = v_offset * kv_layer.element_size();
  const int64_t block_bytes = kv_layer.stride(1) * kv_layer.element_size();
  const RequestBlocks this_layer{static_cast<const char*>(kv_layer.data_ptr()), v_offset_bytes, block_bytes, block_size,
                                 num_queries, max_blocks, table, start_ptr};
  RequestBlocks next_layer = this_layer;
  if (has_next) next_layer.k_base = static_cast<const char*>(next_kv_layer->data_ptr());
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* q_ptr = q.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    kvservice::visit_kv_type<scalar_t>(kv_layer.scalar_type(), [&](auto kv_tag) {
      using kv_t = std::remove_cv_t<std::remove_pointer_t<decltype(kv_tag)>>;
      const kv_t* kv_ptr = static_cast<const kv_t*>(kv_layer.data_ptr());
#if defined(__AVX512F__)
      // The casts are no-ops: this branch is for float32 queries only (over float32, bfloat16 or int8 rows).
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (head_dim == 64 || head_dim == 128) {
          auto* kernel = head_dim == 64 ? &decode_group_avx512<4, kv_t> : &decode_group_avx512<8, kv_t>;
          // A task per request (its cache rows read whole), or, when that leaves the threads too few
          // tasks to share evenly, per KV head and slice of its query heads (batch 1 of SmolLM2:
          // 3 KV heads, 2 threads -> 9 tasks of one query head).
          const int64_t threads = at::get_num_threads();
          const bool whole = batch >= 4 * threads;
          const int64_t splits =
              whole ? 1 : std::min<int64_t>(group, (4 * threads + batch * num_kv_heads - 1) / (batch * num_kv_heads));
          const int64_t per_request = whole ? 1 : num_kv_heads * splits;
          auto run = [&](int64_t task, LineStream& ahead, std::vector<float>& scores, std::vector<const kv_t*>& tokens) {
            const int64_t b = task / per_request, h = whole ? 0 : task / splits % num_kv_heads, s = task % splits;
            const int64_t offset = b * num_queries * num_heads * head_dim;
            kernel(reinterpret_cast<const float*>(q_ptr + offset), kv_ptr, table + b * max_blocks, start_ptr[b],
                   num_queries, group, h, whole ? num_kv_heads : h + 1, group * s / splits, group * (s + 1) / splits,
                   num_heads, num_kv_heads, block_size, v_offset, static_cast<float>(scale),
                   reinterpret_cast<float*>(out_ptr + offset), scores, tokens, ahead);
          };
          if (whole) {
            // Requests, balanced: a thread whose requests run slower hands its last ones over (14
            // requests in halves: the threads finished ~30 us apart a layer, SmolLM2), each task
            // prefetching its rows and the next ones (request_stream).
            kvservice::parallel_for_balanced(batch, [&](int64_t b, int64_t next, int64_t first) {
              thread_local std::vector<float> scores;
              thread_local std::vector<const kv_t*> tokens;
              LineStream ahead = request_stream(this_layer, has_next ? &next_layer : nullptr, b, next, first);
              run(b, ahead, scores, tokens);
            });
            return;
          }
          kvservice::parallel_for(batch * per_request, 1, [&](int64_t begin, int64_t end) {
            std::vector<float> scores;
            std::vector<const kv_t*> tokens;
            LineStream none;  // a task reads one KV head's rows: nothing to prefetch
            for (int64_t task = begin; task < end; ++task) run(task, none, scores, tokens);
          });
          return;
        }
      }
#elif defined(__AVX2__) && defined(__FMA__)
      // The casts are no-ops: this branch is for float32 queries only (over float32, bfloat16 or int8 rows).
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (head_dim == 64 || head_dim == 128) {
          const int64_t threads = at::get_num_threads();
          if (batch >= 4 * threads) {
            // Requests, balanced as the AVX-512 path's, each prefetching its rows, then the next one's.
            auto* request_kernel = head_dim == 64 ? &decode_request_avx2<8, kv_t> : &decode_request_avx2<16, kv_t>;
            kvservice::parallel_for_balanced(batch, [&](int64_t b, int64_t next, int64_t first) {
              thread_local std::vector<float> scores;
              thread_local std::vector<const kv_t*> tokens;
              LineStream ahead = request_stream(this_layer, has_next ? &next_layer : nullptr, b, next, first);
              const int64_t offset = b * num_queries * num_heads * head_dim;
              request_kernel(reinterpret_cast<const float*>(q_ptr + offset), kv_ptr, table + b * max_blocks,
                             start_ptr[b], num_queries, group, num_heads, num_kv_heads, block_size, v_offset,
                             static_cast<float>(scale), reinterpret_cast<float*>(out_ptr + offset), scores, tokens,
                             ahead);
            });
            return;
          }
          // Small batches: a task per query head, so both threads have work.
          auto* kernel = head_dim == 64 ? &decode_one_avx2<8, kv_t> : &decode_one_avx2<16, kv_t>;
          kvservice::parallel_for(batch * num_heads, 1, [&](int64_t begin, int64_t end) {
            std::vector<float> scores;
            std::vector<const kv_t*> keys;
            for (int64_t task = begin; task < end; ++task) {
              const int64_t b = task / num_heads, h = task % num_heads / group, g = task % group;
              const int64_t offset = b * num_queries * num_heads * head_dim;
              // The next request this thread computes, its rows prefetched a share a task.
              BlockLines next_k, next_v;
              if ((b + 1) * num_heads < end) {
                next_k = this_layer.lines(b + 1, false, task % num_heads, num_heads);
                next_v = this_layer.lines(b + 1, true, task % num_heads, num_heads);
              }
              kernel(reinterpret_cast<const float*>(q_ptr + offset), kv_ptr, table + b * max_blocks, start_ptr[b],
                     num_queries, group, g, g + 1, h, num_heads, num_kv_heads, block_size, v_offset,
                     static_cast<float>(scale), reinterpret_cast<float*>(out_ptr + offset), scores, keys, next_k,
                     next_v);
            }
          });
          return;
        }
      }
#endif
      kvservice::parallel_for(batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores, qf, acc;
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
          const int64_t offset = b * num_queries * num_heads * head_dim;
          decode_one<scalar_t, kv_t>(q_ptr + offset, kv_ptr, table + b * max_blocks, start_ptr[b], num_queries, group,
                                     h, num_heads, num_kv_heads, head_dim, block_size, v_offset,
                                     static_cast<float>(scale), out_ptr + offset, scores, qf, acc);
        }
      });
    });
  });
  return out;
}

}  // namespace

namespace kvservice {
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_table,
                                  const at::Tensor& starts, int64_t num_queries, double scale,
                                  const c10::optional<at::Tensor>& next_kv_layer) {
  return ::paged_decode_attention(q, kv_layer, block_table, starts, num_queries, scale, next_kv_layer);
}
}  // namespace kvservice

namespace {
at::Tensor paged_decode_attention_op(const at::Tensor& q, const at::Tensor& kv_layer, const at::Tensor& block_table,
                                     const at::Tensor& starts, int64_t num_queries, double scale) {
  return ::paged_decode_attention(q, kv_layer, block_table, starts, num_queries, scale, c10::nullopt);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(kvservice, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_layer, Tensor block_table, Tensor starts, int num_queries, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvservice, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention_op); }
