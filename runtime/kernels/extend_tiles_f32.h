// Extend attention in float32 tiles of query rows (extend_attention.cpp), for CPUs with AVX2 and FMA but no
// bfloat16 tiles (extend_tiles.h needs AVX512-BF16). A token at a time (`chunk_avx2`), each key row was converted
// from bfloat16 and read for one token's G query rows, and each score summed across lanes; on a 2-core Zen 1 EPYC
// that attention was 15% of a 600-token prefill. Here a request's keys are restaged once as float32, keys in blocks
// of 8 (a vector holds one head value of 8 keys, so 8 scores sum in the lanes), values in blocks of 16 head values
// (a block's pass over the keys reads in order); then each tile of
// up to 12 query rows (12 / G tokens) is two small matrix products in registers, 6 rows by 16 columns (scores: 16
// keys; weighted values: 16 head values), each key or value vector read once for 6 rows. All in float32, as the
// token-at-a-time path: the same products, summed in another order. Built for Haswell on a 2-core Xeon with AMX
// (`SWA_RUNTIME_CPU_KERNELS_MARCH=haswell`), one layer: 600 tokens 6.9-8.0 ms against 12.1-14.2 a token at a time,
// 1000 in a window of 512 14.0-14.3 against 23.3, 2000 60-68 against 134-150. (GCC kept the sums in memory, stored
// every step, while they were a [R][2] array: one array per half keeps them in registers.)

#pragma once

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_chunk.h"
#include "common.h"
#include "tile_rows.h"
#include "vecmath.h"

namespace swa {
namespace attention {

#if defined(__AVX2__) && defined(__FMA__)

namespace f32_tiles {

constexpr int kGroup = 6;         // rows a register block takes: 6 x 2 vectors of sums, 2 of keys, 1 broadcast

// Whether float32 tiles serve this shape: no soft-capping (its tanh would follow the scores), 16 head values a step.
inline bool serve(const Shape& s) { return s.softcap <= 0.f && s.D % 16 == 0 && s.G <= kMaxTileRows; }

// Tokens a tile: 12 query rows where G divides 12 (Gemma 3 270M: G = 4, three tokens), else as many as fit.
inline int64_t tile_tokens(const Shape& s) { return std::max<int64_t>(1, 12 / s.G); }

inline int64_t staged_keys(int64_t n) { return (n + 15) / 16 * 16; }

// Floats one (request, kv head) of n keys takes restaged: keys then values.
inline int64_t staged_floats(int64_t n, int64_t D) { return 2 * staged_keys(n) * D; }

struct Staged {
  float* k;      // [keys / 8 blocks][D][8 keys]
  float* v;      // [D / 16 blocks][keys][16 head values]: a block's pass over the keys reads in order
  int64_t keys;  // staged_keys(n)
};

inline Staged staged_at(float* at, int64_t n, int64_t D) { return {at, at + staged_keys(n) * D, staged_keys(n)}; }

// Keys j0..j1 (multiples of 8) of the list `slots`, n of them real, into st (sized for staged_keys(n)); the keys
// from n on are zeros (weights of 0 times values of 0: nothing a row adds).
template <typename KV>
void stage(const KV* kb, const KV* vb, const int32_t* slots, int64_t n, int64_t j0, int64_t j1, const Shape& s,
           int64_t kh, const Staged& st) {
  const int64_t D = s.D;
  for (int64_t j = j0; j < j1; ++j) {
    float* kk = st.k + j / 8 * D * 8 + j % 8;
    float* vv = st.v + j * 16;  // head value d at vv[d / 16 * keys * 16 + d % 16]
    if (j >= n) {
      for (int64_t d = 0; d < D; ++d) kk[d * 8] = 0.f;
      for (int64_t d = 0; d < D; d += 16) std::memset(vv + d * st.keys, 0, 16 * sizeof(float));
      continue;
    }
    const int64_t slot = slots[j];
    check_slot(slot, s.S);
    const KV* kr = kb + (slot * s.Hkv + kh) * D;
    const KV* vr = vb + (slot * s.Hkv + kh) * D;
    for (int64_t d = 0; d < D; d += 8) {
      alignas(32) float row[8];
      _mm256_store_ps(row, load8(kr + d));
      for (int e = 0; e < 8; ++e) kk[(d + e) * 8] = row[e];
      _mm256_storeu_ps(vv + d / 16 * st.keys * 16 + d % 16, load8(vr + d));
    }
  }
}

struct Scratch {
  std::vector<float> q;        // [kMaxTileRows][D] the rows' queries, scaled
  std::vector<float> scores;   // [rows][width]
  std::vector<float> weights;  // [rows][width]
};

// The tile's query rows scaled by `pre`, as float32.
template <typename T>
void tile_queries(const T* q, int64_t t0, int64_t tokens, int64_t kh, const Shape& s, float pre, float* out) {
  const int64_t G = s.G, D = s.D;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < G; ++g) scaled_rows(q + ((t0 + t) * s.H + kh * G + g) * D, D, pre, out + (t * G + g) * D);
}

// Scores of rows r0..r0+R against the 16 keys k0.. (staged indices, a multiple of 16) into scores[r][k - base].
template <int R>
void scores16(const float* q, const Staged& st, int64_t D, int64_t r0, int64_t k0, int64_t base, float* scores,
              int64_t width) {
  const float* b0 = st.k + k0 / 8 * D * 8;
  const float* b1 = b0 + D * 8;
  const float* qr = q + r0 * D;
  __m256 lo[R], hi[R];  // one array per half: GCC kept a [R][2] array in memory, stored every step
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0v = _mm256_loadu_ps(b0 + d * 8), k1v = _mm256_loadu_ps(b1 + d * 8);
    for (int r = 0; r < R; ++r) {
      const __m256 qv = _mm256_broadcast_ss(qr + r * D + d);
      lo[r] = _mm256_fmadd_ps(qv, k0v, lo[r]);
      hi[r] = _mm256_fmadd_ps(qv, k1v, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(scores + (r0 + r) * width + (k0 - base), lo[r]);
    _mm256_storeu_ps(scores + (r0 + r) * width + (k0 - base) + 8, hi[r]);
  }
}

// Rows r0..r0+R's weighted values, head values d0..d0+16, over keys h0..h1 (staged indices), divided by their sums.
template <int R, typename T>
void values16(const float* w, const Staged& st, int64_t D, int64_t r0, int64_t d0, int64_t h0, int64_t h1,
              int64_t base, int64_t width, const float* sums, T* const* out) {
  const float* wr = w + r0 * width - base;
  const float* vb = st.v + d0 * st.keys;
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t h = h0; h < h1; ++h) {
    const __m256 v0 = _mm256_loadu_ps(vb + h * 16), v1 = _mm256_loadu_ps(vb + h * 16 + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 pw = _mm256_broadcast_ss(wr + r * width + h);
      lo[r] = _mm256_fmadd_ps(pw, v0, lo[r]);
      hi[r] = _mm256_fmadd_ps(pw, v1, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 inv = _mm256_set1_ps(sums[r0 + r] > 0.f ? 1.f / sums[r0 + r] : 0.f);
    store8(out[r0 + r] + d0, _mm256_mul_ps(lo[r], inv));
    store8(out[r0 + r] + d0 + 8, _mm256_mul_ps(hi[r], inv));
  }
}

// f(std::integral_constant<int, R>) for R = rows (1..kGroup): the register blocks take their row count at compile
// time.
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    default: f(std::integral_constant<int, kGroup>{}); break;
  }
}

// Row r's softmax over its keys lo..hi (of the tile's base..base + width): the weights, 0 elsewhere; returns the sum
// of the exponentials.
inline float softmax_row(const float* sc, int64_t lo, int64_t hi, int64_t base, int64_t width, float* w) {
  const int64_t a = lo - base, b = hi - base;
  __m256 most = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = a;
  for (; j + 8 <= b; j += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(sc + j));
  alignas(32) float lanes8[8];
  _mm256_store_ps(lanes8, most);
  float top = *std::max_element(lanes8, lanes8 + 8);
  for (; j < b; ++j) top = std::max(top, sc[j]);
  const __m256 t = _mm256_set1_ps(top);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 total = _mm256_setzero_ps();
  for (j = 0; j < width; j += 8) {
    if (j + 8 <= a || j >= b) {
      _mm256_storeu_ps(w + j, _mm256_setzero_ps());
      continue;
    }
    const __m256i at = _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int32_t>(j)));
    const __m256i in = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(a)), at),
                                           _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(b)), at));
    const __m256 e = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sc + j), t)),
                                   _mm256_castsi256_ps(in));
    total = _mm256_add_ps(total, e);
    _mm256_storeu_ps(w + j, e);
  }
  return lanes_sum8(total);
}

