// The greedy LM head: each row's argmax of x W^T (a block-quantized W) without every logit in
// float32, yet the token block_quant_linear's logits would give, exactly.
//
// A decode step of 16 requests spends ~5 ms of ~40 in SmolLM2's LM head (16 x 576 x 49,152 in
// float32 FMAs, at the matmul's peak). A greedy request needs only the largest logit. So:
//  1. x is rounded to 8-bit integers per block of 32 (x ~ s * q), and every logit estimated
//     with integer dot products (AVX-512 VNNI: 64 multiply-adds an instruction, 4x float32's;
//     AVX2: vpmaddubsw then vpmaddwd, 32 in two, with |q| <= 63 so that vpmaddubsw's 16-bit
//     pair sums of 8-bit codes cannot saturate), together with a bound on the estimate's
//     error: |x - s q| <= r per block (measured, not assumed), times each block's sum of
//     |weights|, plus the float32 rounding of both sums.
//  2. Only the logits whose bound reaches the largest lower bound can be the maximum; their
//     panels (16 outputs) are computed in float32 as block_quant_linear computes them for 4 or
//     more rows (each sum over k in order, from zero, with the same FMAs), and the largest of
//     those wins, the first of equals as torch.argmax. So the token is the one the full
//     logits give, bit for bit, for batches of 4 or more rows.
// A row with a value that is not finite gets -1: the caller computes its logits in full.
//
// Registered as torch.ops.kvservice.greedy_head(x, vnni_codes, code_offset, codes, scales,
// mins, abs_sums, with_mins) -> int64 [M]:
//   x           [M, K] float32, contiguous
//   vnni_codes  uint8 [P, K / 4, 16, 4]: code + code_offset, 4 consecutive k per output
//   code_offset 128 for signed 8-bit codes (Q8_0), 0 for 4-bit ones
//   codes, scales, mins: the weight as block_quant_linear takes it (kvservice.model.block_quant)
//   abs_sums    float32 [P, K / 32, 16]: sum over each block of |scale * code| + |min|, rounded up
//   with_mins   false only where every min is zero (Q8_0): the estimates then skip them
// `greedy_head_supported()`: whether this build runs it (the AVX-512 and the AVX2 builds).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "panel16.h"
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

// The vector builds (panel16.h's AVX-512 or AVX2 lanes; the AVX-512 build implies AVX2, which
// the estimates take without VNNI). Not F16C's macro: the AVX-512 build's flags leave it unset.
#if !defined(KVSERVICE_SCALAR_V16)
#define KVSERVICE_GREEDY_HEAD 1
#endif

namespace {

using namespace kvservice::panel16;  // NOLINT: the panel's lanes and dequantizing, as block_quant_linear's

// Rows whose integer sums share each loaded weight vector: VNNI keeps 8 rows' 16 sums in one
// register each; AVX2 needs two a row (8 lanes), so 4 rows' fill 8 of its 16 registers.
constexpr int64_t kVnniRowGroup = 8;
constexpr int64_t kMaddubsRowGroup = 4;
constexpr int64_t kTaskPanels = 32;  // panels a task of the estimates takes (SmolLM2's head: 96 tasks)

// x in 8-bit blocks: x[i] ~ scale * q[i] within `error` (per block), with what each block adds
// to a logit's bound and to its estimate besides the integer dot product.
struct QuantizedRows {
  std::vector<int8_t> q;            // [M, K]
  std::vector<float> scale;         // [M, K / 32]
  std::vector<int32_t> minus_offset_sum;  // [M, K / 32]: -code_offset * sum of q, where the dot product starts
  std::vector<float> scaled_sum;    // [M, K / 32]: scale * sum of q, the mins' share
  std::vector<float> slack;         // [M, K / 32]: per unit of a block's abs_sums, the bound
  std::vector<char> finite;         // [M]
};

// q_max: 127, or 63 where vpmaddubsw multiplies 8-bit codes (|code| up to 255 after the offset).
QuantizedRows quantize_rows(const float* x, int64_t m_size, int64_t k_size, int64_t code_offset, float q_max) {
  const int64_t blocks = k_size / kBlock;
  QuantizedRows rows;
  rows.q.resize(m_size * k_size);
  rows.scale.resize(m_size * blocks);
  rows.minus_offset_sum.resize(m_size * blocks);
  rows.scaled_sum.resize(m_size * blocks);
  rows.slack.resize(m_size * blocks);
  rows.finite.assign(m_size, 1);
  // The float32 roundings of the exact logit (K FMAs in a row) and of the estimate (a few per
  // block), each within K' * 2^-24 of the sum of |x| * |w| <= sum over blocks of max|x| *
  // abs_sums; 4x that for margin.
  const double rounding = 4.0 * static_cast<double>(k_size + 4 * blocks + 16) * std::ldexp(1.0, -24);
  for (int64_t r = 0; r < m_size; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * k_size + b * kBlock;
      int8_t* qb = rows.q.data() + r * k_size + b * kBlock;
      float largest = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) largest = std::max(largest, std::fabs(xb[i]));
      const int64_t at = r * blocks + b;
      if (!std::isfinite(largest)) {
        rows.finite[r] = 0;
        largest = 0.f;
      }
      float scale = 0.f;
      int32_t sum = 0;
      double error = 0.0;
      if (largest > 0.f) {
        scale = largest / q_max;
        const float inverse = q_max / largest;
        for (int64_t i = 0; i < kBlock; ++i) {
          const float q = std::max(-q_max, std::min(q_max, std::nearbyint(xb[i] * inverse)));
          qb[i] = static_cast<int8_t>(q);
          sum += static_cast<int32_t>(q);
          // scale * q has at most 32 significant bits: exact in double, and so is the difference.
          error = std::max(error, std::fabs(static_cast<double>(xb[i]) - static_cast<double>(scale) * q));
        }
      } else {
        std::fill(qb, qb + kBlock, 0);
      }
      rows.scale[at] = scale;
      rows.minus_offset_sum[at] = -static_cast<int32_t>(code_offset) * sum;
      rows.scaled_sum[at] = scale * static_cast<float>(sum);
      rows.slack[at] = static_cast<float>((error * (1.0 + 1e-6) + rounding * 1.01 * largest) * (1.0 + 1e-6));
    }
  }
  return rows;
}

