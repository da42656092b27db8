// One token's rotary embedding, shared by rotary_ (norm_rotary.cpp) and the decode layer's fused
// rotary + KV write (decode_layer.cpp), so both compute the same numbers.
//
// Rounds like the reference: it multiplies in the model's dtype, so the angles are rounded to
// it first, and every product before the sum (built with -ffp-contract=off: no FMA).

#pragma once

#include <cstdint>

namespace kvservice {

// Rotates the `num_heads` heads of `row` (each `head_dim` wide, contiguous) in place by the
// angles c, s (float32 [head_dim]: the token's position's row of the cos and sin tables).
template <typename scalar_t>
inline void rotate_heads(scalar_t* row, const float* c, const float* s, int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    scalar_t* x = row + h * head_dim;
    for (int64_t d = 0; d < half; ++d) {
      const float x1 = static_cast<float>(x[d]), x2 = static_cast<float>(x[d + half]);
      const float c1 = static_cast<float>(static_cast<scalar_t>(c[d]));
      const float s1 = static_cast<float>(static_cast<scalar_t>(s[d]));
      const float c2 = static_cast<float>(static_cast<scalar_t>(c[d + half]));
      const float s2 = static_cast<float>(static_cast<scalar_t>(s[d + half]));
      // x * cos + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1].
      const float a1 = static_cast<float>(static_cast<scalar_t>(x1 * c1));
      const float b1 = static_cast<float>(static_cast<scalar_t>(-x2 * s1));
      const float a2 = static_cast<float>(static_cast<scalar_t>(x2 * c2));
      const float b2 = static_cast<float>(static_cast<scalar_t>(x1 * s2));
      x[d] = static_cast<scalar_t>(a1 + b1);
      x[d + half] = static_cast<scalar_t>(a2 + b2);
    }
  }
}

}  // namespace kvservice
