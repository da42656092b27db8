// A linear layer for a few rows of x over a block-quantized weight (GGUF Q4_1, Q8_0).
//
// Registered as torch.ops.kvservice.block_quant_linear; kvservice/model/block_quant.py holds
// the weight and the PyTorch formula this is tested against.
//
// W[n, k] = scale[n, k / 32] * code[n, k] + min[n, k / 32], the product and then the sum
// rounded to float32 (no FMA): exactly the float32 weight the GGUF loader dequantizes; for a
// bfloat16 x, that value rounded to bfloat16 (to nearest, ties to even, as torch rounds):
// exactly the loader's bfloat16 weight. Decode at small batch streams every weight once per
// step, so the bytes read per weight decide the step time: Q4_1 codes are kept as nibbles and
// the scales and mins as float16 (GGUF's own, so exact): 0.625 bytes a weight, Q8_0 1.125,
// against 4 for float32.
//
// The weight comes in panels of 16 output rows, k-major, so one k's 16 codes are adjacent:
// codes:  [P, K / 2, 16] uint8, Q4_1: byte j of row i holds k = 2i in its low nibble and
//         k = 2i + 1 in its high nibble, for output j of the panel;
//         or [P, K, 16] int8, Q8_0: one signed code a byte
// scales: [P, K / 32, 16] float16
// mins:   [P, K / 32, 16] float16
// x:      [M, K] float32 or bfloat16, contiguous
// bias:   [N] in x's dtype, or none
// returns [M, N] in x's dtype: y = x W^T + bias, each dot product accumulated in float32, the
// bias added to it in float32, then rounded once to x's dtype.
//
// Two paths. Up to kDirectRows rows of x (decode of a few requests), each panel's weights are
// dequantized in registers and used at once: nothing is written back, so the loop runs at the
// speed the codes stream in (1 to 3 rows of float32 x take each block's scale and min out of its
// sum instead: direct_panel_factored). More rows dequantize a chunk of the panel once into an L1
// buffer that every row tile then reads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "panel16.h"
#include "thread_pool.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

using namespace kvservice::panel16;  // NOLINT: the panel's lanes and dequantizing, shared with greedy_head.cpp

constexpr int64_t kChunk = 256;  // k per dequantized chunk of one panel: 16 KiB of float32, stays in L1
#if defined(__AVX512F__)
// Rows of x per buffered micro-kernel: 8 FMA chains. Zen 5 issues two 512-bit FMAs a cycle,
// each ready 4 cycles later, so 6 chains left a quarter of it idle: SmolLM2's projections for
// 2,040 rows 377 -> 406-438 GFLOP/s there (8, 10 and 12 rows measured alike).
constexpr int64_t kRowTile = 8;
constexpr int64_t kWide = 2;
#else
constexpr int64_t kWide = 1;
constexpr int64_t kRowTile = 6;  // rows of x per buffered micro-kernel (AVX2: 12 accumulators)
#endif
#if defined(__AVX512F__)
// 32 vector registers: 16 rows' sums and 4 k's weights stay in them, so up to 16 rows take the
// direct path in one group (weights dequantized once, not into a buffer). In two groups of 8,
// each dequantizing every weight, SmolLM2's projections for 16 rows ran at 179-188 GFLOP/s,
// in one group at 193-202 (2 Zen 4 cores). That is one panel at a time: two panels at a time
// (direct_pair, from 4 rows) in groups of up to 8 rows beat it on Zen 5 (not measured on Zen 4),
// so the one 16-row group serves only a last odd panel.
constexpr int64_t kDirectRows = 16;
constexpr int64_t kDirectGroup = 16;
#else
constexpr int64_t kDirectRows = 4;
constexpr int64_t kDirectGroup = 4;
#endif
constexpr int64_t kRowBlock = 256;  // rows of x per pass over the panels (see linear_panels); > kDirectRows


// ------------------------------------------------------------------ direct path: few rows