#if defined(KVSERVICE_GREEDY_HEAD)

// Where estimate_panel_* put their results: the panel's largest upper bound (estimate + bound)
// per row in `upper` (a row's are num_panels apart), and each row's largest lower bound
// (estimate - bound) so far in lower_max.
struct PanelBounds {
  float* upper;
  int64_t num_panels;
  float* lower_max;
};

#if defined(__AVX512F__)

// Estimates and bounds of one panel's 16 logits for R rows, with VNNI. kMins: whether the
// weight has mins (Q4_1; Q8_0's are all zero). A block's integer sums start at
// -code_offset * sum(q), so they end at the exact dot product with no subtraction after (the
// same integers). SmolLM2's Q8_0 head, 13 rows, the two per block and row dropped: 1.52-1.58 ->
// 1.45-1.52 ms a call (16 rows 1.96-1.98 -> 1.75-1.91).
template <int R, bool kMins>
__attribute__((target("avx512f,avx512vnni"))) void estimate_panel_vnni(
    const QuantizedRows& rows, int64_t r0, int64_t k_size, const uint8_t* vnni, const at::Half* scales,
    const at::Half* mins, const float* abs_sums, PanelBounds out) {
  const int64_t blocks = k_size / kBlock;
  const int32_t* q32 = reinterpret_cast<const int32_t*>(rows.q.data()) + r0 * k_size / 4;  // 4 codes of x a lane
  const int64_t row_words = k_size / 4;
  const float* scale = rows.scale.data() + r0 * blocks;
  const int32_t* minus_offset_sum = rows.minus_offset_sum.data() + r0 * blocks;
  const float* scaled_sum = rows.scaled_sum.data() + r0 * blocks;
  const float* slack = rows.slack.data() + r0 * blocks;
  __m512 estimate[R], bound[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) estimate[r] = bound[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) dot[r] = _mm512_set1_epi32(minus_offset_sum[r * blocks + b]);
#pragma GCC unroll 8
    for (int64_t g = 0; g < kBlock / 4; ++g) {
      const __m512i w = _mm512_loadu_si512(vnni + (b * kBlock / 4 + g) * 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        dot[r] = _mm512_dpbusd_epi32(dot[r], w, _mm512_set1_epi32(q32[r * row_words + b * kBlock / 4 + g]));
      }
    }
    const __m512 d = load_half16(scales + b * kPanel).v;
    const __m512 m = kMins ? load_half16(mins + b * kPanel).v : _mm512_setzero_ps();
    const __m512 t = _mm512_loadu_ps(abs_sums + b * kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t at = r * blocks + b;
      estimate[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, _mm512_set1_ps(scale[at])), estimate[r]);
      if constexpr (kMins) estimate[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(scaled_sum[at]), estimate[r]);
      bound[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(slack[at]), bound[r]);
    }
  }
  const __m512 margin = _mm512_set1_ps(1.f + 1e-4f);  // the bound's own float32 sums
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 widened = _mm512_mul_ps(bound[r], margin);
    out.upper[(r0 + r) * out.num_panels] = _mm512_reduce_max_ps(_mm512_add_ps(estimate[r], widened));
    out.lower_max[r0 + r] = std::max(out.lower_max[r0 + r], _mm512_reduce_max_ps(_mm512_sub_ps(estimate[r], widened)));
  }
}

