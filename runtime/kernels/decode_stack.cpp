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
#include "norms.h"

namespace swa {

DecodeStack::DecodeStack(std::vector<StackLayer> layers, StackEnds ends)
    : layers_(std::move(layers)), ends_(std::move(ends)) {
  TORCH_CHECK(!layers_.empty(), "a stack of no layers");
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
    for (size_t j = 0; j < l.watched.size(); ++j)
      watched_.push_back({l.watched[j], l.versions[j], l.watched[j].data_ptr(), l.watched[j].scalar_type()});
  }
  const int64_t hidden = layers_[0].qkv.in_features();
  TORCH_CHECK(ends_.embed.dim() == 2 && ends_.embed.size(1) == hidden && ends_.embed.is_contiguous() &&
                  ends_.embed.device().is_cpu(),
              "the token table must be contiguous (V, ", hidden, ") on the CPU");
  check_scale(ends_.embed_scale, 1, "embed_scale");
  check_scale(ends_.final_scale, hidden, "the final norm's scale");
  TORCH_CHECK(ends_.watched.size() == ends_.versions.size(), "a version per watched tensor");
  for (size_t j = 0; j < ends_.watched.size(); ++j)
    watched_.push_back({ends_.watched[j], ends_.versions[j], ends_.watched[j].data_ptr(), ends_.watched[j].scalar_type()});
}

bool DecodeStack::current() const {
  for (const Watched& w : watched_) {
    if (w.tensor._version() != w.version || w.tensor.data_ptr() != w.data || w.tensor.scalar_type() != w.dtype)
      return false;
  }
  return true;
}

