// RMSNorm (with the residual add after it) and the per-head q/k norm with the rotary embedding, on rows of
// float32 or bfloat16 values; the tensor entry points are in norms.cpp, the fused decode layer calls the rows.

#pragma once

#include <vector>

#include "common.h"

namespace swa {

// rows (R, D) -> y = x * rsqrt(mean(x^2) + eps) * scale, scale (D,) or (heads, D) for rows of heads; with a
// residual r, y = r + round(y) (the torch path rounds the norm's output before adding it). `y` may be `residual`.
template <typename T>
void rms_rows(const T* x, const float* scale, int64_t scale_rows, const T* residual, T* y, int64_t rows,
              int64_t D, float eps) {
  auto body = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * D;
      const float inv = inverse_rms(xr, D, eps);
      const float* sc = scale + (r % scale_rows) * D;
      T* yr = y + r * D;
      if (residual == nullptr) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) store(yr, d, load(xr, d) * inv * sc[d]);
      } else {
        const T* rr = residual + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) store(yr, d, load(rr, d) + as_stored<T>(load(xr, d) * inv * sc[d]));
      }
    }
  };
  if (rows <= 8) {
    body(0, rows);  // a decode step's few rows: a parallel region would cost more than the work
  } else {
    at::parallel_for(0, rows, 16, body);
  }
}

// x (T, row_stride): the first `heads` heads of D values of each row (the q heads, then the k heads)
// normalised each with its own scale (heads, D), rounded to the model's dtype (as the torch path stores it),
// then rotated: y = x * cos + roll(x, D/2) * sin with cos/sin (T, D) float32 (sin already negated in its first
// half). y (T, heads, D).
template <typename T>
void qk_rows(const T* x, int64_t row_stride, const float* scale, const float* cos, const float* sin, T* y,
             int64_t tokens, int64_t heads, int64_t D, float eps) {
  const int64_t half = D / 2;
  auto body = [&](int64_t i0, int64_t i1) {
    std::vector<float> n(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads, h = i % heads;
      const T* xr = x + t * row_stride + h * D;
      const float inv = inverse_rms(xr, D, eps);
      const float* sc = scale + h * D;
      for (int64_t d = 0; d < D; ++d) n[d] = as_stored<T>(load(xr, d) * inv * sc[d]);
      const float* c = cos + t * D;
      const float* s = sin + t * D;
      T* yr = y + i * D;
      for (int64_t d = 0; d < D; ++d) {
        const float rolled = d < half ? n[d + half] : n[d - half];
        store(yr, d, n[d] * c[d] + rolled * s[d]);
      }
    }
  };
  if (tokens <= 8) {
    body(0, tokens * heads);
  } else {
    at::parallel_for(0, tokens * heads, 8, body);
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& scale, double eps, const c10::optional<at::Tensor>& residual);
at::Tensor qk_norm_rope(const at::Tensor& qkv, int64_t heads, const at::Tensor& scale, const at::Tensor& cos,
                        const at::Tensor& sin, double eps);

}  // namespace swa