#endif

inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// The same estimates and bounds with AVX2 (both builds: an AVX-512 CPU without VNNI takes it):
// each panel's 16 outputs as two halves of 8. vpmaddubsw multiplies the 8-bit codes (unsigned,
// offset) by x's (signed, |q| <= 63) and adds adjacent pairs into 16 bits, vpmaddwd adds those
// pairs into 32: the same integer sums as VNNI's.
template <int R, bool kMins>
__attribute__((target("avx2,fma,f16c"))) void estimate_panel_maddubs(
    const QuantizedRows& rows, int64_t r0, int64_t k_size, const uint8_t* vnni, const at::Half* scales,
    const at::Half* mins, const float* abs_sums, PanelBounds out) {
  const int64_t blocks = k_size / kBlock;
  const int32_t* q32 = reinterpret_cast<const int32_t*>(rows.q.data()) + r0 * k_size / 4;
  const int64_t row_words = k_size / 4;
  const float* scale = rows.scale.data() + r0 * blocks;
  const int32_t* minus_offset_sum = rows.minus_offset_sum.data() + r0 * blocks;
  const float* scaled_sum = rows.scaled_sum.data() + r0 * blocks;
  const float* slack = rows.slack.data() + r0 * blocks;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 estimate[R][2], bound[R][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    estimate[r][0] = estimate[r][1] = bound[r][0] = bound[r][1] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i dot[R][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_set1_epi32(minus_offset_sum[r * blocks + b]);
#pragma GCC unroll 8
    for (int64_t g = 0; g < kBlock / 4; ++g) {
      const uint8_t* w = vnni + (b * kBlock / 4 + g) * 64;
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i xq = _mm256_set1_epi32(q32[r * row_words + b * kBlock / 4 + g]);
        dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(w0, xq), ones));
        dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(w1, xq), ones));
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + b * kPanel + 8 * h)));
      const __m256 m = kMins ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + b * kPanel + 8 * h)))
                             : _mm256_setzero_ps();
      const __m256 t = _mm256_loadu_ps(abs_sums + b * kPanel + 8 * h);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int64_t at = r * blocks + b;
        estimate[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(d, _mm256_set1_ps(scale[at])), estimate[r][h]);
        if constexpr (kMins) estimate[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(scaled_sum[at]), estimate[r][h]);
        bound[r][h] = _mm256_fmadd_ps(t, _mm256_set1_ps(slack[at]), bound[r][h]);
      }
    }
  }
  const __m256 margin = _mm256_set1_ps(1.f + 1e-4f);  // the bound's own float32 sums
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m256 widened0 = _mm256_mul_ps(bound[r][0], margin), widened1 = _mm256_mul_ps(bound[r][1], margin);
    const __m256 upper = _mm256_max_ps(_mm256_add_ps(estimate[r][0], widened0), _mm256_add_ps(estimate[r][1], widened1));
    const __m256 lower = _mm256_max_ps(_mm256_sub_ps(estimate[r][0], widened0), _mm256_sub_ps(estimate[r][1], widened1));
    out.upper[(r0 + r) * out.num_panels] = max8(upper);
    out.lower_max[r0 + r] = std::max(out.lower_max[r0 + r], max8(lower));
  }
}

// Which integer dot product the estimates use: VNNI's where the CPU has it (and the build
// compiled it), else AVX2's. KVSERVICE_GREEDY_HEAD_DOT=maddubs takes AVX2's anyway, so that
// the tests check that path on every machine.
[[maybe_unused]] bool forced_maddubs() {
  const char* dot = std::getenv("KVSERVICE_GREEDY_HEAD_DOT");
  return dot != nullptr && std::string(dot) == "maddubs";
}

bool has_vnni() {
#if defined(__AVX512F__)
  static const bool vnni = __builtin_cpu_supports("avx512vnni") && !forced_maddubs();
  return vnni;
#else
  return false;
#endif
}