at::Tensor DecodeStack::run(const at::Tensor& ids, const at::Tensor& positions, const std::vector<at::Tensor>& cos,
                            const std::vector<at::Tensor>& sin, std::vector<at::Tensor> k_bufs,
                            std::vector<at::Tensor> v_bufs, const std::vector<at::Tensor>& locs,
                            const std::vector<at::Tensor>& indices, const std::vector<at::Tensor>& indptrs) const {
  const size_t n = layers_.size();
  TORCH_CHECK(k_bufs.size() == n && v_bufs.size() == n && locs.size() == n && indices.size() == n &&
                  indptrs.size() == n,
              "one KV buffer pair, write location and key list per layer (", n, " layers)");
  TORCH_CHECK(cos.size() == sin.size(), "a cos and a sin per rotary table");
  for (const auto* t : {&ids, &positions}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) >= 1 &&
                    t->is_contiguous() && t->size(0) == ids.size(0),
                "ids and positions must be (T,) int64 on the CPU, T >= 1");
  }
  const at::Tensor& table = ends_.embed;
  check_float_or_bf16(table, "the token table");
  const int64_t T = ids.size(0), hidden = table.size(1), V = table.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK_INDEX(id[t] >= 0 && id[t] < V, "token id ", id[t], " outside the table of ", V);
  // Everything each layer reads, checked before any layer runs: the loop below takes raw rows.
  for (size_t r = 0; r < cos.size(); ++r) {
    for (const auto* a : {&cos[r], &sin[r]}) {
      TORCH_CHECK(a->scalar_type() == at::kFloat && a->is_contiguous() && a->dim() >= 2 && a->sizes() == cos[r].sizes(),
                  "rotary table ", r, ": cos and sin must be contiguous float32 alike, a row per position");
    }
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK_INDEX(pos[t] >= 0 && pos[t] < cos[r].size(0), "position ", pos[t], " outside rotary table ", r);
  }
  for (size_t i = 0; i < n; ++i) {
    const StackLayer& l = layers_[i];
    TORCH_CHECK(l.rope < static_cast<int64_t>(cos.size()), "layer ", i, " turns with rotary table ", l.rope, " of ",
                cos.size());
    const int64_t D = l.qk_scale.size(1);
    TORCH_CHECK(cos[l.rope].numel() == cos[l.rope].size(0) * D, "rotary table ", l.rope, " rows must hold ", D,
                " values");
    const at::Tensor &kb = k_bufs[i], &vb = v_bufs[i];
    TORCH_CHECK(kb.scalar_type() == table.scalar_type() && vb.scalar_type() == table.scalar_type(), "layer ", i,
                "'s KV buffers must hold the rows' dtype");
    TORCH_CHECK(kb.dim() == 3 && kb.is_contiguous() && vb.is_contiguous() && vb.sizes() == kb.sizes() &&
                    kb.size(1) == l.kv_heads && kb.size(2) == D,
                "layer ", i, "'s KV buffers must be contiguous (S, kv_heads, D) alike");
    const at::Tensor& loc = locs[i];
    TORCH_CHECK((loc.scalar_type() == at::kLong || loc.scalar_type() == at::kInt) && loc.dim() == 1 &&
                    loc.size(0) == T && loc.is_contiguous(),
                "layer ", i, "'s write locations must be (T,) int64 or int32");
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = slot_at(loc, t);
      TORCH_CHECK(slot >= 0 && slot < kb.size(0), "slot ", slot, " outside the pool of ", kb.size(0));
    }
    TORCH_CHECK(indices[i].scalar_type() == at::kInt && indices[i].is_contiguous() &&
                    indptrs[i].scalar_type() == at::kInt && indptrs[i].is_contiguous() && indptrs[i].numel() == T + 1,
                "layer ", i, "'s keys: indices and indptr contiguous int32, indptr (T + 1,)");
    const int32_t* ip = indptrs[i].data_ptr<int32_t>();
    TORCH_CHECK(ip[0] == 0 && ip[T] <= indices[i].numel(), "layer ", i, "'s indptr does not fit its indices");
    for (int64_t b = 0; b < T; ++b) TORCH_CHECK(ip[b + 1] >= ip[b], "indptr must not decrease");
  }
  // Each table's rows at the tokens' positions: (cos, sin) per table, (T, D) each.
  thread_local std::vector<float> angles;
  std::vector<int64_t> at_table(cos.size() + 1, 0);
  for (size_t r = 0; r < cos.size(); ++r) at_table[r + 1] = at_table[r] + 2 * T * (cos[r].numel() / cos[r].size(0));
  angles.resize(at_table.back());
  for (size_t r = 0; r < cos.size(); ++r) {
    const int64_t D = cos[r].numel() / cos[r].size(0);
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(angles.data() + at_table[r] + t * D, cos[r].data_ptr<float>() + pos[t] * D, D * sizeof(float));
      std::memcpy(angles.data() + at_table[r] + (T + t) * D, sin[r].data_ptr<float>() + pos[t] * D, D * sizeof(float));
    }
  }
  auto out = at::empty({T, hidden}, table.options());
  with_float_type(table.scalar_type(), [&](auto tag) {
    using F = decltype(tag);
    F* x = scratch<F, 15>(T * hidden);  // the tokens' rows, times the multiplier rounded as the torch path rounds it
    const float scale = as_stored<F>(ends_.embed_scale.data_ptr<float>()[0]);
    for (int64_t t = 0; t < T; ++t) {
      const F* row = data_of<F>(table) + id[t] * hidden;
      for (int64_t d = 0; d < hidden; ++d) store(x, t * hidden + d, load(row, d) * scale);
    }
    for (size_t i = 0; i < n; ++i) {
      const StackLayer& l = layers_[i];
      const int64_t H = l.heads, KV = l.kv_heads, D = l.qk_scale.size(1), width = l.qkv.out_features();
      F* kb = mutable_data_of<F>(k_bufs[i]);
      F* vb = mutable_data_of<F>(v_bufs[i]);
      for (int64_t t = 0; t < T; ++t) {  // the rows this layer writes, fetched for writing while it projects
        const int64_t slot = slot_at(locs[i], t);
        for (int64_t b = 0; b < KV * D * static_cast<int64_t>(sizeof(F)); b += 64) {
          __builtin_prefetch(reinterpret_cast<char*>(kb + slot * KV * D) + b, 1, 3);
          __builtin_prefetch(reinterpret_cast<char*>(vb + slot * KV * D) + b, 1, 3);
        }
      }
      F* projected = scratch<F, 10>(T * width);
      F* qk = scratch<F, 11>(T * (H + KV) * D);
      const float* turn = angles.data() + at_table[l.rope];
      pre_rows<F>(x, T, hidden, l.input_scale.data_ptr<float>(), l.qkv, l.qk_scale.data_ptr<float>(), H, KV, D,
                  turn, turn + T * D, static_cast<float>(l.eps), projected, qk);
      for (int64_t t = 0; t < T; ++t) {  // a token attends to itself: its k and v written first
        const int64_t slot = slot_at(locs[i], t);
        std::memcpy(kb + slot * KV * D, qk + (t * (H + KV) + H) * D, KV * D * sizeof(F));
        std::memcpy(vb + slot * KV * D, projected + t * width + (H + KV) * D, KV * D * sizeof(F));
      }
      F* attn = scratch<F, 12>(T * H * D);
      decode_attention_rows<F>(qk, (H + KV) * D, kb, vb, indices[i].data_ptr<int32_t>(),
                               indptrs[i].data_ptr<int32_t>(), attn, T, H, KV, D, k_bufs[i].size(0),
                               static_cast<float>(l.scaling), static_cast<float>(l.softcap));
      F* next = x == scratch<F, 13>(T * hidden) ? scratch<F, 14>(T * hidden) : scratch<F, 13>(T * hidden);
      post_rows<F>(x, attn, T, hidden, l.o, l.post_attn_scale.data_ptr<float>(), l.pre_ff_scale.data_ptr<float>(),
                   l.gate_up, l.down, l.post_ff_scale.data_ptr<float>(), static_cast<float>(l.eps), next);
      x = next;
    }
    rms_rows<F>(x, ends_.final_scale.data_ptr<float>(), 1, nullptr, mutable_data_of<F>(out), T, hidden,
                static_cast<float>(ends_.eps));
  });
  return out;
}

}  // namespace swa
