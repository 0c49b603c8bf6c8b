// A Gemma 3 decoder layer's math around its attention call, for decode's few rows, in two calls.
//
// At one row a layer's work besides the weights is a dozen small steps (norms, the q/k norm and rotation, the
// gate's GELU, residual adds), each a few microseconds of arithmetic; as torch operations and Python calls they
// cost more than the weights' own time between them. `layer_pre` and `layer_post` run them back to back in one
// call each, with the projections on the low-bit kernels (quant.cpp), rounding where the torch path rounds, so
// they give its values up to the order of float32 sums. The attention call between them, which writes the KV
// pool through the location translation, stays with the runtime.

#include "decode_layer.h"

#include <vector>

#include "activation.h"
#include "norms.h"

namespace swa {

namespace {

void check_rows(const at::Tensor& x, const char* what) {
  check_float_or_bf16(x, what);
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1, what, " must be (T, width) with T >= 1");
}

// y (rows, N) in T = p(x) for x (rows, K) in T: streamed up to kMaxRows rows, in tiles beyond, as
// `Projection::matmul` chooses (a batch of decode rows past eight gives the per-operation path's values).
template <typename T>
void project(const Projection& p, const T* x, int64_t rows, T* y) {
  thread_local QuantizedRows xq;
  xq.quantize(x, rows, p.in_features());
  if (rows <= kMaxRows) {
    p.run(xq, y);
  } else {
    p.run_tiled(xq, y);
  }
}

}  // namespace

std::vector<at::Tensor> layer_pre(const at::Tensor& h, const at::Tensor& norm_scale, const Projection& qkv,
                                  const at::Tensor& qk_scale, int64_t heads, int64_t kv_heads, const at::Tensor& cos,
                                  const at::Tensor& sin, double eps) {
  check_rows(h, "h");
  const int64_t T = h.size(0), hidden = h.size(1);
  TORCH_CHECK(qkv.in_features() == hidden, "qkv takes ", qkv.in_features(), " values, h has ", hidden);
  check_scale(norm_scale, hidden, "norm_scale");
  TORCH_CHECK(qk_scale.dim() == 2 && qk_scale.size(0) == heads + kv_heads, "qk_scale must be (heads + kv_heads, D)");
  const int64_t D = qk_scale.size(1), width = qkv.out_features();
  TORCH_CHECK(width == (heads + 2 * kv_heads) * D, "qkv gives ", width, " values, not (heads + 2 kv_heads) * D");
  check_scale(qk_scale, (heads + kv_heads) * D, "qk_scale");
  check_scale(cos, T * D, "cos");
  check_scale(sin, T * D, "sin");
  auto projected = at::empty({T, width}, h.options());
  auto qk = at::empty({T, heads + kv_heads, D}, h.options());
  with_float_type(h.scalar_type(), [&](auto tag) {
    using F = decltype(tag);
    std::vector<F> x(T * hidden);
    rms_rows<F>(data_of<F>(h), norm_scale.data_ptr<float>(), 1, nullptr, x.data(), T, hidden, static_cast<float>(eps));
    project<F>(qkv, x.data(), T, mutable_data_of<F>(projected));
    qk_rows<F>(data_of<F>(projected), width, qk_scale.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
               mutable_data_of<F>(qk), T, heads + kv_heads, D, static_cast<float>(eps));
  });
  return {qk.narrow(1, 0, heads), qk.narrow(1, heads, kv_heads),
          projected.narrow(1, (heads + kv_heads) * D, kv_heads * D).view({T, kv_heads, D})};
}

at::Tensor layer_post(const at::Tensor& h, const at::Tensor& attn, const Projection& o, const at::Tensor& post_attn_scale,
                      const at::Tensor& pre_ff_scale, const Projection& gate_up, const Projection& down,
                      const at::Tensor& post_ff_scale, double eps) {
  check_rows(h, "h");
  check_rows(attn, "attn");
  const int64_t T = h.size(0), hidden = h.size(1), I = down.in_features();
  TORCH_CHECK(attn.size(0) == T && attn.scalar_type() == h.scalar_type(), "attn must have h's rows and dtype");
  TORCH_CHECK(o.in_features() == attn.size(1) && o.out_features() == hidden && gate_up.in_features() == hidden &&
                  gate_up.out_features() == 2 * I && down.out_features() == hidden,
              "the projections' shapes do not chain: o ", o.in_features(), "->", o.out_features(), ", gate_up ",
              gate_up.in_features(), "->", gate_up.out_features(), ", down ", I, "->", down.out_features());
  for (const auto* s : {&post_attn_scale, &pre_ff_scale, &post_ff_scale}) check_scale(*s, hidden, "a norm scale");
  auto mid = at::empty({T, hidden}, h.options());
  auto out = at::empty({T, hidden}, h.options());
  with_float_type(h.scalar_type(), [&](auto tag) {
    using F = decltype(tag);
    const float e = static_cast<float>(eps);
    std::vector<F> y(T * hidden), x(T * hidden), gu(T * 2 * I), a(T * I);
    project<F>(o, data_of<F>(attn), T, y.data());
    F* h1 = mutable_data_of<F>(mid);
    rms_rows<F>(y.data(), post_attn_scale.data_ptr<float>(), 1, data_of<F>(h), h1, T, hidden, e);  // h + norm(o)
    rms_rows<F>(h1, pre_ff_scale.data_ptr<float>(), 1, nullptr, x.data(), T, hidden, e);
    project<F>(gate_up, x.data(), T, gu.data());
    gelu_and_mul_rows<F>(gu.data(), a.data(), T, I);
    project<F>(down, a.data(), T, y.data());
    rms_rows<F>(y.data(), post_ff_scale.data_ptr<float>(), 1, h1, mutable_data_of<F>(out), T, hidden, e);
  });
  return out;
}

}  // namespace swa
