// A linear layer for a few rows of x over a block-quantized weight (GGUF Q4_1, Q8_0).
//
// Registered as torch.ops.kvservice.block_quant_linear; kvservice/block_quant.py holds the
// weight and the PyTorch formula this is tested against.
//
// W[n, k] = scale[n, k / 32] * code[n, k] + min[n, k / 32], the product and then the sum
// rounded to float32 (no FMA): exactly the float32 weight the GGUF loader dequantizes; for a
// bfloat16 x, that value rounded to bfloat16 (to nearest, ties to even, as torch rounds):
// exactly the loader's bfloat16 weight. Decode at small batch streams every weight once per
// step, so reading 1.25 bytes a weight instead of 4 (float32, or the float32 copy a bfloat16
// model computes with where bfloat16 matmuls are emulated) is most of the gain; the rest is
// register blocking for few rows.
//
// The weight comes in panels of 16 output rows, k-major, so one k's 16 codes are contiguous:
// codes:  [P, K, 16] int8        P = N / 16, K a multiple of 32
// scales: [P, K / 32, 16] float32
// mins:   [P, K / 32, 16] float32
// x:      [M, K] float32 or bfloat16, contiguous
// bias:   [N] in x's dtype, or none
// returns [M, N] in x's dtype: y = x W^T + bias, each dot product accumulated in float32 over
// k in order, the bias added to it in float32, then rounded once to x's dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;  // output rows per panel: two 8-float vectors
constexpr int64_t kBlock = 32;  // weights per scale/min
constexpr int64_t kChunk = 256;  // k per dequantized chunk: 16 KiB of float32, stays in L1
constexpr int64_t kRowTile = 6;  // rows of x per micro-kernel: 12 accumulators + 2 weights + 1 broadcast

#if defined(__AVX2__) && defined(__FMA__)
// The float32 values of w rounded to bfloat16 (to nearest, ties to even): the bits added below
// carry into the kept 16 exactly when the dropped 16 are above half, or at half with an odd
// kept part. For finite w (weights are: float16 scales and mins times small integers).
inline __m256 round_to_bf16(__m256 w) {
  const __m256i bits = _mm256_castps_si256(w);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
#endif

// buf[k, 0:16] = the panel's weights for k in [0, k_len) of this chunk, as float32 values;
// bfloat16 ones when kBf16.
template <bool kBf16>
void dequantize_chunk(const int8_t* codes, const float* scales, const float* mins, int64_t k_len, float* buf) {
  for (int64_t b = 0; b < k_len / kBlock; ++b) {
    const float* d = scales + b * kPanel;
    const float* m = mins + b * kPanel;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
    const __m256 m0 = _mm256_loadu_ps(m), m1 = _mm256_loadu_ps(m + 8);
    for (int64_t j = 0; j < kBlock; ++j) {
      const int8_t* c = codes + (b * kBlock + j) * kPanel;
      const __m256 c0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
      const __m256 c1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8))));
      __m256 w0 = _mm256_add_ps(_mm256_mul_ps(d0, c0), m0), w1 = _mm256_add_ps(_mm256_mul_ps(d1, c1), m1);
      if constexpr (kBf16) {
        w0 = round_to_bf16(w0);
        w1 = round_to_bf16(w1);
      }
      float* out = buf + (b * kBlock + j) * kPanel;
      _mm256_storeu_ps(out, w0);
      _mm256_storeu_ps(out + 8, w1);
    }
#else
    for (int64_t j = 0; j < kBlock; ++j) {
      const int8_t* c = codes + (b * kBlock + j) * kPanel;
      float* out = buf + (b * kBlock + j) * kPanel;
      for (int64_t n = 0; n < kPanel; ++n) {
        const float product = d[n] * static_cast<float>(c[n]);  // rounded: built with -ffp-contract=off
        const float w = product + m[n];
        out[n] = kBf16 ? static_cast<float>(c10::BFloat16(w)) : w;
      }
    }
#endif
  }
}

// y[r, 0:16] (+)= sum over k of x[r, k] * buf[k, 0:16], for R rows of x. An FMA's result is
// ready 4 cycles later and two issue a cycle: 2 R chains cannot keep the units busy for small
// R, so U interleaved partial sums (k = u mod U) are kept and added at the end. The loops over
// u and r are unrolled by pragma: left to GCC's heuristics, the accumulator array was kept in
// memory in some builds (a store per FMA, 2.7x slower at 16 rows).
template <int R, int U>
void row_tile(const float* x, int64_t x_stride, const float* buf, int64_t k_len, float* y, int64_t y_stride,
              bool accumulate) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[U][R][2];
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const bool load = accumulate && u == 0;
      acc[u][r][0] = load ? _mm256_loadu_ps(y + r * y_stride) : _mm256_setzero_ps();
      acc[u][r][1] = load ? _mm256_loadu_ps(y + r * y_stride + 8) : _mm256_setzero_ps();
    }
  }
  for (int64_t k = 0; k < k_len; k += U) {
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      const float* w = buf + (k + u) * kPanel;
      const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * x_stride + k + u);
        acc[u][r][0] = _mm256_fmadd_ps(xb, w0, acc[u][r][0]);
        acc[u][r][1] = _mm256_fmadd_ps(xb, w1, acc[u][r][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int u = 1; u < U; ++u) {
      acc[0][r][0] = _mm256_add_ps(acc[0][r][0], acc[u][r][0]);
      acc[0][r][1] = _mm256_add_ps(acc[0][r][1], acc[u][r][1]);
    }
    _mm256_storeu_ps(y + r * y_stride, acc[0][r][0]);
    _mm256_storeu_ps(y + r * y_stride + 8, acc[0][r][1]);
  }
