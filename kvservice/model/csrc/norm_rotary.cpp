// Fused RMSNorm (with the residual add) and in-place rotary embedding for the decoder.
//
// Registered as torch.ops.kvservice.add_rms_norm_ and torch.ops.kvservice.rotary_;
// kvservice/cpu_kernels.py builds them on first use, and kvservice/model.py keeps the
// PyTorch formulas as the fallback. Both round like the reference: RMSNorm normalises
// in float32, rounds to the model's dtype, then scales; rotary products are not fused
// into FMAs (built with -ffp-contract=off), so float32 results are bit-identical.
// Their rows split over kvservice's thread pool, as the matmuls': an OpenMP region
// (at::parallel_for) between two pool jobs found the core of its second thread taken by the
// pool's worker, still spinning for the next job (a prefill worker's 256-token steps spent
// ~15% of their time in these two ops).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "ops.h"
#include "rotary.h"
#include "thread_pool.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace {

constexpr int64_t kNormRows = 8;  // rows whose sums of squares run side by side (the switch below counts to it)
// A task's least rows. A decode step's 14 rows on one thread kept the other spinning: its 60
// norms and 30 rotaries took 0.3 and 0.09 ms a step (SmolLM2), ~5 and ~3 us a call.
constexpr int64_t kGrainRows = 4;

// residual [T, H] += x (when x is defined), rounded to the dtype; returns
// weight * dtype(residual * rsqrt(mean(residual^2) + eps)) as a new [T, H] tensor.
at::Tensor add_rms_norm_(at::Tensor residual, const c10::optional<at::Tensor>& x, const at::Tensor& weight,
                         double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "residual must be a contiguous [T, H] tensor");
  const bool has_x = x.has_value() && x->defined();
  if (has_x) {
    TORCH_CHECK(x->sizes() == residual.sizes() && x->is_contiguous() && x->scalar_type() == residual.scalar_type(),
                "x must match residual");
  }
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == residual.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == residual.scalar_type(),
              "weight must be a [H] tensor of residual's dtype");
  const int64_t rows = residual.size(0), hidden = residual.size(1);
  auto out = at::empty_like(residual);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm_", [&] {
    scalar_t* r = residual.data_ptr<scalar_t>();
    const scalar_t* xs = has_x ? x->data_ptr<scalar_t>() : nullptr;
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    kvservice::parallel_for(rows, kGrainRows, [&](int64_t begin, int64_t end) {
      for (int64_t t0 = begin; t0 < end; t0 += kNormRows) {
        const int64_t n = std::min(kNormRows, end - t0);
        if (xs != nullptr) {
          for (int64_t t = t0; t < t0 + n; ++t) {
            scalar_t* rr = r + t * hidden;
            const scalar_t* xr = xs + t * hidden;
            for (int64_t i = 0; i < hidden; ++i) rr[i] = static_cast<scalar_t>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
          }
        }
        // Each row's sum of squares in double, over i in order as one row alone would take
        // it, the rows' sums interleaved: one sum's chain of dependent adds left the adder
        // idle (a 16-row decode step's 60 norms: ~0.55 ms).
        double sum[kNormRows] = {};
        const auto sum_squares = [&](auto rows_here) {
          for (int64_t i = 0; i < hidden; ++i) {
            for (int64_t j = 0; j < rows_here; ++j) {
              const float v = static_cast<float>(r[(t0 + j) * hidden + i]);
              sum[j] += static_cast<double>(v) * v;
            }
          }
        };
        // A fixed count, so the sums stay in registers: a 7-row task (a 14-request decode step
        // split over two threads) took ~5 us a norm with the count a variable, against ~1.
        switch (n) {
          case 1: sum_squares(std::integral_constant<int64_t, 1>()); break;
          case 2: sum_squares(std::integral_constant<int64_t, 2>()); break;
          case 3: sum_squares(std::integral_constant<int64_t, 3>()); break;
          case 4: sum_squares(std::integral_constant<int64_t, 4>()); break;
          case 5: sum_squares(std::integral_constant<int64_t, 5>()); break;
          case 6: sum_squares(std::integral_constant<int64_t, 6>()); break;
          case 7: sum_squares(std::integral_constant<int64_t, 7>()); break;
          default: sum_squares(std::integral_constant<int64_t, kNormRows>()); break;
        }
        for (int64_t j = 0; j < n; ++j) {
          const scalar_t* rr = r + (t0 + j) * hidden;
          const float inv = 1.f / std::sqrt(static_cast<float>(sum[j] / hidden) + static_cast<float>(eps));
          scalar_t* orow = o + (t0 + j) * hidden;
          for (int64_t i = 0; i < hidden; ++i) {
            const scalar_t normed = static_cast<scalar_t>(static_cast<float>(rr[i]) * inv);
            orow[i] = static_cast<scalar_t>(static_cast<float>(w[i]) * static_cast<float>(normed));
          }
        }
      }
    });
  });
  return out;
}

// qkv [T, (Hq + 2 Hkv) * D]: rotates the first `num_heads` heads (q's and k's) in place by
// the angles of `positions` [T]; cos_table, sin_table: float32 [max_positions, D].
void rotary_(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos_table, const at::Tensor& sin_table,
             int64_t num_heads, int64_t head_dim) {
  kvservice::check_rotary_args(qkv, positions, cos_table, sin_table, num_heads, head_dim);
  const int64_t rows = qkv.size(0), row_stride = qkv.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cos_ptr = cos_table.data_ptr<float>();
  const float* sin_ptr = sin_table.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    kvservice::parallel_for(rows, kGrainRows, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        kvservice::rotate_heads(base + t * row_stride, cos_ptr + pos[t] * head_dim, sin_ptr + pos[t] * head_dim, num_heads, head_dim);
      }
    });
  });
}

}  // namespace

namespace kvservice {
void check_rotary_args(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_table,
                       const at::Tensor& sin_table, int64_t num_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "qkv must be a [T, width] tensor with contiguous rows");
  TORCH_CHECK(num_heads * head_dim <= qkv.size(1) && head_dim % 2 == 0, "num_heads * head_dim exceeds qkv's width");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.size(0) == qkv.size(0),
              "positions must be a contiguous [T] int64 tensor");
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat &&
                  cos_table.is_contiguous() && sin_table.is_contiguous() && cos_table.size(1) == head_dim,
              "cos/sin tables must be contiguous float32 [max_positions, D]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < qkv.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_table.size(0), "position ", pos[t], " outside the rotary table");
  }
}
at::Tensor add_rms_norm_(at::Tensor residual, const c10::optional<at::Tensor>& x, const at::Tensor& weight,
                         double eps) {
  return ::add_rms_norm_(std::move(residual), x, weight, eps);
}
void rotary_(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos_table, const at::Tensor& sin_table,
             int64_t num_heads, int64_t head_dim) {
  ::rotary_(std::move(qkv), positions, cos_table, sin_table, num_heads, head_dim);
}
}  // namespace kvservice

TORCH_LIBRARY_FRAGMENT(kvservice, m) {
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor? x, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) qkv, Tensor positions, Tensor cos_table, Tensor sin_table, int num_heads, int head_dim) -> ()");
}

TORCH_LIBRARY_IMPL(kvservice, CPU, m) {
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("rotary_", &rotary_);
}