// sums[(k + j) mod U][r] += x[r, k + j] * v_j for j < 4 and R rows of x: the direct path's four
// k at a time, into U interleaved partial sums (U of 1, 2 or 4).
template <int R, int U>
inline void fma_four(const float* x, int64_t x_stride, int64_t k, V16 v0, V16 v1, V16 v2, V16 v3, V16 (&sums)[U][R]) {
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const float* xr = x + r * x_stride + k;
    sums[0][r] = fma16(xr[0], v0, sums[0][r]);
    sums[1 % U][r] = fma16(xr[1], v1, sums[1 % U][r]);
    sums[2 % U][r] = fma16(xr[2], v2, sums[2 % U][r]);
    sums[3 % U][r] = fma16(xr[3], v3, sums[3 % U][r]);
  }
}

// acc[r, 0:16] = sum over k of x[r, k] * W[panel row, k], for R rows of x, the weights
// dequantized in registers. U interleaved partial sums (k mod U) keep enough FMA chains in
// flight for few rows (an FMA's result is ready 4 cycles later and two issue a cycle).
template <int R, int U, bool kPacked, bool kBf16>
void direct_panel(const float* x, int64_t x_stride, const uint8_t* codes, const at::Half* scales,
                  const at::Half* mins, int64_t k_size, float* acc_out, int64_t acc_stride) {
  static_assert(U == 1 || U == 2 || U == 4, "k is unrolled by 4");
  V16 acc[U][R];
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[u][r] = zero16();
  }
  for (int64_t b = 0; b < k_size / kBlock; ++b) {
    const V16 d = load_half16(scales + b * kPanel), m = load_half16(mins + b * kPanel);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; k += 4) {
      V16 w0, w1, w2, w3;
      dequantize_pair<kPacked, kBf16>(codes, k, d, m, w0, w1);
      dequantize_pair<kPacked, kBf16>(codes, k + 2, d, m, w2, w3);
      fma_four<R, U>(x, x_stride, k, w0, w1, w2, w3, acc);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int u = 1; u < U; ++u) acc[0][r] = add16(acc[0][r], acc[u][r]);
    store16(acc_out + r * acc_stride, acc[0][r]);
  }
}

// 1 to 3 rows of float32 x (decode of a request or three), where turning every code into its
// weight is most of the work (each row adds one FMA a weight to ~5 instructions of dequantizing):
// each block's scale and min come out of its sum, acc[r, n] = sum over blocks b of scale[n, b] *
// (x[r, k] * code[n, k] summed over k in b) + min[n, b] * x_sums[r, b], so a code takes a
// conversion and an FMA per row, where scale * code + min took a multiply and an add more. The
// loader's float32 weights' function up to float32 rounding, not to the bit (the rounding of
// scale * code + min is not reproduced); like the interleaved sums these rows took before, a row
// of 1 to 3 is not the number it is in a batch of 4 or more. x_sums: [R, K / 32], each block's
// x[r] summed; acc_out keeps the sums between blocks.
template <int R, int U, bool kPacked>
void direct_panel_factored(const float* x, int64_t x_stride, const float* x_sums, const uint8_t* codes,
                           const at::Half* scales, const at::Half* mins, int64_t k_size, float* acc_out,
                           int64_t acc_stride) {
  static_assert(U == 1 || U == 2 || U == 4, "k is unrolled by 4");
  const int64_t num_blocks = k_size / kBlock;
  for (int64_t b = 0; b < num_blocks; ++b) {
    V16 part[U][R];
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) part[u][r] = zero16();
    }
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; k += 4) {
      V16 c0, c1, c2, c3;
      codes_pair<kPacked>(codes, k, c0, c1);
      codes_pair<kPacked>(codes, k + 2, c2, c3);
      fma_four<R, U>(x, x_stride, k, c0, c1, c2, c3, part);
    }
    const V16 d = load_half16(scales + b * kPanel), m = load_half16(mins + b * kPanel);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      V16 sum = part[0][r];
#pragma GCC unroll 4
      for (int u = 1; u < U; ++u) sum = add16(sum, part[u][r]);
      const V16 block = fma16(x_sums[r * num_blocks + b], m, mul16(d, sum));
      float* out = acc_out + r * acc_stride;
      store16(out, b == 0 ? block : add16(load16(out), block));
    }
  }
}

