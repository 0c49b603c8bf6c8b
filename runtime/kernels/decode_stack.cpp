// A decode step's decoder layers in one call: per layer `layer_pre`, the KV write, decode attention and
// `layer_post`, back to back in C++.
//
// Called one by one from Python, the four calls of a layer left about 55 us of interpreter time a layer between
// them in a real step (the weights streamed by the kernels sweep the caches the interpreter's frames live in):
// a millisecond of an eight-millisecond step for 18 layers. Here the same kernels run in the same order on the
// same arguments, so the values are those of the per-layer path bit for bit. What the runtime does around a
// layer's attention (the location translation, the KV sanitizer's write and read checks) it does before this
// call, layer by layer in the same order, and hands in its results: the slots and the keys.
//
// The layers' arguments are checked once, before the first layer; then the rows go from layer to layer in the
// stack's own buffers (`pre_rows`, `post_rows`, `decode_attention_rows`), not in tensors made, viewed and checked
// again per call (about 0.1 ms of a batch-1 step), and each layer's KV rows are fetched for writing before it
// projects (their write missed the caches: ~2 us a layer).

#include "decode_stack.h"

#include "attention.h"
#include "decode_layer.h"

namespace swa {

DecodeStack::DecodeStack(std::vector<StackLayer> layers) : layers_(std::move(layers)) {
  for (const auto& l : layers_) {
    TORCH_CHECK(l.heads > 0 && l.kv_heads > 0 && l.heads % l.kv_heads == 0, "heads must be a multiple of kv_heads");
    TORCH_CHECK(l.qk_scale.dim() == 2 && l.qk_scale.size(0) == l.heads + l.kv_heads,
                "qk_scale must be (heads + kv_heads, D)");
    const int64_t D = l.qk_scale.size(1), hidden = l.qkv.in_features(), I = l.down.in_features();
    check_scale(l.qk_scale, (l.heads + l.kv_heads) * D, "qk_scale");
    TORCH_CHECK(l.qkv.out_features() == (l.heads + 2 * l.kv_heads) * D && l.o.in_features() == l.heads * D &&
                    l.o.out_features() == hidden && l.gate_up.in_features() == hidden &&
                    l.gate_up.out_features() == 2 * I && l.down.out_features() == hidden &&
                    hidden == layers_[0].qkv.in_features(),
                "a layer's projections do not chain: qkv ", l.qkv.in_features(), "->", l.qkv.out_features(), ", o ",
                l.o.in_features(), "->", l.o.out_features(), ", gate_up ", l.gate_up.in_features(), "->",
                l.gate_up.out_features(), ", down ", I, "->", l.down.out_features());
    for (const auto* s : {&l.input_scale, &l.post_attn_scale, &l.pre_ff_scale, &l.post_ff_scale})
      check_scale(*s, hidden, "a norm scale");
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

namespace {

// The stack's rows between calls, kept per thread and grown as needed (`kSlot`: one buffer each).
template <typename F, int kSlot>
F* rows(int64_t n) {
  thread_local std::vector<F> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

int64_t slot_of(const at::Tensor& loc, int64_t t) {
  return loc.scalar_type() == at::kLong ? loc.data_ptr<int64_t>()[t] : loc.data_ptr<int32_t>()[t];
}

}  // namespace

at::Tensor DecodeStack::run(const at::Tensor& h, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                            std::vector<at::Tensor> k_bufs, std::vector<at::Tensor> v_bufs,
                            const std::vector<at::Tensor>& locs, const std::vector<at::Tensor>& indices,
                            const std::vector<at::Tensor>& indptrs) const {
  const size_t n = layers_.size();
  TORCH_CHECK(n > 0, "a stack of no layers");
  TORCH_CHECK(k_bufs.size() == n && v_bufs.size() == n && locs.size() == n && indices.size() == n &&
                  indptrs.size() == n,
              "one KV buffer pair, write location and key list per layer (", n, " layers)");
  TORCH_CHECK(cos.size() == sin.size(), "a cos and a sin per rotary table");
  check_float_or_bf16(h, "h");
  TORCH_CHECK(h.dim() == 2 && h.size(0) >= 1 && h.is_contiguous(), "h must be contiguous (T, hidden) with T >= 1");
  const int64_t T = h.size(0), hidden = h.size(1);
  TORCH_CHECK(layers_[0].qkv.in_features() == hidden, "the layers take ", layers_[0].qkv.in_features(),
              " values a row, h has ", hidden);
  // Everything each layer reads, checked before any layer runs: the loop below takes raw rows.
  for (size_t i = 0; i < n; ++i) {
    const StackLayer& l = layers_[i];
    TORCH_CHECK(l.rope < static_cast<int64_t>(cos.size()), "layer ", i, " turns with rotary table ", l.rope, " of ",
                cos.size());
    const int64_t D = l.qk_scale.size(1);
    check_scale(cos[l.rope], T * D, "cos");
    check_scale(sin[l.rope], T * D, "sin");
    const at::Tensor &kb = k_bufs[i], &vb = v_bufs[i];
    TORCH_CHECK(kb.scalar_type() == h.scalar_type() && vb.scalar_type() == h.scalar_type(), "layer ", i,
                "'s KV buffers must hold the rows' dtype");
    TORCH_CHECK(kb.dim() == 3 && kb.is_contiguous() && vb.is_contiguous() && vb.sizes() == kb.sizes() &&
                    kb.size(1) == l.kv_heads && kb.size(2) == D,
                "layer ", i, "'s KV buffers must be contiguous (S, kv_heads, D) alike");
    const at::Tensor& loc = locs[i];
    TORCH_CHECK((loc.scalar_type() == at::kLong || loc.scalar_type() == at::kInt) && loc.dim() == 1 &&
                    loc.size(0) == T && loc.is_contiguous(),
                "layer ", i, "'s write locations must be (T,) int64 or int32");
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = slot_of(loc, t);
      TORCH_CHECK(slot >= 0 && slot < kb.size(0), "slot ", slot, " outside the pool of ", kb.size(0));
    }
    TORCH_CHECK(indices[i].scalar_type() == at::kInt && indices[i].is_contiguous() &&
                    indptrs[i].scalar_type() == at::kInt && indptrs[i].is_contiguous() && indptrs[i].numel() == T + 1,
                "layer ", i, "'s keys: indices and indptr contiguous int32, indptr (T + 1,)");
    const int32_t* ip = indptrs[i].data_ptr<int32_t>();
    TORCH_CHECK(ip[0] == 0 && ip[T] <= indices[i].numel(), "layer ", i, "'s indptr does not fit its indices");
    for (int64_t b = 0; b < T; ++b) TORCH_CHECK(ip[b + 1] >= ip[b], "indptr must not decrease");
  }
  auto out = at::empty_like(h);
  with_float_type(h.scalar_type(), [&](auto tag) {
    using F = decltype(tag);
    const F* x = data_of<F>(h);
    for (size_t i = 0; i < n; ++i) {
      const StackLayer& l = layers_[i];
      const int64_t H = l.heads, KV = l.kv_heads, D = l.qk_scale.size(1), width = l.qkv.out_features();
      F* kb = mutable_data_of<F>(k_bufs[i]);
      F* vb = mutable_data_of<F>(v_bufs[i]);
      for (int64_t t = 0; t < T; ++t) {  // the rows this layer writes, fetched for writing while it projects
        const int64_t slot = slot_of(locs[i], t);
        for (int64_t b = 0; b < KV * D * static_cast<int64_t>(sizeof(F)); b += 64) {
          __builtin_prefetch(reinterpret_cast<char*>(kb + slot * KV * D) + b, 1, 3);
          __builtin_prefetch(reinterpret_cast<char*>(vb + slot * KV * D) + b, 1, 3);
        }
      }
      F* projected = rows<F, 0>(T * width);
      F* qk = rows<F, 1>(T * (H + KV) * D);
      pre_rows<F>(x, T, hidden, l.input_scale.data_ptr<float>(), l.qkv, l.qk_scale.data_ptr<float>(), H, KV, D,
                  cos[l.rope].data_ptr<float>(), sin[l.rope].data_ptr<float>(), static_cast<float>(l.eps), projected,
                  qk);
      for (int64_t t = 0; t < T; ++t) {  // a token attends to itself: its k and v written first
        const int64_t slot = slot_of(locs[i], t);
        std::memcpy(kb + slot * KV * D, qk + (t * (H + KV) + H) * D, KV * D * sizeof(F));
        std::memcpy(vb + slot * KV * D, projected + t * width + (H + KV) * D, KV * D * sizeof(F));
      }
      F* attn = rows<F, 2>(T * H * D);
      decode_attention_rows<F>(qk, (H + KV) * D, kb, vb, indices[i].data_ptr<int32_t>(),
                               indptrs[i].data_ptr<int32_t>(), attn, T, H, KV, D, k_bufs[i].size(0),
                               static_cast<float>(l.scaling), static_cast<float>(l.softcap));
      F* next = i + 1 == n ? mutable_data_of<F>(out) : (x == rows<F, 3>(T * hidden) ? rows<F, 4>(T * hidden)
                                                                                     : rows<F, 3>(T * hidden));
      post_rows<F>(x, attn, T, hidden, l.o, l.post_attn_scale.data_ptr<float>(), l.pre_ff_scale.data_ptr<float>(),
                   l.gate_up, l.down, l.post_ff_scale.data_ptr<float>(), static_cast<float>(l.eps), next);
      x = next;
    }
  });
  return out;
}

}  // namespace swa
