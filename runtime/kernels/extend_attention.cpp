// Extend (prefill) attention: each new token over exactly the keys it sees, read in place from the KV pool: ragged
// requests, causal and windowed; nothing masked, padded or gathered.

#include "attention.h"
#include "attention_chunk.h"

namespace swa {

using namespace attention;

namespace {

// The i-th of n items taken first, last, second, second to last...: causal rows grow with the position, and
// ATen hands each thread a contiguous range, so in order the last thread would get the longest rows (a 600-token
// prompt: three quarters of the work on one of two threads). Zigzagged, a 600-token prompt's attention on a 2-core
// Zen 4 EPYC took 49-52 ms against 66-70 (18 layers, bfloat16).
inline int64_t zigzag(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

// One query row per (token, kv head), its keys the range it sees: at and before its position, within the window
// on sliding layers. The same chunk routine as decode, whole (no split: the rows are already many).
template <typename T>
void attend_extend(const T* q, const T* kb, const T* vb, const int32_t* idx, const int32_t* kptr, const int32_t* kstart,
                   const int32_t* qptr, const int32_t* qpos, int64_t B, int64_t window, T* out, const Shape& s) {
  const int64_t G = s.G, D = s.D, H = s.H, Hkv = s.Hkv, tokens = qptr[B];
  std::vector<int32_t> request(tokens);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = qptr[b]; t < qptr[b + 1]; ++t) request[t] = static_cast<int32_t>(b);
  const auto routine = chunk_routine<T>(s);
  const float pre = s.softcap > 0.f ? 1.f : s.scaling;
  const int64_t items = tokens * Hkv;
  at::parallel_for(0, items, 4, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(G * D), acc(G * D), mx(G), l(G), p;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t it = zigzag(i, items);
      const int64_t t = it / Hkv, kh = it % Hkv, b = request[t];
      const int64_t n = kptr[b + 1] - kptr[b], last = qpos[t] - kstart[b];  // the query's own key
      const int64_t hi = std::min(n, last + 1), lo = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
      T* o = out + (t * H + kh * G) * D;
      if (hi <= lo) {  // nothing visible (a malformed list): zeros, as decode gives a request without keys
        for (int64_t i = 0; i < G * D; ++i) store(o, i, 0.f);
        continue;
      }
      scaled_rows(q + (t * H + kh * G) * D, G * D, pre, qf.data());
      p.resize(G * (hi - lo));
      routine(qf.data(), kb, vb, Chunk{idx + kptr[b] + lo, hi - lo, kh}, s, p.data(), mx.data(), l.data(), acc.data());
      for (int64_t g = 0; g < G; ++g) scaled_rows(acc.data() + g * D, D, 1.f / l[g], o + g * D);
    }
  });
}

}  // namespace

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& indices, const at::Tensor& indptr, const at::Tensor& key_start,
                            const at::Tensor& q_indptr, const at::Tensor& q_positions, int64_t window, double scaling,
                            double softcap) {
  check_pools(q, k_buf, v_buf);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), S = k_buf.size(0), Hkv = k_buf.size(1);
  const int64_t B = key_start.numel();
  check_int32(indices, -1, "indices");
  check_int32(indptr, B + 1, "indptr");
  check_int32(key_start, B, "key_start");
  check_int32(q_indptr, B + 1, "q_indptr");
  check_int32(q_positions, T, "q_positions");
  const int32_t *kp = indptr.data_ptr<int32_t>(), *qp = q_indptr.data_ptr<int32_t>();
  TORCH_CHECK(kp[0] == 0 && kp[B] <= indices.numel() && qp[0] == 0 && qp[B] == T, "indptr or q_indptr does not fit");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(kp[b + 1] >= kp[b] && qp[b + 1] >= qp[b], "indptr and q_indptr must not decrease");
  auto out = at::empty_like(q);
  const Shape s{H, Hkv, H / Hkv, D, S, static_cast<float>(scaling), static_cast<float>(softcap)};
  with_float_type(q.scalar_type(), [&](auto tag) {
    using F = decltype(tag);
    attend_extend<F>(data_of<F>(q), data_of<F>(k_buf), data_of<F>(v_buf), indices.data_ptr<int32_t>(), kp,
                     key_start.data_ptr<int32_t>(), qp, q_positions.data_ptr<int32_t>(), B, window,
                     mutable_data_of<F>(out), s);
  });
  return out;
}

}  // namespace swa