// Rows r0.. (up to one row group) of one panel, with VNNI or AVX2.
void estimate_rows(bool vnni_dot, int64_t num_rows, bool with_mins, const QuantizedRows& rows, int64_t r0, int64_t k_size,
                   const uint8_t* vnni, const at::Half* scales, const at::Half* mins, const float* abs_sums,
                   PanelBounds out) {
#define KVSERVICE_ESTIMATE(KIND, R)                                                                       \
  return with_mins ? estimate_panel_##KIND<R, true>(rows, r0, k_size, vnni, scales, mins, abs_sums, out) \
                   : estimate_panel_##KIND<R, false>(rows, r0, k_size, vnni, scales, mins, abs_sums, out)
#if defined(__AVX512F__)
  if (vnni_dot) {
    switch (num_rows) {
      case 1: KVSERVICE_ESTIMATE(vnni, 1);
      case 2: KVSERVICE_ESTIMATE(vnni, 2);
      case 3: KVSERVICE_ESTIMATE(vnni, 3);
      case 4: KVSERVICE_ESTIMATE(vnni, 4);
      case 5: KVSERVICE_ESTIMATE(vnni, 5);
      case 6: KVSERVICE_ESTIMATE(vnni, 6);
      case 7: KVSERVICE_ESTIMATE(vnni, 7);
      default: KVSERVICE_ESTIMATE(vnni, 8);
    }
  }
#endif
  switch (num_rows) {
    case 1: KVSERVICE_ESTIMATE(maddubs, 1);
    case 2: KVSERVICE_ESTIMATE(maddubs, 2);
    case 3: KVSERVICE_ESTIMATE(maddubs, 3);
    default: KVSERVICE_ESTIMATE(maddubs, 4);
  }
#undef KVSERVICE_ESTIMATE
}

// One panel's 16 logits for one row in float32, as block_quant_linear's in-order sums make them:
// weight = scale * code + min (each rounded, panel16's dequantize_pair), then one FMA per k from
// zero.
template <bool kPacked>
void exact_panel(const float* x, int64_t k_size, const uint8_t* codes, const at::Half* scales, const at::Half* mins,
                 float* out) {
  V16 acc = zero16();
  for (int64_t b = 0; b < k_size / kBlock; ++b) {
    const V16 d = load_half16(scales + b * kPanel), m = load_half16(mins + b * kPanel);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; k += 2) {
      V16 w0, w1;
      dequantize_pair<kPacked, false>(codes, k, d, m, w0, w1);
      acc = fma16(x[k], w0, acc);
      acc = fma16(x[k + 1], w1, acc);
    }
  }
  store16(out, acc);
}

#endif

bool greedy_head_supported() {
#if defined(KVSERVICE_GREEDY_HEAD)
  return true;
#else
  return false;
#endif
}

at::Tensor greedy_head(const at::Tensor& x, const at::Tensor& vnni_codes, int64_t code_offset, const at::Tensor& codes,
                       const at::Tensor& scales, const at::Tensor& mins, const at::Tensor& abs_sums, bool with_mins) {
  TORCH_CHECK(greedy_head_supported(), "greedy_head needs the AVX2 or AVX-512 build (greedy_head_supported())");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be a contiguous float32 [M, K] tensor");
  const int64_t m_size = x.size(0), k_size = x.size(1);
  TORCH_CHECK(k_size % kBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK(vnni_codes.scalar_type() == at::kByte && vnni_codes.is_contiguous() && vnni_codes.dim() == 4 &&
                  vnni_codes.size(1) == k_size / 4 && vnni_codes.size(2) == kPanel && vnni_codes.size(3) == 4,
              "vnni_codes must be a contiguous uint8 [P, K / 4, 16, 4] tensor");
  const int64_t num_panels = vnni_codes.size(0), blocks = k_size / kBlock;
  const bool packed = codes.scalar_type() == at::kByte;
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 3 && codes.size(0) == num_panels &&
                  codes.size(1) == (packed ? k_size / 2 : k_size) && codes.size(2) == kPanel &&
                  (packed || codes.scalar_type() == at::kChar),
              "codes must be block_quant_linear's [P, K / 2, 16] uint8 or [P, K, 16] int8 tensor");
  TORCH_CHECK(code_offset == (packed ? 0 : 128), "code_offset: 128 for 8-bit codes, 0 for 4-bit ones");
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == num_panels &&
                    t->size(1) == blocks && t->size(2) == kPanel,
                "scales and mins must be contiguous float16 [P, K / 32, 16] tensors");
  }
  TORCH_CHECK(abs_sums.scalar_type() == at::kFloat && abs_sums.is_contiguous() && abs_sums.sizes() == scales.sizes(),
              "abs_sums must be a contiguous float32 [P, K / 32, 16] tensor");
  auto tokens = at::full({m_size}, -1, x.options().dtype(at::kLong));
