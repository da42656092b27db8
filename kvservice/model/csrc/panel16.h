// Sixteen float32 lanes (one panel of block-quantized outputs) over AVX-512, AVX2 or plain C++,
// and the dequantizing of a panel's codes into them: what block_quant_linear computes with and
// what the greedy head's exact part must reproduce, bit for bit, so both take it from here.

#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace kvservice::panel16 {

constexpr int64_t kPanel = 16;  // output rows per panel: one 16-float vector (two with AVX2)
constexpr int64_t kBlock = 32;  // weights per scale/min

// ------------------------------------------------------------------ 16 lanes of float32

#if defined(__AVX512F__)
struct V16 {
  __m512 v;
};
inline V16 zero16() { return {_mm512_setzero_ps()}; }
inline V16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store16(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 load_half16(const at::Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline V16 u8_to_float(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))}; }
inline V16 i8_to_float(__m128i b) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))}; }
inline V16 mul16(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 add16(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 fma16(float x, V16 w, V16 acc) { return {_mm512_fmadd_ps(_mm512_set1_ps(x), w.v, acc.v)}; }
// The float32 values rounded to bfloat16 (to nearest, ties to even): the bits added carry into
// the kept 16 exactly when the dropped 16 are above half, or at half with an odd kept part.
// For finite w (weights are: float16 scales and mins times small integers).
inline V16 round_bf16(V16 w) {
  const __m512i bits = _mm512_castps_si512(w.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return {_mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct V16 {
  __m256 lo, hi;
};
inline V16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store16(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V16 load_half16(const at::Half* p) {
  const __m128i* q = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
}
inline V16 u8_to_float(__m128i b) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
}
inline V16 i8_to_float(__m128i b) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
inline V16 mul16(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 add16(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 fma16(float x, V16 w, V16 acc) {
  const __m256 xb = _mm256_set1_ps(x);
  return {_mm256_fmadd_ps(xb, w.lo, acc.lo), _mm256_fmadd_ps(xb, w.hi, acc.hi)};
}
inline __m256 round_bf16_8(__m256 w) {
  const __m256i bits = _mm256_castps_si256(w);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline V16 round_bf16(V16 w) { return {round_bf16_8(w.lo), round_bf16_8(w.hi)}; }
#else
#define KVSERVICE_SCALAR_V16 1
struct V16 {
  float f[kPanel];
};
inline V16 zero16() { return V16{}; }
inline V16 load16(const float* p) {
  V16 a;
  std::copy(p, p + kPanel, a.f);
  return a;
}
inline void store16(float* p, V16 a) { std::copy(a.f, a.f + kPanel, p); }
inline V16 load_half16(const at::Half* p) {
  V16 a;
  for (int64_t n = 0; n < kPanel; ++n) a.f[n] = static_cast<float>(p[n]);
  return a;
}
inline V16 mul16(V16 a, V16 b) {
  for (int64_t n = 0; n < kPanel; ++n) a.f[n] *= b.f[n];  // rounded: built with -ffp-contract=off
  return a;
}
inline V16 add16(V16 a, V16 b) {
  for (int64_t n = 0; n < kPanel; ++n) a.f[n] += b.f[n];
  return a;
}
inline V16 fma16(float x, V16 w, V16 acc) {
  for (int64_t n = 0; n < kPanel; ++n) acc.f[n] += x * w.f[n];
  return acc;
}
inline V16 round_bf16(V16 w) {
  for (int64_t n = 0; n < kPanel; ++n) w.f[n] = static_cast<float>(c10::BFloat16(w.f[n]));
  return w;
}
#endif

// ------------------------------------------------------------------ dequantizing codes

// The panel's 16 codes at k and k + 1 (k even, `codes` at k's row), as float32 values.
template <bool kPacked>
inline void codes_pair(const uint8_t* codes, int64_t k, V16& c0, V16& c1) {
#ifdef KVSERVICE_SCALAR_V16
  for (int64_t n = 0; n < kPanel; ++n) {
    if constexpr (kPacked) {
      const uint8_t byte = codes[k / 2 * kPanel + n];
      c0.f[n] = static_cast<float>(byte & 0x0F);
      c1.f[n] = static_cast<float>(byte >> 4);
    } else {
      c0.f[n] = static_cast<float>(reinterpret_cast<const int8_t*>(codes)[k * kPanel + n]);
      c1.f[n] = static_cast<float>(reinterpret_cast<const int8_t*>(codes)[(k + 1) * kPanel + n]);
    }
  }
#else
  if constexpr (kPacked) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k / 2 * kPanel));
    const __m128i low = _mm_set1_epi8(0x0F);
    c0 = u8_to_float(_mm_and_si128(bytes, low));
    c1 = u8_to_float(_mm_and_si128(_mm_srli_epi16(bytes, 4), low));
  } else {
    c0 = i8_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * kPanel)));
    c1 = i8_to_float(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (k + 1) * kPanel)));
  }
#endif
}

// The panel's 16 weights at k and k + 1 (k even, `codes` at k's row): scale * code + min, the
// product rounded before the sum; bfloat16-rounded when kBf16.
template <bool kPacked, bool kBf16>
inline void dequantize_pair(const uint8_t* codes, int64_t k, V16 d, V16 m, V16& w0, V16& w1) {
  codes_pair<kPacked>(codes, k, w0, w1);
  w0 = add16(mul16(d, w0), m);
  w1 = add16(mul16(d, w1), m);
  if constexpr (kBf16) {
    w0 = round_bf16(w0);
    w1 = round_bf16(w1);
  }
}

}  // namespace kvservice::panel16
