// A decode step's decoder layers in one call: per layer `layer_pre`, the KV write, decode attention and
// `layer_post`, back to back in C++.
//
// Called one by one from Python, the four calls of a layer left about 55 us of interpreter time a layer between
// them in a real step (the weights streamed by the kernels sweep the caches the interpreter's frames live in):
// a millisecond of an eight-millisecond step for 18 layers. Here the same kernels run in the same order on the
// same arguments, so the values are those of the per-layer path bit for bit. What the runtime does around a
// layer's attention (the location translation, the KV sanitizer's write and read checks) it does before this
// call, layer by layer in the same order, and hands in its results: the slots and the keys.

#include "decode_stack.h"

#include "attention.h"
#include "decode_layer.h"

namespace swa {

DecodeStack::DecodeStack(std::vector<StackLayer> layers) : layers_(std::move(layers)) {
  for (const auto& l : layers_) {
    TORCH_CHECK(l.heads > 0 && l.kv_heads > 0 && l.heads % l.kv_heads == 0, "heads must be a multiple of kv_heads");
    TORCH_CHECK(l.rope >= 0, "a layer's rotary table index must not be negative");
    TORCH_CHECK(l.watched.size() == l.versions.size(), "a version per watched tensor");
    std::vector<Seen> seen;
    for (const auto& t : l.watched) seen.push_back({t.data_ptr(), t.scalar_type()});
    seen_.push_back(std::move(seen));
  }
}

bool DecodeStack::current() const {
  for (size_t i = 0; i < layers_.size(); ++i) {
    const StackLayer& l = layers_[i];
    for (size_t j = 0; j < l.watched.size(); ++j) {
      const at::Tensor& t = l.watched[j];
      if (t._version() != l.versions[j] || t.data_ptr() != seen_[i][j].data ||
          t.scalar_type() != seen_[i][j].dtype)
        return false;
    }
  }
  return true;
}

at::Tensor DecodeStack::run(const at::Tensor& h, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                            std::vector<at::Tensor> k_bufs, std::vector<at::Tensor> v_bufs,
                            const std::vector<at::Tensor>& locs, const std::vector<at::Tensor>& indices,
                            const std::vector<at::Tensor>& indptrs) const {
  const size_t n = layers_.size();
  TORCH_CHECK(k_bufs.size() == n && v_bufs.size() == n && locs.size() == n && indices.size() == n &&
                  indptrs.size() == n,
              "one KV buffer pair, write location and key list per layer (", n, " layers)");
  TORCH_CHECK(cos.size() == sin.size(), "a cos and a sin per rotary table");
  at::Tensor x = h;
  for (size_t i = 0; i < n; ++i) {
    const StackLayer& l = layers_[i];
    TORCH_CHECK(l.rope < static_cast<int64_t>(cos.size()), "layer ", i, " turns with rotary table ", l.rope, " of ",
                cos.size());
    TORCH_CHECK(k_bufs[i].scalar_type() == x.scalar_type(), "layer ", i, "'s KV buffers must hold the rows' dtype");
    auto qkv = layer_pre(x, l.input_scale, l.qkv, l.qk_scale, l.heads, l.kv_heads, cos[l.rope], sin[l.rope], l.eps);
    write_kv(k_bufs[i], v_bufs[i], locs[i], qkv[1], qkv[2]);  // a token attends to itself: written first
    auto attn = decode_attention(qkv[0].contiguous(), k_bufs[i], v_bufs[i], indices[i], indptrs[i], l.scaling, l.softcap);
    x = layer_post(x, attn.reshape({x.size(0), -1}).contiguous(), l.o, l.post_attn_scale, l.pre_ff_scale, l.gate_up,
                   l.down, l.post_ff_scale, l.eps);
  }
  return x;
}

}  // namespace swa
