// Extend attention in tiles of query rows (extend_attention.cpp): where the pools are bfloat16 and the CPU has
// AVX512-BF16, a request with at least a tile of new tokens is attended 16 query rows at a time (16/G tokens, all G
// query heads of a kv head), so that each key and value row read from the caches serves 16 rows, not G. On a 2-core
// Zen 4 EPYC, a 600-token prompt's layer: 2.05-2.10 ms in tiles against 2.5-2.8 a token at a time (`vdpbf16ps` at
// ~77% of its pace against ~63%: there the loads, the per-token set-up and the horizontal sums took the rest);
// three such prompts 6.1-6.7 against 8.2-8.5 ms, one of 2000 tokens 21 against 30. Where the CPU has AMX-BF16, the
// products run on its tiles (`amx_scores`, `amx_values`): on a 2-core Xeon with AMX a 600-token layer 1.4 against
// 5.5 ms on AVX512-BF16, and against torch's attention on AMX (the route the runtime took there before,
// runtime/attention/amx_extend.py) 1.6-1.7 against 3.2-3.7 ms; 8 prompts of 600 tokens prefilled 1.25x faster, of
// 1000 tokens 1.5x.
//
// First the request's keys are restaged (`stage`) into what the dot products take: keys in blocks of 16, for each
// pair of head values one vector of the 16 keys' pairs (the 16 keys' scores then sum in the lanes, no horizontal
// sums); values in pairs of keys, for each head value one 32-bit pair (two keys a `vdpbf16ps`). Then each tile:
// its rows' scores over the keys any of them sees, each row's softmax over its own keys (the others weigh 0), the
// weights rounded to bfloat16 as flash attention rounds its probabilities, and the weighted values in float32.

#pragma once

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "attention_chunk.h"
#include "common.h"
#include "tile_rows.h"
#include "vecmath.h"

namespace swa {
namespace attention {

#if defined(__AVX512F__) && defined(__AVX512BF16__)

constexpr int64_t kTileRows = kMaxTileRows;  // query rows of a tile: G heads by 16 / G tokens

// Whether tiles serve this shape: bfloat16 dot products in 64-value steps of the head, no soft-capping (its tanh
// would follow the scores), whole tokens in a tile.
inline bool tiles_serve(const Shape& s) {
  return s.softcap <= 0.f && s.D % 64 == 0 && s.G <= kTileRows && kTileRows % s.G == 0;
}

// One (request, kv head)'s keys, restaged (`stage`); their count rounded up to 32 with zeros.
struct Staged {
  uint32_t* k;  // [keys / 16 blocks][D / 2][16 keys]: the keys' pairs of values 2p, 2p + 1
  uint32_t* v;  // [keys / 2 pairs][D]: the pair's two values d
};

inline int64_t staged_keys(int64_t n) { return (n + 31) / 32 * 32; }

// Keys j0..j1 (j0 even) of the list `slots`, n of them real, into k and v (sized for staged_keys(n) keys); the
// keys from n on are zeros.
inline void stage(const bf16* kb, const bf16* vb, const int32_t* slots, int64_t n, int64_t j0, int64_t j1,
                  const Shape& s, int64_t kh, uint32_t* k, uint32_t* v) {
  const int64_t D = s.D, P = D / 2;
  // the two halves of a value pair's interleaving, quarters in order (below)
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  for (int64_t j = j0; j < j1; j += 2) {
    const bf16* values[2] = {nullptr, nullptr};
    for (int e = 0; e < 2; ++e) {
      uint32_t* kk = k + (j + e) / 16 * P * 16 + (j + e) % 16;
      if (j + e >= n) {
        for (int64_t p = 0; p < P; ++p) kk[p * 16] = 0;
        continue;
      }
      const int64_t slot = slots[j + e];
      check_slot(slot, s.S);
      const uint32_t* pairs = reinterpret_cast<const uint32_t*>(kb + (slot * s.Hkv + kh) * D);
      for (int64_t p = 0; p < P; ++p) kk[p * 16] = pairs[p];
      values[e] = vb + (slot * s.Hkv + kh) * D;
    }
    // the two value rows interleaved value by value: unpack within 128-bit quarters, then the quarters in order
    uint32_t* vv = v + j / 2 * D;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = values[0] ? _mm512_loadu_si512(values[0] + d) : _mm512_setzero_si512();
      const __m512i b = values[1] ? _mm512_loadu_si512(values[1] + d) : _mm512_setzero_si512();
      const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
      _mm512_storeu_si512(vv + d, _mm512_permutex2var_epi64(lo, first, hi));
      _mm512_storeu_si512(vv + d + 16, _mm512_permutex2var_epi64(lo, second, hi));
    }
  }
}

// Scratch of one thread.
struct TileScratch {
  std::vector<uint32_t> q;  // [kTileRows][D / 2] the rows' query pairs, scaled, in bfloat16
  std::vector<float> scores;  // [kTileRows][width]
  std::vector<bf16> weights;  // [kTileRows][width]
};

// The tile's query rows scaled by `pre` into bfloat16 pairs; false where bfloat16 does not hold one exactly (the
// caller then takes the token-at-a-time path, which falls back to float32).
template <typename T>
bool tile_queries(const T* q, int64_t t0, int64_t tokens, int64_t kh, const Shape& s, float pre, uint32_t* out) {
  const int64_t G = s.G, D = s.D;
  bf16* h = reinterpret_cast<bf16*>(out);
  std::memset(h, 0, kTileRows * D * sizeof(bf16));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t g = 0; g < G; ++g) {
      const T* row = q + ((t0 + t) * s.H + kh * G + g) * D;
      bf16* dst = h + (t * G + g) * D;
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 v = _mm512_mul_ps(load16(row + d), _mm512_set1_ps(pre));
        store16(dst + d, v);
        if (_mm512_cmp_ps_mask(load16(dst + d), v, _CMP_EQ_OQ) != 0xffff) return false;
      }
    }
  }
  return true;
}