// Two adjacent panels (the second's codes `code_stride` bytes and its scales and mins
// `block_stride` further on), R rows: acc[r, 0:32] = the two panels' sums, each over k in order
// as direct_panel<R, 1> sums them. Each x[r, k] read serves two FMAs, which on Zen 5 (two
// 512-bit loads a cycle, as many as FMAs) beats keeping 16 rows in one group, though a 16-row
// batch dequantizes each weight twice: SmolLM2's projections, 16 rows 365-403 -> 422-428
// GFLOP/s, 8 rows 300-322 -> 394-409, 4 rows 229 -> 314-326; a decode step's 30 layers from
// DRAM at 16 rows 10.2-10.4 -> 9.7-9.9 ms.
template <int R, bool kPacked, bool kBf16>
void direct_pair(const float* x, int64_t x_stride, const uint8_t* codes, int64_t code_stride, const at::Half* scales,
                 const at::Half* mins, int64_t block_stride, int64_t k_size, float* acc_out, int64_t acc_stride) {
  V16 acc0[R], acc1[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = zero16();
  for (int64_t b = 0; b < k_size / kBlock; ++b) {
    const V16 d0 = load_half16(scales + b * kPanel), m0 = load_half16(mins + b * kPanel);
    const V16 d1 = load_half16(scales + block_stride + b * kPanel), m1 = load_half16(mins + block_stride + b * kPanel);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; k += 2) {
      V16 w0, w1, v0, v1;
      dequantize_pair<kPacked, kBf16>(codes, k, d0, m0, w0, w1);
      dequantize_pair<kPacked, kBf16>(codes + code_stride, k, d1, m1, v0, v1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * x_stride + k;
        acc0[r] = fma16(xr[0], w0, acc0[r]);
        acc1[r] = fma16(xr[0], v0, acc1[r]);
        acc0[r] = fma16(xr[1], w1, acc0[r]);
        acc1[r] = fma16(xr[1], v1, acc1[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    store16(acc_out + r * acc_stride, acc0[r]);
    store16(acc_out + r * acc_stride + kPanel, acc1[r]);
  }
}

template <bool kPacked, bool kBf16>
void direct_pair_rows(int64_t num_rows, const float* x, int64_t x_stride, const uint8_t* codes, int64_t code_stride,
                      const at::Half* scales, const at::Half* mins, int64_t block_stride, int64_t k_size, float* acc,
                      int64_t acc_stride) {
#define KVSERVICE_PAIR(R) \
  return direct_pair<R, kPacked, kBf16>(x, x_stride, codes, code_stride, scales, mins, block_stride, k_size, acc, acc_stride)
  switch (num_rows) {
    case 1: KVSERVICE_PAIR(1);
    case 2: KVSERVICE_PAIR(2);
    case 3: KVSERVICE_PAIR(3);
    case 4: KVSERVICE_PAIR(4);
    case 5: KVSERVICE_PAIR(5);
    case 6: KVSERVICE_PAIR(6);
    case 7: KVSERVICE_PAIR(7);
    default: KVSERVICE_PAIR(8);
  }
#undef KVSERVICE_PAIR
}

// Up to 3 rows (U > 1: more chains in flight), or any rows of a larger batch, whose sums then
// run over k in order as the buffered path's do: a row's result is the same in every batch
// of 4 or more rows, whichever path serves it.
template <bool kPacked, bool kBf16>
void direct_rows(int64_t num_rows, bool in_order, const float* x, int64_t x_stride, const float* x_sums,
                 const uint8_t* codes, const at::Half* scales, const at::Half* mins, int64_t k_size, float* acc,
                 int64_t acc_stride) {
#define KVSERVICE_DIRECT(R, U) \
  return direct_panel<R, U, kPacked, kBf16>(x, x_stride, codes, scales, mins, k_size, acc, acc_stride)
#define KVSERVICE_FACTORED(R, U) \
  return direct_panel_factored<R, U, kPacked>(x, x_stride, x_sums, codes, scales, mins, k_size, acc, acc_stride)
  if (x_sums != nullptr) {  // float32 x, 1 to 3 rows
    switch (num_rows) {
      case 1: KVSERVICE_FACTORED(1, 4);
      case 2: KVSERVICE_FACTORED(2, 2);
      default: KVSERVICE_FACTORED(3, 1);
    }
  }
#undef KVSERVICE_FACTORED
  switch (num_rows) {
    case 1: if (in_order) KVSERVICE_DIRECT(1, 1); KVSERVICE_DIRECT(1, 4);
    case 2: if (in_order) KVSERVICE_DIRECT(2, 1); KVSERVICE_DIRECT(2, 2);
    case 3: if (in_order) KVSERVICE_DIRECT(3, 1); KVSERVICE_DIRECT(3, 2);
#if defined(__AVX512F__)
    case 4: KVSERVICE_DIRECT(4, 1);
    case 5: KVSERVICE_DIRECT(5, 1);
    case 6: KVSERVICE_DIRECT(6, 1);
    case 7: KVSERVICE_DIRECT(7, 1);
    case 8: KVSERVICE_DIRECT(8, 1);
    case 9: KVSERVICE_DIRECT(9, 1);
    case 10: KVSERVICE_DIRECT(10, 1);
    case 11: KVSERVICE_DIRECT(11, 1);
    case 12: KVSERVICE_DIRECT(12, 1);
    case 13: KVSERVICE_DIRECT(13, 1);
    case 14: KVSERVICE_DIRECT(14, 1);
    case 15: KVSERVICE_DIRECT(15, 1);
    default: KVSERVICE_DIRECT(16, 1);
#else
    default: KVSERVICE_DIRECT(4, 1);
#endif
  }
#undef KVSERVICE_DIRECT
}

// ------------------------------------------------------------------ buffered path: more rows

// buf[k, 16 w : 16 (w + 1)] = the panel's weights for k in [k0, k0 + k_len), as float32 values,
// in a buffer of W panels side by side (k-major, 16 W floats a k).
template <bool kPacked, bool kBf16>
void dequantize_chunk(const uint8_t* codes, const at::Half* scales, const at::Half* mins, int64_t k0, int64_t k_len,
                      float* buf, int64_t num_wide, int64_t w) {
  const int64_t stride = num_wide * kPanel;
  for (int64_t b = k0 / kBlock; b < (k0 + k_len) / kBlock; ++b) {
    const V16 d = load_half16(scales + b * kPanel), m = load_half16(mins + b * kPanel);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; k += 2) {
      V16 w0, w1;
      dequantize_pair<kPacked, kBf16>(codes, k, d, m, w0, w1);
      float* out = buf + (k - k0) * stride + w * kPanel;
      store16(out, w0);
      store16(out + stride, w1);
    }
  }
}

// y[r, 0:16 W] (+)= sum over k of x[r, k] * buf[k, 0:16 W], for R rows of x and W panels side
// by side: each x[r, k] is read once for W FMAs.
template <int R, int W>
void buffered_tile(const float* x, int64_t x_stride, const float* buf, int64_t k_len, float* y, int64_t y_stride,
                   bool accumulate) {
  V16 acc[W][R];
#pragma GCC unroll 2
  for (int w = 0; w < W; ++w) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[w][r] = accumulate ? load16(y + r * y_stride + w * kPanel) : zero16();
  }
  for (int64_t k = 0; k < k_len; ++k) {
    V16 wv[W];
#pragma GCC unroll 2
    for (int w = 0; w < W; ++w) wv[w] = load16(buf + (k * W + w) * kPanel);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * x_stride + k];
#pragma GCC unroll 2
      for (int w = 0; w < W; ++w) acc[w][r] = fma16(xv, wv[w], acc[w][r]);
    }
  }
#pragma GCC unroll 2
  for (int w = 0; w < W; ++w) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) store16(y + r * y_stride + w * kPanel, acc[w][r]);
  }
}

