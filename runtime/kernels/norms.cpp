// Tensor entry points of the norms (norms.h): argument checks, then the rows.

#include "norms.h"

namespace swa {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& scale, double eps, const c10::optional<at::Tensor>& residual) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "scale must be contiguous float32");
  const int64_t D = x.size(-1);
  TORCH_CHECK(scale.size(-1) == D, "scale's last dimension must be x's");
  const int64_t scale_rows = scale.numel() / D;
  TORCH_CHECK(scale_rows == 1 || (x.dim() >= 2 && x.size(-2) == scale_rows), "scale must be (D,) or (heads, D)");
  const at::Tensor* r = residual.has_value() ? &residual.value() : nullptr;
  if (r != nullptr) {
    TORCH_CHECK(r->sizes() == x.sizes() && r->scalar_type() == x.scalar_type() && r->is_contiguous(),
                "residual must match x");
  }
  auto y = at::empty_like(x);
  const int64_t rows = x.numel() / D;
  with_float_type(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    rms_rows<T>(data_of<T>(x), scale.data_ptr<float>(), scale_rows, r ? data_of<T>(*r) : nullptr,
                mutable_data_of<T>(y), rows, D, static_cast<float>(eps));
  });
  return y;
}

at::Tensor qk_norm_rope(const at::Tensor& qkv, int64_t heads, const at::Tensor& scale, const at::Tensor& cos,
                        const at::Tensor& sin, double eps) {
  check_float_or_bf16(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2, "qkv must be (tokens, width)");
  const int64_t T = qkv.size(0), W = qkv.size(1);
  TORCH_CHECK(heads > 0 && scale.dim() == 2 && scale.size(0) == heads, "scale must be (heads, D)");
  const int64_t D = scale.size(1);
  TORCH_CHECK(D % 2 == 0 && heads * D <= W, "heads of an even size D must fit in a row of qkv");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous(), "scale must be contiguous float32");
  check_scale(cos, T * D, "cos");
  check_scale(sin, T * D, "sin");
  auto y = at::empty({T, heads, D}, qkv.options());
  with_float_type(qkv.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    qk_rows<T_>(data_of<T_>(qkv), W, scale.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                mutable_data_of<T_>(y), T, heads, D, static_cast<float>(eps));
  });
  return y;
}

}  // namespace swa
