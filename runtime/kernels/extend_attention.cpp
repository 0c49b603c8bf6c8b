// Extend (prefill) attention: each new token over exactly the keys it sees, read in place from the KV pool: ragged
// requests, causal and windowed; nothing masked, padded or gathered.

#include "attention.h"
#include "attention_chunk.h"
#include "extend_tiles.h"

#include <array>
#include <memory>
#include <optional>

namespace swa {

using namespace attention;

namespace {

// The i-th of n items taken first, last, second, second to last...: causal rows grow with the position, and
// ATen hands each thread a contiguous range, so in order the last thread would get the longest rows (a 600-token
// prompt: three quarters of the work on one of two threads). Zigzagged, a 600-token prompt's attention on a 2-core
// Zen 4 EPYC took 49-52 ms against 66-70 (18 layers, bfloat16).
inline int64_t zigzag(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

// The keys token t of request b sees, lo..hi of its list: at and before its position, within the window on sliding
// layers (none where hi <= lo: a malformed list).
struct Seen {
  int64_t lo, hi;
};
inline Seen seen(const int32_t* kptr, const int32_t* kstart, const int32_t* qpos, int64_t b, int64_t t,
                 int64_t window) {
  const int64_t n = kptr[b + 1] - kptr[b], last = qpos[t] - kstart[b];  // the query's own key
  return {window > 0 ? std::max<int64_t>(0, last - window + 1) : 0, std::min(n, last + 1)};
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The requests with a tile's worth of new tokens, in tiles (extend_tiles.h); done[t * Hkv + kh] marks what they
// attended (a tile whose queries bfloat16 cannot hold is left to the token-at-a-time path).
void attend_tiles(const bf16* q, const bf16* kb, const bf16* vb, const int32_t* idx, const int32_t* kptr,
                  const int32_t* kstart, const int32_t* qptr, const int32_t* qpos, int64_t B, int64_t window, bf16* out,
                  const Shape& s, float pre, std::vector<uint8_t>& done) {
  const int64_t G = s.G, D = s.D, H = s.H, Hkv = s.Hkv, per = kTileRows / G;
  struct Request {
    int64_t b, first, n, at;  // its keys first..first + n restaged from buffer[at] on, per kv head keys then values
  };
  std::vector<Request> requests;
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (qptr[b + 1] - qptr[b] < per) continue;
    int64_t first = std::numeric_limits<int64_t>::max(), end = 0;
    for (int64_t t = qptr[b]; t < qptr[b + 1]; ++t) {
      const Seen k = seen(kptr, kstart, qpos, b, t, window);
      if (k.hi <= k.lo) continue;
      first = std::min(first, k.lo);
      end = std::max(end, k.hi);
    }
    if (end == 0) first = 0;
    requests.push_back({b, first, end - first, total});
    total += Hkv * staged_keys(end - first) * D;  // keys and values, D / 2 pairs a key each
  }
  if (requests.empty()) return;
  const std::unique_ptr<uint32_t[]> buffer(new uint32_t[total]);  // every word written by `stage`
  auto staged = [&](const Request& r, int64_t kh) {
    const int64_t half = staged_keys(r.n) * D / 2;
    uint32_t* k = buffer.get() + r.at + kh * 2 * half;
    return Staged{k, k + half};
  };
  constexpr int64_t kStageKeys = 64;
  std::vector<std::array<int64_t, 3>> stage_items;  // (request, kv head, first key)
  std::vector<std::array<int64_t, 3>> tile_items;   // (request, kv head, first token)
  for (int64_t i = 0; i < static_cast<int64_t>(requests.size()); ++i) {
    const Request& r = requests[i];
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      for (int64_t j = 0; j < staged_keys(r.n); j += kStageKeys) stage_items.push_back({i, kh, j});
      for (int64_t t = qptr[r.b]; t < qptr[r.b + 1]; t += per) tile_items.push_back({i, kh, t});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(stage_items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const auto [ri, kh, j] = stage_items[i];
      const Request& r = requests[ri];
      const Staged st = staged(r, kh);
      stage(kb, vb, idx + kptr[r.b] + r.first, r.n, j, std::min(j + kStageKeys, staged_keys(r.n)), s, kh, st.k, st.v);
    }
  });
  const int64_t items = static_cast<int64_t>(tile_items.size());
  const bool amx = amx_attention_on();
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
#if defined(SWA_AMX_BF16)
    std::optional<TileScope> tiles;
    if (amx) tiles.emplace();
#endif
    TileScratch scratch;
    scratch.q.resize(kTileRows * D / 2);
    for (int64_t i = i0; i < i1; ++i) {
      const auto [ri, kh, t0] = tile_items[zigzag(i, items)];
      const Request& r = requests[ri];
      const int64_t tokens = std::min(per, qptr[r.b + 1] - t0);
      if (!tile_queries(q, t0, tokens, kh, s, pre, scratch.q.data())) continue;
      TileRows rows;
      bf16* outs[kTileRows];
      rows.count = tokens * G;
      for (int64_t row = 0; row < rows.count; ++row) {
        const int64_t t = t0 + row / G;
        const Seen k = seen(kptr, kstart, qpos, r.b, t, window);
        rows.lo[row] = k.hi > k.lo ? k.lo - r.first : 0;
        rows.hi[row] = k.hi > k.lo ? k.hi - r.first : 0;
        outs[row] = out + (t * H + kh * G + row % G) * D;
      }
      attend_tile(staged(r, kh), rows, s, scratch, outs, amx);
      for (int64_t t = t0; t < t0 + tokens; ++t) done[t * Hkv + kh] = 1;
    }
  });
}
#endif