// Scores of rows r0..r0+8 against keys k0..k0+32 (staged indices, k0 a multiple of 32) into scores[r][k - base].
inline void tile_scores8(const uint32_t* qp, const Staged& st, int64_t D, int64_t r0, int64_t k0, int64_t base,
                         float* scores, int64_t width) {
  const int64_t P = D / 2;
  const uint32_t* b0 = st.k + k0 / 16 * P * 16;
  const uint32_t* b1 = b0 + P * 16;
  __m512 acc[8][2];
  for (int r = 0; r < 8; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    const __m512bh k0v = (__m512bh)_mm512_loadu_si512(b0 + p * 16), k1v = (__m512bh)_mm512_loadu_si512(b1 + p * 16);
    for (int r = 0; r < 8; ++r) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(qp[(r0 + r) * P + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0v, qv);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1v, qv);
    }
  }
  for (int r = 0; r < 8; ++r) {
    _mm512_storeu_ps(scores + (r0 + r) * width + (k0 - base), acc[r][0]);
    _mm512_storeu_ps(scores + (r0 + r) * width + (k0 - base) + 16, acc[r][1]);
  }
}

// Row r's softmax over its keys lo..hi (of the tile's base..base + width): the weights, 0 elsewhere, in bfloat16;
// returns the sum of the float32 exponentials.
inline float tile_softmax(const float* sc, int64_t lo, int64_t hi, int64_t base, int64_t width, bf16* w) {
  const int64_t a = lo - base, b = hi - base;
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = a; j < b; j += 16) {
    const __mmask16 m = b - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (b - j)) - 1);
    top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, sc + j));
  }
  const __m512 t = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < width; j += 16) {  // width is a multiple of 32
    const int64_t from = std::clamp<int64_t>(a - j, 0, 16), to = std::clamp<int64_t>(b - j, 0, 16);
    if (from >= to) {
      std::memset(w + j, 0, 16 * sizeof(bf16));
      continue;
    }
    const __mmask16 m = static_cast<__mmask16>(((1u << to) - 1) & ~((1u << from) - 1));
    const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sc + j), t)));
    total = _mm512_add_ps(total, e);
    store16(w + j, e);
  }
  return _mm512_reduce_add_ps(total);
}

// Rows r0..r0+4's weighted values over key pairs h0..h1 (of the tile's base / 2 ..), divided by their sums, into
// out: 64 head values at a time, 4 rows by 4 vectors of sums in registers.
template <typename T>
void tile_values4(const bf16* w, const Staged& st, int64_t D, int64_t r0, int64_t rows, int64_t h0, int64_t h1,
                  int64_t base, int64_t width, const float* sums, T* const* out) {
  const uint32_t* wp = reinterpret_cast<const uint32_t*>(w);
  const int64_t wpairs = width / 2, hb = base / 2;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512 acc[4][4];
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t h = h0; h < h1; ++h) {
      const uint32_t* vr = st.v + h * D + d0;
      const __m512bh v0 = (__m512bh)_mm512_loadu_si512(vr), v1 = (__m512bh)_mm512_loadu_si512(vr + 16);
      const __m512bh v2 = (__m512bh)_mm512_loadu_si512(vr + 32), v3 = (__m512bh)_mm512_loadu_si512(vr + 48);
      for (int r = 0; r < 4; ++r) {
        const __m512bh pw = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(wp[(r0 + r) * wpairs + h - hb]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], v0, pw);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], v1, pw);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], v2, pw);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], v3, pw);
      }
    }
    for (int r = 0; r < rows; ++r) {
      const __m512 inv = _mm512_set1_ps(sums[r0 + r] > 0.f ? 1.f / sums[r0 + r] : 0.f);
      for (int i = 0; i < 4; ++i) store16(out[r0 + r] + d0 + 16 * i, _mm512_mul_ps(acc[r][i], inv));
    }
  }
}

