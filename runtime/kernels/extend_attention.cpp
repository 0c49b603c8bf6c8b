// Extend (prefill) attention: each new token over exactly the keys it sees, read in place from the KV pool: ragged
// requests, causal and windowed; nothing masked, padded or gathered.

#include "attention.h"
#include "attention_chunk.h"
#include "extend_tiles.h"
#include "extend_tiles_f32.h"

#include <array>
#include <atomic>
#include <iterator>
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
// Tiles of bfloat16 pairs (extend_tiles.h), their products on AVX512-BF16 or on AMX-BF16 tiles (`amx`).
struct Bf16Tiles {
  bool amx;
  using Word = uint32_t;
  using Stage = Staged;
  using Scratch = TileScratch;
  static bool serve(const Shape& s) { return tiles_serve(s); }
  static int64_t tokens(const Shape& s) { return kTileRows / s.G; }
  static int64_t keys(int64_t n) { return staged_keys(n); }
  static int64_t words(int64_t n, int64_t D) { return staged_keys(n) * D; }  // keys and values, D / 2 pairs a key each
  static Stage at(Word* p, int64_t n, int64_t D) { return {p, p + staged_keys(n) * D / 2}; }
  static void stage(const bf16* kb, const bf16* vb, const int32_t* slots, int64_t n, int64_t j0, int64_t j1,
                    const Shape& s, int64_t kh, const Stage& st) {
    attention::stage(kb, vb, slots, n, j0, j1, s, kh, st.k, st.v);
  }
  struct Thread {  // a thread's scratch, and its AMX tile state while it attends tiles on them
    Scratch scratch;
#if defined(SWA_AMX_BF16)
    std::optional<TileScope> amx_tiles;
#endif
    Thread(const Bf16Tiles& tiles, const Shape& s) {
      scratch.q.resize(kTileRows * s.D / 2);
#if defined(SWA_AMX_BF16)
      if (tiles.amx) amx_tiles.emplace();
#endif
    }
  };
  static bool queries(const bf16* q, int64_t t0, int64_t tokens, int64_t kh, const Shape& s, float pre, Scratch& sc) {
    return tile_queries(q, t0, tokens, kh, s, pre, sc.q.data());
  }
  void attend(const Stage& st, const TileRows& rows, const Shape& s, Scratch& sc, bf16* const* out) const {
    attend_tile(st, rows, s, sc, out, amx);
  }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Tiles of float32 (extend_tiles_f32.h), on AVX2.
struct Float32Tiles {
  using Word = float;
  using Stage = f32_tiles::Staged;
  using Scratch = f32_tiles::Scratch;
  static bool serve(const Shape& s) { return f32_tiles::serve(s); }
  static int64_t tokens(const Shape& s) { return f32_tiles::tile_tokens(s); }
  static int64_t keys(int64_t n) { return f32_tiles::staged_keys(n); }
  static int64_t words(int64_t n, int64_t D) { return f32_tiles::staged_floats(n, D); }
  static Stage at(Word* p, int64_t n, int64_t D) { return f32_tiles::staged_at(p, n, D); }
  static void stage(const bf16* kb, const bf16* vb, const int32_t* slots, int64_t n, int64_t j0, int64_t j1,
                    const Shape& s, int64_t kh, const Stage& st) {
    f32_tiles::stage(kb, vb, slots, n, j0, j1, s, kh, st);
  }
  struct Thread {
    Scratch scratch;
    Thread(const Float32Tiles&, const Shape& s) { scratch.q.resize(kMaxTileRows * s.D); }
  };
  static bool queries(const bf16* q, int64_t t0, int64_t tokens, int64_t kh, const Shape& s, float pre, Scratch& sc) {
    f32_tiles::tile_queries(q, t0, tokens, kh, s, pre, sc.q.data());
    return true;
  }
  void attend(const Stage& st, const TileRows& rows, const Shape& s, Scratch& sc, bf16* const* out) const {
    f32_tiles::attend_tile(st, rows, s, sc, out);
  }
};
#endif

// The requests with a tile's worth of new tokens, in the tiles of `tiles`; done[t * Hkv + kh] marks what they
// attended (a tile whose queries the tiles cannot take is left to the token-at-a-time path). First each request's
// keys are restaged (in parallel, 64 keys an item), then the tiles run (in parallel, zigzagged).
template <typename Tiles>
void attend_tiles(const Tiles& tiles, const bf16* q, const bf16* kb, const bf16* vb, const int32_t* idx,
                  const int32_t* kptr, const int32_t* kstart, const int32_t* qptr, const int32_t* qpos, int64_t B,
                  int64_t window, bf16* out, const Shape& s, float pre, std::vector<uint8_t>& done) {
  const int64_t G = s.G, D = s.D, H = s.H, Hkv = s.Hkv, per = Tiles::tokens(s);
  struct Request {
    int64_t b, first, n, at;  // its keys first..first + n restaged from buffer[at] on, per kv head
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
    total += Hkv * Tiles::words(end - first, D);
  }
  if (requests.empty()) return;
  using Word = typename Tiles::Word;
  const std::unique_ptr<Word[]> buffer(new Word[total]);  // every word written by `stage`
  auto staged = [&](const Request& r, int64_t kh) {
    return Tiles::at(buffer.get() + r.at + kh * Tiles::words(r.n, D), r.n, D);
  };
  constexpr int64_t kStageKeys = 64;
  std::vector<std::array<int64_t, 3>> stage_items;  // (request, kv head, first key)
  std::vector<std::array<int64_t, 3>> tile_items;   // (request, kv head, first token)
  for (int64_t i = 0; i < static_cast<int64_t>(requests.size()); ++i) {
    const Request& r = requests[i];
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      for (int64_t j = 0; j < Tiles::keys(r.n); j += kStageKeys) stage_items.push_back({i, kh, j});
      for (int64_t t = qptr[r.b]; t < qptr[r.b + 1]; t += per) tile_items.push_back({i, kh, t});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(stage_items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const auto [ri, kh, j] = stage_items[i];
      const Request& r = requests[ri];
      Tiles::stage(kb, vb, idx + kptr[r.b] + r.first, r.n, j, std::min(j + kStageKeys, Tiles::keys(r.n)), s, kh,
                   staged(r, kh));
    }
  });
  const int64_t items = static_cast<int64_t>(tile_items.size());
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    typename Tiles::Thread thread(tiles, s);
    for (int64_t i = i0; i < i1; ++i) {
      const auto [ri, kh, t0] = tile_items[zigzag(i, items)];
      const Request& r = requests[ri];
      const int64_t tokens = std::min(per, qptr[r.b + 1] - t0);
      if (!Tiles::queries(q, t0, tokens, kh, s, pre, thread.scratch)) continue;
      TileRows rows;
      bf16* outs[kMaxTileRows];
      rows.count = tokens * G;
      for (int64_t row = 0; row < rows.count; ++row) {
        const int64_t t = t0 + row / G;
        const Seen k = seen(kptr, kstart, qpos, r.b, t, window);
        rows.lo[row] = k.hi > k.lo ? k.lo - r.first : 0;
        rows.hi[row] = k.hi > k.lo ? k.hi - r.first : 0;
        outs[row] = out + (t * H + kh * G + row % G) * D;
      }
      tiles.attend(staged(r, kh), rows, s, thread.scratch, outs);
      for (int64_t t = t0; t < t0 + tokens; ++t) done[t * Hkv + kh] = 1;
    }
  });
}

