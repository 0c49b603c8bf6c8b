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

// y (rows, N) in T = p(x) for x (rows, K) in T, as `Projection::matmul` computes it (a batch of decode rows past
// eight gives the per-operation path's values).
template <typename T>
void project(const Projection& p, const T* x, int64_t rows, T* y) {
  thread_local QuantizedRows xq;
  p.apply(x, rows, y, xq);
}

}  // namespace

template <typename F>
void pre_rows(const F* h, int64_t T, int64_t hidden, const float* norm_scale, const Projection& qkv,
              const float* qk_scale, int64_t heads, int64_t kv_heads, int64_t D, const float* cos, const float* sin,
              float eps, F* projected, F* qk) {
  F* x = scratch<F, 0>(T * hidden);
  rms_rows<F>(h, norm_scale, 1, nullptr, x, T, hidden, eps);
  project<F>(qkv, x, T, projected);
  qk_rows<F>(projected, qkv.out_features(), qk_scale, cos, sin, qk, T, heads + kv_heads, D, eps);
}

template <typename F>
void post_rows(const F* h, const F* attn, int64_t T, int64_t hidden, const Projection& o, const float* post_attn_scale,
               const float* pre_ff_scale, const Projection& gate_up, const Projection& down,
               const float* post_ff_scale, float eps, F* out) {
  const int64_t I = down.in_features();
  F* mid = scratch<F, 5>(T * hidden);  // h + norm(o)
  F* y = scratch<F, 1>(T * hidden);
  F* x = scratch<F, 2>(T * hidden);
  F* gu = scratch<F, 3>(T * 2 * I);
  F* a = scratch<F, 4>(T * I);
  project<F>(o, attn, T, y);
  rms_rows<F>(y, post_attn_scale, 1, h, mid, T, hidden, eps);
  rms_rows<F>(mid, pre_ff_scale, 1, nullptr, x, T, hidden, eps);
  project<F>(gate_up, x, T, gu);
  gelu_and_mul_rows<F>(gu, a, T, I);
  project<F>(down, a, T, y);
  rms_rows<F>(y, post_ff_scale, 1, mid, out, T, hidden, eps);
}

template void pre_rows<float>(const float*, int64_t, int64_t, const float*, const Projection&, const float*, int64_t,
                              int64_t, int64_t, const float*, const float*, float, float*, float*);
template void pre_rows<bf16>(const bf16*, int64_t, int64_t, const float*, const Projection&, const float*, int64_t,
                             int64_t, int64_t, const float*, const float*, float, bf16*, bf16*);
template void post_rows<float>(const float*, const float*, int64_t, int64_t, const Projection&, const float*,
                               const float*, const Projection&, const Projection&, const float*, float, float*);
template void post_rows<bf16>(const bf16*, const bf16*, int64_t, int64_t, const Projection&, const float*, const float*,
                              const Projection&, const Projection&, const float*, float, bf16*);

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
    pre_rows<F>(data_of<F>(h), T, hidden, norm_scale.data_ptr<float>(), qkv, qk_scale.data_ptr<float>(), heads,
                kv_heads, D, cos.data_ptr<float>(), sin.data_ptr<float>(), static_cast<float>(eps),
                mutable_data_of<F>(projected), mutable_data_of<F>(qk));
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
  auto out = at::empty({T, hidden}, h.options());
  with_float_type(h.scalar_type(), [&](auto tag) {
    using F = decltype(tag);
    post_rows<F>(data_of<F>(h), data_of<F>(attn), T, hidden, o, post_attn_scale.data_ptr<float>(),
                 pre_ff_scale.data_ptr<float>(), gate_up, down, post_ff_scale.data_ptr<float>(), static_cast<float>(eps),
                 mutable_data_of<F>(out));
  });
  return out;
}

}  // namespace swa