#if defined(SWA_AMX_BF16)
// The same products on AMX-BF16 tiles (`amx_attention_on`; the caller holds a `TileScope`), all 16 rows at once:
// `tdpbf16ps` takes a tile of 16 rows x 32 values against 16 pairs x 16 columns, 8192 products an instruction
// against `vdpbf16ps`'s 32. The staged layouts are already what its B tiles take: a block of 16 keys' pairs of head
// values (scores), and pairs of keys' values (the weighted sums). Sums in float32 as there; each product of two
// bfloat16 is exact in float32, only the order of the additions differs.

// Scores of the tile's 16 query rows (q: [16][D / 2] pairs) against keys base..base + width (multiples of 32):
// per 32 keys two 16 x 16 sums over D / 32 steps.
inline void amx_scores(const uint32_t* q, const Staged& st, int64_t D, int64_t base, int64_t width, float* scores) {
  const int64_t P = D / 2;
  for (int64_t k0 = base; k0 < base + width; k0 += 32) {
    const uint32_t* b0 = st.k + k0 / 16 * P * 16;
    const uint32_t* b1 = b0 + P * 16;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t p = 0; p < P; p += 16) {
      _tile_loadd(2, q + p, D * 2);
      _tile_loadd(3, b0 + p * 16, 64);
      _tile_loadd(4, b1 + p * 16, 64);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, scores + (k0 - base), width * 4);
    _tile_stored(1, scores + (k0 - base) + 16, width * 4);
  }
}

// The 16 rows' weighted values (w: [16][width] bfloat16 over keys base.. of the staged list) divided by their sums,
// into out[r] for the first `rows`: per 64 head values four 16 x 16 sums over width / 32 steps of 32 keys.
template <typename T>
void amx_values(const bf16* w, const Staged& st, int64_t D, int64_t rows, int64_t base, int64_t width,
                const float* sums, T* const* out) {
  alignas(64) float block[16 * 64];
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < width; k += 32) {
      const uint32_t* v = st.v + (base + k) / 2 * D + d0;  // 16 pairs of keys, 16 head values a tile
      _tile_loadd(4, w + k, width * 2);
      _tile_loadd(5, v, D * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, v + 16, D * 4);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, v + 32, D * 4);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, v + 48, D * 4);
      _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, block, 256);
    _tile_stored(1, block + 16, 256);
    _tile_stored(2, block + 32, 256);
    _tile_stored(3, block + 48, 256);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inv = _mm512_set1_ps(sums[r] > 0.f ? 1.f / sums[r] : 0.f);
      for (int i = 0; i < 4; ++i)
        store16(out[r] + d0 + 16 * i, _mm512_mul_ps(_mm512_load_ps(block + r * 64 + 16 * i), inv));
    }
  }
}
#endif

// One tile: rows' scores over the keys any of them sees, each row's softmax, the weighted values into out[r] (a
// row of D values; padding rows have none). `amx`: the products on AMX tiles (the caller holds a `TileScope`).
template <typename T>
void attend_tile(const Staged& st, const TileRows& rows, const Shape& s, TileScratch& sc, T* const* out,
                 bool amx = false) {
  const int64_t D = s.D;
  int64_t lo, hi;
  rows.keys_of(0, rows.count, lo, hi);
  float sums[kTileRows] = {};
  if (hi > 0) {
    const int64_t base = lo / 32 * 32, width = (hi - base + 31) / 32 * 32;
    sc.scores.resize(kTileRows * width);
    sc.weights.resize(kTileRows * width);
#if defined(SWA_AMX_BF16)
    if (amx) amx_scores(sc.q.data(), st, D, base, width, sc.scores.data());
#endif
    for (int64_t r0 = 0; r0 < rows.count && !amx; r0 += 8)
      for (int64_t k0 = base; k0 < base + width; k0 += 32)
        tile_scores8(sc.q.data(), st, D, r0, k0, base, sc.scores.data(), width);
    for (int64_t r = 0; r < kTileRows; ++r) {
      if (r < rows.count && rows.hi[r] > rows.lo[r])
        sums[r] = tile_softmax(sc.scores.data() + r * width, rows.lo[r], rows.hi[r], base, width,
                               sc.weights.data() + r * width);
      else
        std::memset(sc.weights.data() + r * width, 0, width * sizeof(bf16));
    }
#if defined(SWA_AMX_BF16)
    if (amx) {
      amx_values(sc.weights.data(), st, D, rows.count, base, width, sums, out);
      return;
    }
#endif
    for (int64_t r0 = 0; r0 < rows.count; r0 += 4) {
      int64_t first, end;  // the key pairs these rows see: first / 2 .. (end + 1) / 2
      rows.keys_of(r0, std::min(r0 + 4, rows.count), first, end);
      const int64_t h0 = end == 0 ? 0 : first / 2, h1 = (end + 1) / 2;
      tile_values4(sc.weights.data(), st, D, r0, std::min<int64_t>(4, rows.count - r0), h0, h1, base, width, sums,
                   out);
    }
  } else {
    for (int64_t r = 0; r < rows.count; ++r)
      for (int64_t d = 0; d < D; ++d) store(out[r], d, 0.f);
  }
}

#endif

}  // namespace attention
}  // namespace swa