template <int W>
void buffered_rows(int64_t num_rows, const float* x, int64_t x_stride, const float* buf, int64_t k_len, float* y,
                   int64_t y_stride, bool accumulate) {
  switch (num_rows) {
    case 1: return buffered_tile<1, W>(x, x_stride, buf, k_len, y, y_stride, accumulate);
    case 2: return buffered_tile<2, W>(x, x_stride, buf, k_len, y, y_stride, accumulate);
    case 3: return buffered_tile<3, W>(x, x_stride, buf, k_len, y, y_stride, accumulate);
    case 4: return buffered_tile<4, W>(x, x_stride, buf, k_len, y, y_stride, accumulate);
    case 5: return buffered_tile<5, W>(x, x_stride, buf, k_len, y, y_stride, accumulate);
#if defined(__AVX512F__)
    case 6: return buffered_tile<6, W>(x, x_stride, buf, k_len, y, y_stride, accumulate);
    case 7: return buffered_tile<7, W>(x, x_stride, buf, k_len, y, y_stride, accumulate);
#endif
    default: return buffered_tile<kRowTile, W>(x, x_stride, buf, k_len, y, y_stride, accumulate);
  }
}

// Prefetch panels' codes, scales and mins into L1: the direct path's next pair, while this one
// computes. A decode step streams every weight from DRAM, and the hardware prefetchers stop at
// each 4 KiB page, a few times a pair: SmolLM2's 30 layers at 16 rows 9.6-10.2 -> 9.0-9.3 ms
// (their weights in L3: 8.3 ms either way). Under 4 rows, where the loop is bound by
// dequantizing, the prefetches cost more than they saved (1 row: 2.3 -> 2.5 ms).
void prefetch_panels(const uint8_t* codes, int64_t code_bytes, const at::Half* scales, const at::Half* mins,
                     int64_t block_bytes) {
  const char* c = reinterpret_cast<const char*>(codes);
  for (int64_t b = 0; b < code_bytes; b += 64) __builtin_prefetch(c + b, 0, 3);
  const char* d = reinterpret_cast<const char*>(scales);
  const char* m = reinterpret_cast<const char*>(mins);
  for (int64_t b = 0; b < block_bytes; b += 64) {
    __builtin_prefetch(d + b, 0, 3);
    __builtin_prefetch(m + b, 0, 3);
  }
}

