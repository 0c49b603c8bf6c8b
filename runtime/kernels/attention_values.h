// What an attention chunk is (attention_chunk.h), and how its rows are read: fetched ahead, and the weighted values
// summed in bfloat16 dot products.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "common.h"
#include "vecmath.h"

namespace swa {
namespace attention {

struct Chunk {  // one (request, kv head, chunk of its keys)
  const int32_t* slots;
  int64_t len, kh;
  // The rows are likely in memory, not in the caches (decode: the weights streamed in between evicted them): the
  // score loop then fetches key and value rows ahead, and the weighted sum finds them cached. Not cold (prefill:
  // the rows were just written): no fetching ahead, which only cost instructions there (a 600-token prompt's
  // attention 2.35 -> 2.03 ms a layer on a 2-core EPYC; 3000 tokens no slower).
  bool cold = false;
  // Fetched into L2 rather than L1 (`prefetch_bytes`): where each thread reads whole requests one after another
  // (decode with a few requests a thread), L2 was faster (likely: sixteen lines a key asked into L1 fill its misses
  // in flight); where two threads share one request's keys, L1 was faster. On a 2-core Zen 4 EPYC, alternated in
  // one process: the layers of a 16-request decode step 0.80-0.84x the time, a 1-request step's 1.09-1.22x.
  bool far = false;
};

struct Shape {
  int64_t H, Hkv, G, D, S;
  float scaling, softcap;
};

inline void check_slot(int64_t slot, int64_t S) {
  TORCH_CHECK(slot >= 0 && slot < S, "key slot ", slot, " outside the pool of ", S);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Keys ahead whose rows are fetched while the current ones are multiplied: a decode step reads each layer's keys
// and values from memory (the weights streamed in between evict them), slot by slot, and the fetches in flight
// hide the latency (one Gemma 3 270M decode step's attention 0.56 -> 0.45 ms on a 2-core EPYC). A cold chunk's
// score loop fetches the value rows too (a cold 512-key decode 31 -> 25 us); a chunk that is not cold fetches
// nothing ahead (`Chunk::cold`).
constexpr int64_t kAhead = 8;

// Fetch `bytes` from p on into the caches: L1, or L2 where `far` (`Chunk::far`).
inline void prefetch_bytes(const void* p, int64_t bytes, bool far) {
  const char* r = static_cast<const char*>(p);
  if (far) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(r + b, _MM_HINT_T1);
  } else {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(r + b, _MM_HINT_T0);
  }
}

#if defined(__AVX512BF16__)
// The weighted values of a chunk in `vdpbf16ps`: two keys a step, the weights rounded to bfloat16 (as flash
// attention multiplies its probabilities), the sums float32; half the instructions of float32 FMAs, which held
// prefill's attention to their pace. Two value rows interleave value by value (within 128-bit quarters), so each
// sum register holds a fixed permutation of 16 of the 64 values, undone when stored.
template <int G>
void values_bf16(const bf16* vb, const Chunk& c, const Shape& s, const float* p, float* acc) {
  const int64_t D = s.D, len = c.len, pairs = (len + 1) / 2;
  thread_local std::vector<uint32_t> weights;  // per head, (w_j, w_j+1) in bfloat16, the odd tail's partner 0
  weights.resize(G * pairs);
  for (int g = 0; g < G; ++g) {
    bf16* w = reinterpret_cast<bf16*>(weights.data() + g * pairs);
    for (int64_t j = 0; j < len; ++j) store(w, j, p[g * len + j]);
    if (len % 2) w[len] = 0;
  }
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512 a[G][4];
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < 4; ++i) a[g][i] = _mm512_setzero_ps();
    for (int64_t h = 0; h < pairs; ++h) {
      const int64_t j = 2 * h, j1 = std::min(j + 1, len - 1);  // an odd tail pairs its key with itself, weight 0
      const bf16* r0 = vb + (c.slots[j] * s.Hkv + c.kh) * D + d0;
      const bf16* r1 = vb + (c.slots[j1] * s.Hkv + c.kh) * D + d0;
      for (int64_t ja = j + kAhead; c.cold && ja < std::min(j + kAhead + 2, len); ++ja)
        prefetch_bytes(vb + (c.slots[ja] * s.Hkv + c.kh) * D + d0, 64 * sizeof(bf16), c.far);
      __m512i x[4];
      for (int half = 0; half < 2; ++half) {
        const __m512i u = _mm512_loadu_si512(r0 + 32 * half), v = _mm512_loadu_si512(r1 + 32 * half);
        x[2 * half] = _mm512_unpacklo_epi16(u, v);
        x[2 * half + 1] = _mm512_unpackhi_epi16(u, v);
      }
      for (int g = 0; g < G; ++g) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(weights[g * pairs + h]));
        for (int i = 0; i < 4; ++i) a[g][i] = _mm512_dpbf16_ps(a[g][i], (__m512bh)x[i], w);
      }
    }
    // x[2 half] holds, in quarter q, values 32 half + 8 q + 0..3; x[2 half + 1] values 32 half + 8 q + 4..7.
    for (int g = 0; g < G; ++g) {
      alignas(64) float lo[16], hi[16];
      for (int half = 0; half < 2; ++half) {
        _mm512_store_ps(lo, a[g][2 * half]);
        _mm512_store_ps(hi, a[g][2 * half + 1]);
        float* out = acc + g * D + d0 + 32 * half;
        for (int q = 0; q < 4; ++q) {
          std::memcpy(out + 8 * q, lo + 4 * q, 16);
          std::memcpy(out + 8 * q + 4, hi + 4 * q, 16);
        }
      }
    }
  }
}
#endif

#endif

}  // namespace attention
}  // namespace swa
