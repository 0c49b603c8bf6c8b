// Every decoder layer of a decode step in one call (decode_stack.cpp).

#pragma once

#include <vector>

#include "quant.h"

namespace swa {

// What one layer's math takes that does not change from step to step: its four projections' low-bit copies, its
// six norms' float32 multipliers (input, post-attention, pre-MLP, post-MLP; q/k as one (heads + kv_heads, D)
// table), its shape, and which rotary table it turns with.
// `watched`: the tensors the multipliers were made from (the norms' weights), each at the version in `versions`.
struct StackLayer {
  Projection qkv, o, gate_up, down;
  at::Tensor input_scale, post_attn_scale, pre_ff_scale, post_ff_scale, qk_scale;
  int64_t heads, kv_heads, rope;
  double eps, scaling, softcap;
  std::vector<at::Tensor> watched;
  std::vector<int64_t> versions;
};

// The model's parts on either side of its layers: the token table (V, hidden) in the rows' dtype and the float32
// multiplier of its rows (rounded to that dtype first, as the torch path multiplies), the final norm's float32
// multiplier and eps. `watched`, `versions`: as a layer's (the table, the multiplier, the final norm's weight).
struct StackEnds {
  at::Tensor embed, embed_scale, final_scale;
  double eps;
  std::vector<at::Tensor> watched;
  std::vector<int64_t> versions;
};

// The layers of one model, in order, between its ends. `run` takes what changes per step: the tokens and their
// positions, the rotary tables (cos, sin per table: (P, 1, D) float32, a row per position), and per layer the KV
// buffers, the slots its new k/v go to (already translated: the runtime's lookups and sanitizer checks ran
// before) and the keys its query attends over (int32 indices and indptr). It returns the final norm's rows.
class DecodeStack {
 public:
  DecodeStack(std::vector<StackLayer> layers, StackEnds ends);
  at::Tensor run(const at::Tensor& ids, const at::Tensor& positions, const std::vector<at::Tensor>& cos,
                 const std::vector<at::Tensor>& sin, std::vector<at::Tensor> k_bufs, std::vector<at::Tensor> v_bufs,
                 const std::vector<at::Tensor>& locs, const std::vector<at::Tensor>& indices,
                 const std::vector<at::Tensor>& indptrs) const;
  int64_t size() const { return static_cast<int64_t>(layers_.size()); }
  // Whether every watched tensor is still at its version, data and dtype: an in-place write (`load_state_dict`,
  // an edit) or swapped data makes the multipliers stale. Checked here, without the interpreter: a step's first
  // Python runs with caches the weights swept, where 108 version reads from Python cost ~0.2 ms.
  bool current() const;

 private:
  struct Watched {
    at::Tensor tensor;
    int64_t version;
    const void* data;
    at::ScalarType dtype;
  };
  std::vector<StackLayer> layers_;
  StackEnds ends_;
  std::vector<Watched> watched_;  // every layer's and the ends', as they were at construction
};

}  // namespace swa