// ------------------------------------------------------------------ the op

// y[r, n] = acc[r, n] (+ bias[n]) rounded to scalar_t, for one panel's 16 columns; y may be acc.
template <typename scalar_t>
void store_panel(const float* acc, int64_t acc_stride, int64_t m_size, const scalar_t* bias, scalar_t* y,
                 int64_t y_stride) {
  for (int64_t r = 0; r < m_size; ++r) {
    for (int64_t n = 0; n < kPanel; ++n) {
      const float sum = bias == nullptr ? acc[r * acc_stride + n] : acc[r * acc_stride + n] + static_cast<float>(bias[n]);
      y[r * y_stride + n] = static_cast<scalar_t>(sum);
    }
  }
}

// This thread's buffered-path scratch: a dequantized chunk (kChunk * kPanel floats), then a tile
// of sums (kRowBlock * kWide * kPanel), 64-byte aligned; allocated on a thread's first use.
float* thread_buffers() {
  constexpr size_t kFloats = kChunk * kPanel + kRowBlock * kWide * kPanel;
  thread_local std::vector<float> storage(kFloats + 16);
  const auto address = reinterpret_cast<uintptr_t>(storage.data());
  return reinterpret_cast<float*>((address + 63) & ~static_cast<uintptr_t>(63));
}

