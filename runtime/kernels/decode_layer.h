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

}  // namespace swa
