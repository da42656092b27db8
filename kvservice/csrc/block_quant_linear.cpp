// A linear layer for a few rows of x over a block-quantized weight (GGUF Q4_1, Q8_0).
//
// Registered as torch.ops.kvservice.block_quant_linear; kvservice/block_quant.py holds the
// weight and the PyTorch formula this is tested against.
//
// W[n, k] = scale[n, k / 32] * code[n, k] + min[n, k / 32], the product and then the sum
// rounded to float32 (no FMA): exactly the float32 weight the GGUF loader dequantizes.
// Decode at small batch streams every weight once per step, so reading 1.25 bytes a
// weight instead of 4 is most of the gain; the rest is register blocking for few rows.
//
// The weight comes in panels of 16 output rows, k-major, so one k's 16 codes are contiguous:
// codes:  [P, K, 16] int8        P = N / 16, K a multiple of 32
// scales: [P, K / 32, 16] float32
// mins:   [P, K / 32, 16] float32
// x:      [M, K] float32, contiguous
// returns [M, N] float32: y = x W^T, each dot product accumulated in float32 over k in order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 16;  // output rows per panel: two 8-float vectors
constexpr int64_t kBlock = 32;  // weights per scale/min
constexpr int64_t kChunk = 256;  // k per dequantized chunk: 16 KiB of float32, stays in L1
constexpr int64_t kRowTile = 6;  // rows of x per micro-kernel: 12 accumulators + 2 weights + 1 broadcast

// buf[k, 0:16] = the panel's float32 weights for k in [0, k_len) of this chunk.
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
      float* out = buf + (b * kBlock + j) * kPanel;
      _mm256_storeu_ps(out, _mm256_add_ps(_mm256_mul_ps(d0, c0), m0));
      _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_mul_ps(d1, c1), m1));
    }
#else
    for (int64_t j = 0; j < kBlock; ++j) {
      const int8_t* c = codes + (b * kBlock + j) * kPanel;
      float* out = buf + (b * kBlock + j) * kPanel;
      for (int64_t n = 0; n < kPanel; ++n) {
        const float product = d[n] * static_cast<float>(c[n]);  // rounded: built with -ffp-contract=off
        out[n] = product + m[n];
      }
    }
#endif
  }
}

// y[r, 0:16] (+)= sum over k of x[r, k] * buf[k, 0:16], for R rows of x. An FMA's result is
// ready 4 cycles later and two issue a cycle: 2 R chains cannot keep the units busy for small
// R, so U interleaved partial sums (k = u mod U) are kept and added at the end.
template <int R, int U>
void row_tile(const float* x, int64_t x_stride, const float* buf, int64_t k_len, float* y, int64_t y_stride,
              bool accumulate) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[U][R][2];
  for (int u = 0; u < U; ++u) {
    for (int r = 0; r < R; ++r) {
      const bool load = accumulate && u == 0;
      acc[u][r][0] = load ? _mm256_loadu_ps(y + r * y_stride) : _mm256_setzero_ps();
      acc[u][r][1] = load ? _mm256_loadu_ps(y + r * y_stride + 8) : _mm256_setzero_ps();
    }
  }
  for (int64_t k = 0; k < k_len; k += U) {
    for (int u = 0; u < U; ++u) {
      const float* w = buf + (k + u) * kPanel;
      const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * x_stride + k + u);
        acc[u][r][0] = _mm256_fmadd_ps(xb, w0, acc[u][r][0]);
        acc[u][r][1] = _mm256_fmadd_ps(xb, w1, acc[u][r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
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

at::Tensor block_quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& mins) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x must be a contiguous float32 [M, K] tensor");
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
  auto y = at::empty({m_size, n_size}, x.options());
  if (m_size == 0) return y;
  const float* x_ptr = x.data_ptr<float>();
  const int8_t* codes_ptr = codes.data_ptr<int8_t>();
  const float* scales_ptr = scales.data_ptr<float>();
  const float* mins_ptr = mins.data_ptr<float>();
  float* y_ptr = y.data_ptr<float>();
  at::parallel_for(0, num_panels, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float buf[kChunk * kPanel];
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t k0 = 0; k0 < k_size; k0 += kChunk) {
        const int64_t k_len = std::min(kChunk, k_size - k0);
        dequantize_chunk(codes_ptr + (p * k_size + k0) * kPanel, scales_ptr + (p * k_size + k0) / kBlock * kPanel,
                         mins_ptr + (p * k_size + k0) / kBlock * kPanel, k_len, buf);
        for (int64_t r0 = 0; r0 < m_size; r0 += kRowTile) {
          rows(std::min(kRowTile, m_size - r0), x_ptr + r0 * k_size + k0, k_size, buf, k_len,
               y_ptr + r0 * n_size + p * kPanel, n_size, k0 > 0);
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvservice, m) {
  m.def("block_quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvservice, CPU, m) { m.impl("block_quant_linear", &block_quant_linear); }