// One tile: its rows' scores over the keys any of them sees, each row's softmax, the weighted values into out[r] (a
// row of D values; a row that sees no key gets zeros).
template <typename T>
void attend_tile(const Staged& st, const TileRows& rows, const Shape& s, Scratch& sc, T* const* out) {
  const int64_t D = s.D, n = rows.count;
  int64_t lo, hi;
  rows.keys_of(0, n, lo, hi);
  if (hi == 0) {
    for (int64_t r = 0; r < n; ++r)
      for (int64_t d = 0; d < D; ++d) store(out[r], d, 0.f);
    return;
  }
  const int64_t base = lo / 16 * 16, width = (hi - base + 15) / 16 * 16;
  sc.scores.resize(n * width);
  sc.weights.resize(n * width);
  float sums[kMaxTileRows] = {};
  for (int64_t r0 = 0; r0 < n; r0 += kGroup) {
    const int64_t r1 = std::min<int64_t>(r0 + kGroup, n);
    int64_t glo, ghi;
    rows.keys_of(r0, r1, glo, ghi);
    if (ghi == 0) continue;
    with_rows(r1 - r0, [&](auto R) {
      for (int64_t k0 = glo / 16 * 16; k0 < ghi; k0 += 16)
        scores16<R.value>(sc.q.data(), st, D, r0, k0, base, sc.scores.data(), width);
    });
  }
  for (int64_t r = 0; r < n; ++r) {
    if (rows.hi[r] > rows.lo[r])
      sums[r] = softmax_row(sc.scores.data() + r * width, rows.lo[r], rows.hi[r], base, width,
                            sc.weights.data() + r * width);
    else
      std::memset(sc.weights.data() + r * width, 0, width * sizeof(float));
  }
  for (int64_t r0 = 0; r0 < n; r0 += kGroup) {
    const int64_t r1 = std::min<int64_t>(r0 + kGroup, n);
    int64_t glo, ghi;
    rows.keys_of(r0, r1, glo, ghi);
    if (ghi == 0) glo = ghi;  // no keys: sums of nothing, zeros stored
    with_rows(r1 - r0, [&](auto R) {
      for (int64_t d0 = 0; d0 < D; d0 += 16)
        values16<R.value>(sc.weights.data(), st, D, r0, d0, glo, ghi, base, width, sums, out);
    });
  }
}

}  // namespace f32_tiles

#endif

}  // namespace attention
}  // namespace swa