// acc [M, N] float32 = x W^T, then y = acc + bias in scalar_t, panel by panel. Many rows go
// kRowBlock at a time through every panel, so the block of x every panel reads stays in L2
// and the strip of y a panel writes spans few pages (SmolLM2's gate/up projection of a
// 2,048-row prompt step, panel by panel over all rows: 38.6 ms; 256 rows at a time: 35.6 ms).
// Each output's sum runs over k in the same order either way.
template <typename scalar_t, bool kPacked, bool kBf16>
void linear_panels(const float* x, int64_t m_size, int64_t k_size, const uint8_t* codes, const at::Half* scales,
                   const at::Half* mins, int64_t num_panels, const scalar_t* bias, float* acc, scalar_t* y) {
  const int64_t n_size = num_panels * kPanel;
  const int64_t panel_code_bytes = kPacked ? k_size / 2 * kPanel : k_size * kPanel;
  const int64_t panel_blocks = k_size / kBlock * kPanel;
  for (int64_t m0 = 0; m0 < m_size; m0 += kRowBlock) {
    const int64_t m_len = std::min(kRowBlock, m_size - m0);
    const float* x_block = x + m0 * k_size;
    float* acc_block = acc + m0 * n_size;
    // Few rows: a panel at a time, dequantized in registers. More: kWide panels at a time, their
    // chunks side by side in one buffer of kChunk * kPanel floats, so each x[r, k] read serves
    // kWide FMAs (Zen 5 loads two 512-bit operands a cycle, as many as it issues FMAs: with one
    // panel, x's broadcasts and the weights took every load slot; 2,040 rows of SmolLM2's
    // projections 406-438 -> 456-495 GFLOP/s).
    const bool direct = m_size <= kDirectRows;  // then one block: m_len == m_size
    // Pairs of panels in the direct path too from 4 rows, where its sums run over k in order.
    const int64_t wide_max = direct && m_size < 4 ? 1 : kWide;
    const bool use_tile = !direct && n_size * static_cast<int64_t>(sizeof(float)) % 4096 == 0;
    // 1 to 3 rows of float32 x: each block's sum of x, for direct_panel_factored.
    std::vector<float> x_sums;
    if (direct && m_size < 4 && !kBf16) {
      x_sums.resize(m_size * (k_size / kBlock));
      for (int64_t r = 0; r < m_size; ++r) {
        for (int64_t b = 0; b < k_size / kBlock; ++b) {
          float sum = 0.f;
          for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) sum += x_block[r * k_size + k];
          x_sums[r * (k_size / kBlock) + b] = sum;
        }
      }
    }
    // One group: `wide` panels from p0; `next`: the group this thread computes after it (-1: unknown).
    // buf and tile: the buffered path's (kChunk * kPanel floats, and kRowBlock * kWide * kPanel).
    const auto compute_group = [&](int64_t group, int64_t next, float* buf, float* tile) {
        const int64_t p0 = group * wide_max, wide = std::min(wide_max, num_panels - p0);
        float* sums = acc_block + p0 * kPanel;  // the group's sums, row r at sums + r * sums_stride
        int64_t sums_stride = n_size;
        if (direct && wide_max == 2 && next >= 0) {  // the next pair's weights, while this one computes
          const int64_t q0 = next * wide_max, next_wide = std::min(wide_max, num_panels - q0);
          prefetch_panels(codes + q0 * panel_code_bytes, next_wide * panel_code_bytes, scales + q0 * panel_blocks,
                          mins + q0 * panel_blocks, next_wide * panel_blocks * static_cast<int64_t>(sizeof(at::Half)));
        }
        if (direct && wide == 2) {  // rows in even groups of up to 8, each dequantizing the pair
          const int64_t groups = (m_len + 7) / 8, per = (m_len + groups - 1) / groups;
          for (int64_t r0 = 0; r0 < m_len; r0 += per) {
            direct_pair_rows<kPacked, kBf16>(std::min(per, m_len - r0), x_block + r0 * k_size, k_size,
                                             codes + p0 * panel_code_bytes, panel_code_bytes, scales + p0 * panel_blocks,
                                             mins + p0 * panel_blocks, panel_blocks, k_size, sums + r0 * sums_stride,
                                             sums_stride);
          }
        } else if (direct) {
          for (int64_t r0 = 0; r0 < m_len; r0 += kDirectGroup) {
            direct_rows<kPacked, kBf16>(std::min(kDirectGroup, m_len - r0), m_size > 3, x_block + r0 * k_size, k_size,
                                        x_sums.empty() ? nullptr : x_sums.data() + r0 * (k_size / kBlock),
                                        codes + p0 * panel_code_bytes, scales + p0 * panel_blocks,
                                        mins + p0 * panel_blocks, k_size, sums + r0 * sums_stride, sums_stride);
          }
        } else {
          // Where y's rows are a multiple of 4 KiB apart, the sums gather in `tile` (rows wide *
          // 16 floats apart) and go to y at the end: otherwise every row of a tile falls in the
          // same L1 set and its stores alias the loads after them (4K aliasing). SmolLM2's
          // gate/up projection (rows 12 KiB apart), 2,040 rows: 450-458 -> 466-472 GFLOP/s alone,
          // 8 prompts of 256 tokens in-process 1.23 -> 1.13-1.17 s. Elsewhere the extra pass
          // costs more than it saves (qkv, o: 513-533 -> 496-503).
          const int64_t chunk = kChunk / wide;
          if (use_tile) {
            sums = tile;
            sums_stride = wide * kPanel;
          }
          for (int64_t k0 = 0; k0 < k_size; k0 += chunk) {
            const int64_t k_len = std::min(chunk, k_size - k0);
            for (int64_t w = 0; w < wide; ++w) {
              const int64_t p = p0 + w;
              dequantize_chunk<kPacked, kBf16>(codes + p * panel_code_bytes, scales + p * panel_blocks,
                                               mins + p * panel_blocks, k0, k_len, buf, wide, w);
            }
            // Tiles of rows as even as kRowTile allows: a last tile of 1 or 2 rows (13 or 8
            // rows with AVX2's 6) has too few FMA chains to hide their latency. SmolLM2's
            // projections on 2 Zen 3 cores, GFLOP/s: 8 rows 86-101 -> 108-114, 12 rows 92-124
            // -> 125-134, 13 rows 82-114 -> 122-135 (30 layers from DRAM alternating: 8 rows
            // 17.3 / 18.2 / 24.7 -> 15.6 / 19.6 / 20.5 ms, 13 rows 25.3 / 26.1 / 31.2 -> 24.4 /
            // 24.6 / 27.0). Putting the chunk's dequantizing into the first tile was slower.
            const int64_t tiles = (m_len + kRowTile - 1) / kRowTile;
            for (int64_t t = 0; t < tiles; ++t) {
              const int64_t r0 = t * m_len / tiles, r1 = (t + 1) * m_len / tiles;
              auto* rows = wide == 2 ? &buffered_rows<2> : &buffered_rows<1>;
              rows(r1 - r0, x_block + r0 * k_size + k0, k_size, buf, k_len, sums + r0 * sums_stride, sums_stride,
                   k0 > 0);
            }
          }
        }
        // Sums already in y (float32 output, no tile) need a pass only to add a bias, not one
        // copying them onto themselves (where a decode profile put samples; steps within noise).
        const bool in_place = static_cast<const void*>(sums) == static_cast<const void*>(y + m0 * n_size + p0 * kPanel);
        if (in_place && bias == nullptr) return;
        for (int64_t w = 0; w < wide; ++w) {
          const int64_t p = p0 + w;
          store_panel(sums + w * kPanel, sums_stride, m_len, bias == nullptr ? nullptr : bias + p * kPanel,
                      y + m0 * n_size + p * kPanel, n_size);
        }
    };
    // The direct path needs no scratch; the buffered path takes this thread's.
    const auto run_group = [&](int64_t group, int64_t next) {
      float* buffers = direct ? nullptr : thread_buffers();
      compute_group(group, next, buffers, direct ? nullptr : buffers + kChunk * kPanel);
    };
    const int64_t num_groups = (num_panels + wide_max - 1) / wide_max;
    if (num_groups <= 16 / wide_max) {  // too little to share: this thread alone
      for (int64_t group = 0; group < num_groups; ++group) run_group(group, group + 1 < num_groups ? group + 1 : -1);
      continue;
    }
    // Groups balanced between the threads (each its range front to back, then the others'
    // last). Decode: two halves of equal work finished a few us apart, one thread spinning.
    // Prompts: a thread whose core a serving thread takes for a while (1P1D's proxy and
    // workers' event loops) no longer holds up the other for that long.
    kvservice::parallel_for_balanced(num_groups, [&](int64_t group, int64_t next, int64_t) { run_group(group, next); });
  }
}

