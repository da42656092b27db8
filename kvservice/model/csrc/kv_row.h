// How the kernels read and write the KV cache's rows, whatever its element type (--kv-cache-dtype).
// A row is one token's values of one KV head: head_dim elements, and for int8 the row's float32
// scale in the 4 bytes after them (symmetric, per token per head: value = code * scale).
//   the model's own dtype (float32, bfloat16, float16): the values as they are;
//   c10::BFloat16 under float32 compute: widened as they load (a 16-bit shift), rounded to
//     nearest even as they store;
//   int8_t: codes in [-127, 127]; loads widen the codes, and the kernels multiply a score or a
//     value weight by the row's scale (`scaled`), once a row, not once an element.
// kvservice/model/kv_dtype.py writes and reads the same rows in PyTorch (the fallback path).

#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvservice {

// Whether rows of kv_t carry a scale after their values.
template <typename kv_t>
constexpr bool kScaledRows = std::is_same_v<kv_t, int8_t>;

constexpr int64_t kScaleBytes = 4;

// Elements of a cache row of kv_t: head_dim values, then int8's scale.
template <typename kv_t>
constexpr int64_t row_width(int64_t head_dim) {
  return head_dim + (kScaledRows<kv_t> ? kScaleBytes : 0);
}

// The same for a cache tensor's dtype (int8 is at::kChar).
inline int64_t row_width(at::ScalarType kv_type, int64_t head_dim) {
  return head_dim + (kv_type == at::kChar ? kScaleBytes : 0);
}

// w times the scale of `row` (head_dim values of kv_t): w itself where rows have no scale.
template <typename kv_t>
inline float scaled(float w, const kv_t* row, int64_t head_dim) {
  if constexpr (kScaledRows<kv_t>) {
    float scale;
    std::memcpy(&scale, row + head_dim, sizeof(scale));
    return w * scale;
  } else {
    return w;
  }
}

// One row of head_dim values from `src` into a cache row of kv_t: a copy for the same type,
// round-to-nearest-even for bfloat16, symmetric 8-bit codes and their scale for int8 (the codes
// x * (127 / amax) rounded half to even, as torch.round; kv_dtype.encode_rows does the same).
template <typename kv_t, typename src_t>
inline void store_row(kv_t* dst, const src_t* src, int64_t head_dim) {
  if constexpr (std::is_same_v<kv_t, src_t>) {
    std::memcpy(dst, src, head_dim * sizeof(kv_t));
  } else if constexpr (kScaledRows<kv_t>) {
    float amax = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(static_cast<float>(src[d])));
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t d = 0; d < head_dim; ++d) {
      const float code = std::nearbyint(static_cast<float>(src[d]) * inv);
      dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, code)));
    }
    std::memcpy(dst + head_dim, &scale, sizeof(scale));
  } else {
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<kv_t>(static_cast<float>(src[d]));
  }
}

// One token's K (or V) rows, every KV head: from `src` ([num_kv_heads, head_dim], contiguous)
// into the cache's token row at `dst`.
template <typename kv_t, typename src_t>
inline void store_token(kv_t* dst, const src_t* src, int64_t num_kv_heads, int64_t head_dim) {
  if constexpr (std::is_same_v<kv_t, src_t>) {
    std::memcpy(dst, src, num_kv_heads * head_dim * sizeof(kv_t));
  } else {
    for (int64_t h = 0; h < num_kv_heads; ++h) store_row(dst + h * row_width<kv_t>(head_dim), src + h * head_dim, head_dim);
  }
}

// Calls f with a null `const kv_t*` for the cache's element type: the compute type scalar_t
// itself, bfloat16 or int8. Any other pairing is refused.
template <typename scalar_t, typename F>
void visit_kv_type(at::ScalarType kv_type, F&& f) {
  if (kv_type == c10::CppTypeToScalarType<scalar_t>::value) {
    f(static_cast<const scalar_t*>(nullptr));
  } else if (kv_type == at::kBFloat16) {
    f(static_cast<const c10::BFloat16*>(nullptr));
  } else if (kv_type == at::kChar) {
    f(static_cast<const int8_t*>(nullptr));
  } else {
    TORCH_CHECK(false, "a KV cache of ", kv_type, " under ", c10::CppTypeToScalarType<scalar_t>::value,
                " compute: it must be the compute dtype, bfloat16 or int8");
  }
}

#if defined(__AVX2__)
// 8 values of a row as float32 (int8: the codes, unscaled).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

#if defined(__AVX512F__)
// 16 values of a row as float32 (int8: the codes, unscaled).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif

}  // namespace kvservice