// Each (token, kv head) not attended in tiles: one query row, its keys the range it sees. The same chunk routine as
// decode, whole (no split: the rows are already many).
template <typename T>
void attend_extend(const T* q, const T* kb, const T* vb, const int32_t* idx, const int32_t* kptr, const int32_t* kstart,
                   const int32_t* qptr, const int32_t* qpos, int64_t B, int64_t window, T* out, const Shape& s) {
  const int64_t G = s.G, D = s.D, H = s.H, Hkv = s.Hkv, tokens = qptr[B];
  std::vector<int32_t> request(tokens);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = qptr[b]; t < qptr[b + 1]; ++t) request[t] = static_cast<int32_t>(b);
  const float pre = s.softcap > 0.f ? 1.f : s.scaling;
  std::vector<uint8_t> done(tokens * Hkv, 0);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same<T, bf16>::value)
    if (tiles_serve(s)) attend_tiles(q, kb, vb, idx, kptr, kstart, qptr, qpos, B, window, out, s, pre, done);
#endif
  std::vector<int64_t> rest;
  for (int64_t i = 0; i < tokens * Hkv; ++i)
    if (!done[i]) rest.push_back(i);
  const auto routine = chunk_routine<T>(s);
  const int64_t items = static_cast<int64_t>(rest.size());
  at::parallel_for(0, items, 4, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(G * D), acc(G * D), mx(G), l(G), p;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t it = rest[zigzag(i, items)];
      const int64_t t = it / Hkv, kh = it % Hkv, b = request[t];
      const Seen k = seen(kptr, kstart, qpos, b, t, window);
      T* o = out + (t * H + kh * G) * D;
      if (k.hi <= k.lo) {  // nothing visible (a malformed list): zeros, as decode gives a request without keys
        for (int64_t i = 0; i < G * D; ++i) store(o, i, 0.f);
        continue;
      }
      scaled_rows(q + (t * H + kh * G) * D, G * D, pre, qf.data());
      p.resize(G * (k.hi - k.lo));
      routine(qf.data(), kb, vb, Chunk{idx + kptr[b] + k.lo, k.hi - k.lo, kh}, s, p.data(), mx.data(), l.data(),
              acc.data());
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