#else
  for (int r = 0; r < R; ++r) {
    float acc[kPanel];
    for (int64_t n = 0; n < kPanel; ++n) acc[n] = accumulate ? y[r * y_stride + n] : 0.f;
    for (int64_t k = 0; k < k_len; ++k) {
      for (int64_t n = 0; n < kPanel; ++n) acc[n] += x[r * x_stride + k] * buf[k * kPanel + n];
    }
    for (int64_t n = 0; n < kPanel; ++n) y[r * y_stride + n] = acc[n];
  }
#endif
}

void rows(int64_t num_rows, const float* x, int64_t x_stride, const float* buf, int64_t k_len, float* y,
          int64_t y_stride, bool accumulate) {
  switch (num_rows) {  // U: at least 8 chains where it fits in 16 vector registers
    case 1: return row_tile<1, 4>(x, x_stride, buf, k_len, y, y_stride, accumulate);
    case 2: return row_tile<2, 2>(x, x_stride, buf, k_len, y, y_stride, accumulate);
    case 3: return row_tile<3, 1>(x, x_stride, buf, k_len, y, y_stride, accumulate);
    case 4: return row_tile<4, 1>(x, x_stride, buf, k_len, y, y_stride, accumulate);
    case 5: return row_tile<5, 1>(x, x_stride, buf, k_len, y, y_stride, accumulate);
    default: return row_tile<kRowTile, 1>(x, x_stride, buf, k_len, y, y_stride, accumulate);
  }
}

// y[r, n] = acc[r, n] (+ bias[n]) rounded to scalar_t, for one panel's 16 columns; y may be acc.
template <typename scalar_t>
void store_panel(const float* acc, int64_t m_size, int64_t stride, const scalar_t* bias, scalar_t* y) {
  for (int64_t r = 0; r < m_size; ++r) {
    for (int64_t n = 0; n < kPanel; ++n) {
      const float sum = bias == nullptr ? acc[r * stride + n] : acc[r * stride + n] + static_cast<float>(bias[n]);
      y[r * stride + n] = static_cast<scalar_t>(sum);
    }
  }
}

// acc [M, N] float32 = x W^T, then y = acc + bias in scalar_t, panel by panel.
template <typename scalar_t, bool kBf16>
void linear_panels(const float* x, int64_t m_size, int64_t k_size, const int8_t* codes, const float* scales,
                   const float* mins, int64_t num_panels, const scalar_t* bias, float* acc, scalar_t* y) {
  const int64_t n_size = num_panels * kPanel;
  at::parallel_for(0, num_panels, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float buf[kChunk * kPanel];
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t k0 = 0; k0 < k_size; k0 += kChunk) {
        const int64_t k_len = std::min(kChunk, k_size - k0);
        dequantize_chunk<kBf16>(codes + (p * k_size + k0) * kPanel, scales + (p * k_size + k0) / kBlock * kPanel,
                                mins + (p * k_size + k0) / kBlock * kPanel, k_len, buf);
        for (int64_t r0 = 0; r0 < m_size; r0 += kRowTile) {
          rows(std::min(kRowTile, m_size - r0), x + r0 * k_size + k0, k_size, buf, k_len,
               acc + r0 * n_size + p * kPanel, n_size, k0 > 0);
        }
      }
      store_panel(acc + p * kPanel, m_size, n_size, bias == nullptr ? nullptr : bias + p * kPanel, y + p * kPanel);
    }
  });
}

at::Tensor block_quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (is_bf16 || x.scalar_type() == at::kFloat),
              "x must be a contiguous float32 or bfloat16 [M, K] tensor");
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kPanel && codes.is_contiguous() && codes.scalar_type() == at::kChar,
              "codes must be a contiguous int8 [P, K, 16] tensor");
  const int64_t num_panels = codes.size(0), k_size = codes.size(1), m_size = x.size(0);
  TORCH_CHECK(x.size(1) == k_size && k_size % kBlock == 0, "x [M, K] and codes [P, K, 16] disagree, or K % 32 != 0");
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == num_panels &&
                    t->size(1) == k_size / kBlock && t->size(2) == kPanel,
                "scales and mins must be contiguous float32 [P, K / 32, 16] tensors");
  }
  const int64_t n_size = num_panels * kPanel;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n_size && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "bias must be a contiguous [N] tensor of x's dtype");
  }
  auto y = at::empty({m_size, n_size}, x.options());
  if (m_size == 0) return y;
  const int8_t* codes_ptr = codes.data_ptr<int8_t>();
  const float* scales_ptr = scales.data_ptr<float>();
  const float* mins_ptr = mins.data_ptr<float>();
  if (!is_bf16) {  // accumulates in y itself
    float* y_ptr = y.data_ptr<float>();
    linear_panels<float, false>(x.data_ptr<float>(), m_size, k_size, codes_ptr, scales_ptr, mins_ptr, num_panels,
                                has_bias ? bias->data_ptr<float>() : nullptr, y_ptr, y_ptr);
    return y;
  }
  // bfloat16 -> float32 is exact: the products and sums are the float32 path's.
  const c10::BFloat16* x_bf16 = x.data_ptr<c10::BFloat16>();
  std::vector<float> x_float(m_size * k_size);
  for (int64_t i = 0; i < m_size * k_size; ++i) x_float[i] = static_cast<float>(x_bf16[i]);
  std::vector<float> acc(m_size * n_size);
  linear_panels<c10::BFloat16, true>(x_float.data(), m_size, k_size, codes_ptr, scales_ptr, mins_ptr, num_panels,
                                     has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr, acc.data(),
                                     y.data_ptr<c10::BFloat16>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvservice, m) {
  m.def("block_quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvservice, CPU, m) { m.impl("block_quant_linear", &block_quant_linear); }