template <bool kPacked>
at::Tensor linear(const at::Tensor& x, const uint8_t* codes, const at::Half* scales, const at::Half* mins,
                  int64_t num_panels, int64_t k_size, const c10::optional<at::Tensor>& bias) {
  const int64_t m_size = x.size(0), n_size = num_panels * kPanel;
  const bool has_bias = bias.has_value() && bias->defined();
  auto y = at::empty({m_size, n_size}, x.options());
  if (m_size == 0) return y;
  if (x.scalar_type() == at::kFloat) {  // accumulates in y itself
    float* y_ptr = y.data_ptr<float>();
    linear_panels<float, kPacked, false>(x.data_ptr<float>(), m_size, k_size, codes, scales, mins, num_panels,
                                         has_bias ? bias->data_ptr<float>() : nullptr, y_ptr, y_ptr);
    return y;
  }
  // bfloat16 -> float32 is exact: the products and sums are the float32 path's.
  const c10::BFloat16* x_bf16 = x.data_ptr<c10::BFloat16>();
  std::vector<float> x_float(m_size * k_size);
  for (int64_t i = 0; i < m_size * k_size; ++i) x_float[i] = static_cast<float>(x_bf16[i]);
  std::vector<float> acc(m_size * n_size);
  linear_panels<c10::BFloat16, kPacked, true>(x_float.data(), m_size, k_size, codes, scales, mins, num_panels,
                                              has_bias ? bias->data_ptr<c10::BFloat16>() : nullptr, acc.data(),
                                              y.data_ptr<c10::BFloat16>());
  return y;
}