#if defined(KVSERVICE_GREEDY_HEAD)
  if (m_size == 0) return tokens;
  const float* x_ptr = x.data_ptr<float>();
  const bool vnni_dot = has_vnni();
  // vpmaddubsw's 16-bit pair sums: 2 * 255 * 63 fits, 2 * 255 * 127 may not (4-bit codes: 15).
  const float q_max = vnni_dot || packed ? 127.f : 63.f;
  const int64_t row_group = vnni_dot ? kVnniRowGroup : kMaddubsRowGroup;
  const QuantizedRows rows = quantize_rows(x_ptr, m_size, k_size, code_offset, q_max);
  const uint8_t* vnni = vnni_codes.data_ptr<uint8_t>();
  const uint8_t* code_ptr = static_cast<const uint8_t*>(codes.data_ptr());
  const at::Half* scale_ptr = scales.data_ptr<at::Half>();
  const at::Half* min_ptr = mins.data_ptr<at::Half>();
  const float* abs_ptr = abs_sums.data_ptr<float>();
  const int64_t panel_code_bytes = packed ? k_size / 2 * kPanel : k_size * kPanel;
  // 1. Each panel's largest upper bound, and each row's largest lower bound (per task, then
  // merged). Tasks of kTaskPanels balanced between the threads: a thread whose core a serving
  // thread takes for a while hands its last tasks over instead of holding the other up.
  std::vector<float> upper(m_size * num_panels);
  std::vector<float> lower_max(m_size, -std::numeric_limits<float>::infinity());
  std::mutex merge;
  const int64_t num_tasks = (num_panels + kTaskPanels - 1) / kTaskPanels;
  kvservice::parallel_for_balanced(num_tasks, [&](int64_t task, int64_t, int64_t) {
    std::vector<float> lower(m_size, -std::numeric_limits<float>::infinity());
    for (int64_t p = task * kTaskPanels; p < std::min(num_panels, (task + 1) * kTaskPanels); ++p) {
      for (int64_t r0 = 0; r0 < m_size; r0 += row_group) {
        estimate_rows(vnni_dot, std::min(row_group, m_size - r0), with_mins, rows, r0, k_size,
                      vnni + p * (k_size / 4) * 64, scale_ptr + p * blocks * kPanel, min_ptr + p * blocks * kPanel,
                      abs_ptr + p * blocks * kPanel, PanelBounds{upper.data() + p, num_panels, lower.data()});
      }
    }
    std::lock_guard<std::mutex> lock(merge);
    for (int64_t r = 0; r < m_size; ++r) lower_max[r] = std::max(lower_max[r], lower[r]);
  });
  // 2. Per row, the panels holding a logit that may be the largest, in float32; the largest wins.
  int64_t* token_ptr = tokens.data_ptr<int64_t>();
  kvservice::parallel_for(m_size, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float logits[kPanel];
    for (int64_t r = begin; r < end; ++r) {
      if (!rows.finite[r]) continue;
      const float threshold = lower_max[r];
      const float* row_upper = upper.data() + r * num_panels;
      float best = -std::numeric_limits<float>::infinity();
      int64_t best_index = -1;
      for (int64_t p = 0; p < num_panels; ++p) {
        if (!(row_upper[p] >= threshold)) continue;
        (packed ? exact_panel<true> : exact_panel<false>)(x_ptr + r * k_size, k_size, code_ptr + p * panel_code_bytes,
                                                           scale_ptr + p * blocks * kPanel, min_ptr + p * blocks * kPanel,
                                                           logits);
        for (int64_t n = 0; n < kPanel; ++n) {
          if (logits[n] > best || best_index < 0) {  // the first of equals stays
            best = logits[n];
            best_index = p * kPanel + n;
          }
        }
      }
      token_ptr[r] = std::isfinite(best) ? best_index : -1;
    }
  });
#endif
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvservice, m) {
  m.def("greedy_head_supported() -> bool");
  m.def("greedy_head(Tensor x, Tensor vnni_codes, int code_offset, Tensor codes, Tensor scales, Tensor mins, "
        "Tensor abs_sums, bool with_mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvservice, CPU, m) { m.impl("greedy_head", &greedy_head); }
TORCH_LIBRARY_IMPL(kvservice, CatchAll, m) { m.impl("greedy_head_supported", &greedy_head_supported); }
