// exp(x) for x <= 0 in vector registers: the softmax of the attention kernels
// (paged_attention.cpp, prompt_attention.cpp), which share it so both round alike.

#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace kvservice {

// exp(x) for x <= 0 (scores minus their maximum), a vector at a time: x = n ln2 + r with
// |r| <= ln2 / 2 (ln2 split in two, Cody and Waite), e^r by its degree-6 Taylor polynomial
// (relative error under 2e-7), times 2^n built in the exponent bits. Below -87 (and -inf, a
// masked key): 0. The AVX2 and AVX-512 versions share these constants, so the same numbers.
constexpr float kExpLowest = -87.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpTaylor[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};  // Horner: highest degree first

// exp(x) for x <= 0, 8 at a time.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(kExpLowest);
  const __m256 is_tiny = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lowest);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(is_tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

#if defined(__AVX512F__)
// exp(x) for x <= 0, 16 at a time.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(kExpLowest);
  const __mmask16 is_tiny = _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lowest);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[i]));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~is_tiny), p, _mm512_castsi512_ps(bits));
}

#endif

}  // namespace kvservice

#endif
