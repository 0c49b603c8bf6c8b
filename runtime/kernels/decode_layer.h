// A decoder layer's math around its attention call at decode sizes, in one call each side (decode_layer.cpp).

#pragma once

#include <vector>

#include "quant.h"

namespace swa {

// h (T, hidden) -> q (T, heads, D), k (T, kv_heads, D) normed and rotated, v (T, kv_heads, D): input norm, the
// qkv projection, the q/k norm and rotation.
std::vector<at::Tensor> layer_pre(const at::Tensor& h, const at::Tensor& norm_scale, const Projection& qkv,
                                  const at::Tensor& qk_scale, int64_t heads, int64_t kv_heads, const at::Tensor& cos,
                                  const at::Tensor& sin, double eps);

// h (T, hidden), attn (T, heads * D) -> the layer's output: o projection, its norm added to h, the MLP between
// its two norms, added again.
at::Tensor layer_post(const at::Tensor& h, const at::Tensor& attn, const Projection& o, const at::Tensor& post_attn_scale,
                      const at::Tensor& pre_ff_scale, const Projection& gate_up, const Projection& down,
                      const at::Tensor& post_ff_scale, double eps);

// The same two halves on rows in memory the caller holds, unchecked (the decode stack reuses its buffers:
// a tensor made, viewed or checked costs about a microsecond, a few dozen of them a layer). `layer_pre`'s:
// projected (T, (heads + 2 kv_heads) D), qk (T, heads + kv_heads, D) its normed and rotated q and k; v stays in
// projected. `layer_post`'s: out (T, hidden).
template <typename F>
void pre_rows(const F* h, int64_t T, int64_t hidden, const float* norm_scale, const Projection& qkv,
              const float* qk_scale, int64_t heads, int64_t kv_heads, int64_t D, const float* cos, const float* sin,
              float eps, F* projected, F* qk);
template <typename F>
void post_rows(const F* h, const F* attn, int64_t T, int64_t hidden, const Projection& o, const float* post_attn_scale,
               const float* pre_ff_scale, const Projection& gate_up, const Projection& down,
               const float* post_ff_scale, float eps, F* out);

}  // namespace swa