at::Tensor block_quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (is_bf16 || x.scalar_type() == at::kFloat),
              "x must be a contiguous float32 or bfloat16 [M, K] tensor");
  const bool packed = codes.scalar_type() == at::kByte;
  TORCH_CHECK(codes.dim() == 3 && codes.size(2) == kPanel && codes.is_contiguous() &&
                  (packed || codes.scalar_type() == at::kChar),
              "codes must be a contiguous uint8 [P, K / 2, 16] (4-bit pairs) or int8 [P, K, 16] tensor");
  const int64_t num_panels = codes.size(0), k_size = packed ? 2 * codes.size(1) : codes.size(1);
  TORCH_CHECK(x.size(1) == k_size && k_size % kBlock == 0, "x [M, K] and codes disagree on K, or K % 32 != 0");
  for (const at::Tensor* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->dim() == 3 && t->size(0) == num_panels &&
                    t->size(1) == k_size / kBlock && t->size(2) == kPanel,
                "scales and mins must be contiguous float16 [P, K / 32, 16] tensors");
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == num_panels * kPanel && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "bias must be a contiguous [N] tensor of x's dtype");
  }
  const uint8_t* codes_ptr = static_cast<const uint8_t*>(codes.data_ptr());
  const at::Half* scales_ptr = scales.data_ptr<at::Half>();
  const at::Half* mins_ptr = mins.data_ptr<at::Half>();
  return packed ? linear<true>(x, codes_ptr, scales_ptr, mins_ptr, num_panels, k_size, bias)
                : linear<false>(x, codes_ptr, scales_ptr, mins_ptr, num_panels, k_size, bias);
}

}  // namespace

namespace kvservice {
at::Tensor block_quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& mins, const c10::optional<at::Tensor>& bias) {
  return ::block_quant_linear(x, codes, scales, mins, bias);
}
}  // namespace kvservice

TORCH_LIBRARY_FRAGMENT(kvservice, m) {
  m.def("block_quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvservice, CPU, m) { m.impl("block_quant_linear", &block_quant_linear); }