// The tiles extend attention runs on (`set_extend_tiles`), by name: the fastest this CPU has unless set.
enum class TileKind : int { kNone, kFloat32, kBf16, kAmx };
constexpr const char* kTileNames[] = {"none", "float32", "bfloat16", "amx"};
std::atomic<int> chosen_tiles{-1};  // -1: the fastest here

bool tiles_run_here(TileKind kind) {
  switch (kind) {
    case TileKind::kNone: return true;
#if defined(__AVX2__) && defined(__FMA__)
    case TileKind::kFloat32: return true;
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    case TileKind::kBf16: return true;
#endif
    case TileKind::kAmx: return amx_granted();
    default: return false;
  }
}

// AMX where granted, else bfloat16 pairs on AVX512-BF16, else float32 on AVX2 where the CPU has no AVX-512 (with
// AVX-512 but no bfloat16 units the token-at-a-time path keeps its 16 lanes: float32 tiles are not measured there).
TileKind fastest_tiles() {
  if (tiles_run_here(TileKind::kAmx)) return TileKind::kAmx;
  if (tiles_run_here(TileKind::kBf16)) return TileKind::kBf16;
#if !defined(__AVX512F__)
  if (tiles_run_here(TileKind::kFloat32)) return TileKind::kFloat32;
#endif
  return TileKind::kNone;
}

TileKind tiles_in_use() {
  const int chosen = chosen_tiles.load(std::memory_order_relaxed);
  return chosen < 0 ? fastest_tiles() : static_cast<TileKind>(chosen);
}

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
  if constexpr (std::is_same<T, bf16>::value) {
    const TileKind kind = tiles_in_use();
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if ((kind == TileKind::kAmx || kind == TileKind::kBf16) && Bf16Tiles::serve(s))
      attend_tiles(Bf16Tiles{kind == TileKind::kAmx}, q, kb, vb, idx, kptr, kstart, qptr, qpos, B, window, out, s,
                   pre, done);
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (kind == TileKind::kFloat32 && Float32Tiles::serve(s))
      attend_tiles(Float32Tiles{}, q, kb, vb, idx, kptr, kstart, qptr, qpos, B, window, out, s, pre, done);
#endif
  }
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

std::string extend_tiles() { return kTileNames[static_cast<int>(tiles_in_use())]; }

std::string set_extend_tiles(const std::string& name) {
  const std::string previous = extend_tiles();
  if (name == "auto") {
    chosen_tiles.store(-1, std::memory_order_relaxed);
    return previous;
  }
  for (int i = 0; i < static_cast<int>(std::size(kTileNames)); ++i) {
    if (name != kTileNames[i]) continue;
    TORCH_CHECK(tiles_run_here(static_cast<TileKind>(i)), "extend attention's ", name,
                " tiles cannot run on this CPU (or were not built for it)");
    chosen_tiles.store(i, std::memory_order_relaxed);
    return previous;
  }
  TORCH_CHECK(false, "unknown extend tiles '", name, "': auto, none, float32, bfloat16 or amx");
}

bool amx_attention_on() { return tiles_in_use() == TileKind::kAmx; }

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
