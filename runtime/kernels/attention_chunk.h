// What decode and extend attention share (attention.cpp, extend_attention.cpp): one query row's G heads over a list
// of keys read in place from the KV pool, and the argument checks. Each chunk keeps its own maximum, sum and
// weighted values (float32). Where the CPU has AVX-512 and the heads fit (D a multiple of 16, 1, 2, 4 or 8 query
// heads per kv head: every Gemma 3), a chunk is explicit vector code: the scores of all query heads of a kv head
// for 16/G keys at a time, summed into one vector (bfloat16 dot products where the CPU has AVX512-BF16 and the query
// is exact in bfloat16), the exponentials sixteen at a time, the values added into float32 sums held in registers
// (in bfloat16 dot products, two keys a step, where the CPU has them: attention_values.h), rows fetched ahead;
// with AVX2 but not AVX-512, the same eight lanes at a time (`chunk_avx2`); else plain loops.

#pragma once

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_values.h"
#include "common.h"
#include "vecmath.h"

namespace swa {
namespace attention {

// y[i] = x[i] * scale for n values (loaded and stored as their types: a query row into float32, float32 sums
// into the output's dtype), sixteen at a time where the CPU has AVX-512.
template <typename X, typename Y>
inline void scaled_rows(const X* x, int64_t n, float scale, Y* y) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) store16(y + i, _mm512_mul_ps(load16(x + i), _mm512_set1_ps(scale)));
#elif defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) store8(y + i, _mm256_mul_ps(load8(x + i), _mm256_set1_ps(scale)));
#endif
  for (; i < n; ++i) store(y, i, load(x, i) * scale);
}

// qf (G, D) the chunk's query heads in float32 (scaled unless soft-capping); p scratch of G * len. Writes the
// chunk's max (G,), sum of exponentials (G,) and weighted values (G, D).
template <typename KV>
void chunk_plain(const float* qf, const KV* kb, const KV* vb, const Chunk& c, const Shape& s, float* p, float* mx,
                 float* l, float* acc) {
  const int64_t G = s.G, D = s.D, len = c.len;
  std::vector<float> row(D);
  for (int64_t j = 0; j < len; ++j) {
    const int64_t slot = c.slots[j];
    check_slot(slot, s.S);
    const KV* kr = kb + (slot * s.Hkv + c.kh) * D;
    for (int64_t d = 0; d < D; ++d) row[d] = load(kr, d);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * row[d];
      p[g * len + j] = s.softcap > 0.f ? std::tanh(dot * s.scaling / s.softcap) * s.softcap : dot;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* pg = p + g * len;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < len; ++j) top = std::max(top, pg[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < len; ++j) {
      pg[j] = std::exp(pg[j] - top);
      sum += pg[j];
    }
    mx[g] = top;
    l[g] = sum;
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t j = 0; j < len; ++j) {
    const KV* vr = vb + (c.slots[j] * s.Hkv + c.kh) * D;
    for (int64_t d = 0; d < D; ++d) row[d] = load(vr, d);
    for (int64_t g = 0; g < G; ++g) {
      const float w = p[g * len + j];
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += w * row[d];
    }
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))

// The key rows of keys j0..j0 + KJ - 1 of a chunk (the last key repeated past its end), their slots checked; in a
// cold chunk, the key and value rows kAhead keys on fetched meanwhile.
template <typename KV, int KJ>
inline void key_rows(const KV* kb, const KV* vb, const Chunk& c, const Shape& s, int64_t j0, const KV** kr) {
  const int64_t D = s.D, len = c.len;
  for (int kk = 0; kk < KJ; ++kk) {
    const int64_t slot = c.slots[std::min(j0 + kk, len - 1)];
    check_slot(slot, s.S);
    kr[kk] = kb + (slot * s.Hkv + c.kh) * D;
  }
  for (int64_t ja = j0 + kAhead; c.cold && ja < std::min(j0 + kAhead + KJ, len); ++ja) {
    prefetch_bytes(kb + (c.slots[ja] * s.Hkv + c.kh) * D, D * static_cast<int64_t>(sizeof(KV)), c.far);
    prefetch_bytes(vb + (c.slots[ja] * s.Hkv + c.kh) * D, D * static_cast<int64_t>(sizeof(KV)), c.far);
  }
}

#endif

#if defined(__AVX512F__)

template <typename KV, int G>
void chunk_avx512(const float* qf, const KV* kb, const KV* vb, const Chunk& c, const Shape& s, float* p, float* mx,
                  float* l, float* acc) {
  const int64_t D = s.D, len = c.len;
#if defined(__AVX512BF16__)
  // bfloat16 keys and a query that bfloat16 holds exactly (a bfloat16 model's, scaled by a power of two, as
  // Gemma's 1/16): `vdpbf16ps` takes 32 values a step, each product exact in float32, against 16 for the
  // converting loads and FMAs below.
  alignas(64) bf16 qh[8 * 256];
  bool exact = std::is_same<KV, bf16>::value && G * D <= 8 * 256 && D % 32 == 0;
  for (int64_t i = 0; exact && i < G * D; i += 16) {  // sixteen at a time: once per query row, ~1000 values
    const __m512 v = _mm512_loadu_ps(qf + i);
    store16(qh + i, v);
    exact = _mm512_cmp_ps_mask(load16(qh + i), v, _CMP_EQ_OQ) == 0xffff;
  }
#else
  constexpr bool exact = false;
#endif
  // Scores KJ keys at a time: the G x KJ = 16 dot products' vectors summed into one vector by `sum16` (about three
  // instructions a score, against nine for a reduction each); the last group repeats its last key.
  // Each lane's running maximum rides along (a repeated key's score is a real one); tanh, monotonic, maps the
  // maximum of the raw scores to that of the capped ones.
  constexpr int KJ = 16 / G;
  __m512 running = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = 0; j0 < len; j0 += KJ) {
    const KV* kr[KJ];
    key_rows<KV, KJ>(kb, vb, c, s, j0, kr);
    __m512 dot[16];
    for (int i = 0; i < 16; ++i) dot[i] = _mm512_setzero_ps();
    if (exact) {
#if defined(__AVX512BF16__)
      for (int64_t d = 0; d < D; d += 32) {
        for (int kk = 0; kk < KJ; ++kk) {
          const __m512bh k = (__m512bh)_mm512_loadu_si512(kr[kk] + d);
          for (int g = 0; g < G; ++g)
            dot[g * KJ + kk] = _mm512_dpbf16_ps(dot[g * KJ + kk], (__m512bh)_mm512_load_si512(qh + g * D + d), k);
        }
      }
#endif
    } else {
      for (int64_t d = 0; d < D; d += 16) {
        for (int kk = 0; kk < KJ; ++kk) {
          const __m512 k = load16(kr[kk] + d);
          for (int g = 0; g < G; ++g)
            dot[g * KJ + kk] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * D + d), k, dot[g * KJ + kk]);
        }
      }
    }
    alignas(64) float scores[16];
    const __m512 summed = sum16(dot);
    running = _mm512_max_ps(running, summed);
    _mm512_store_ps(scores, summed);
    const int64_t live = std::min<int64_t>(KJ, len - j0);
    if (s.softcap <= 0.f && live == KJ) {  // every key real, no capping: each head's scores copied as they are
      for (int g = 0; g < G; ++g) std::memcpy(p + g * len + j0, scores + g * KJ, KJ * sizeof(float));
      continue;
    }
    for (int g = 0; g < G; ++g) {
      for (int64_t kk = 0; kk < live; ++kk) {
        const float score = scores[g * KJ + kk];
        p[g * len + j0 + kk] = s.softcap > 0.f ? std::tanh(score * s.scaling / s.softcap) * s.softcap : score;
      }
    }
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, running);
  for (int g = 0; g < G; ++g) {
    float* pg = p + g * len;
    float top = -std::numeric_limits<float>::infinity();
    for (int kk = 0; kk < KJ; ++kk) top = std::max(top, lanes[g * KJ + kk]);
    if (s.softcap > 0.f && len > 0) top = std::tanh(top * s.scaling / s.softcap) * s.softcap;  // empty: stays -inf
    const __m512 t = _mm512_set1_ps(top);
    __m512 total = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(pg + j), t));
      _mm512_storeu_ps(pg + j, e);
      total = _mm512_add_ps(total, e);
    }
    if (j < len) {
      const __mmask16 tail = static_cast<__mmask16>((1u << (len - j)) - 1);
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, pg + j), t));
      _mm512_mask_storeu_ps(pg + j, tail, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(tail, e));
    }
    mx[g] = top;
    l[g] = _mm512_reduce_add_ps(total);
  }
#if defined(__AVX512BF16__)
  if (std::is_same<KV, bf16>::value && G <= 4 && D % 64 == 0) {
    values_bf16<G>(reinterpret_cast<const bf16*>(vb), c, s, p, acc);
    return;
  }
#endif
  if (G <= 4 && D % 64 == 0) {  // 64 values of every head's sums in registers, one pass over the keys each
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      __m512 a[G][4];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i) a[g][i] = _mm512_setzero_ps();
      for (int64_t j = 0; j < len; ++j) {
        const KV* vr = vb + (c.slots[j] * s.Hkv + c.kh) * D + d0;
        const __m512 v0 = load16(vr), v1 = load16(vr + 16), v2 = load16(vr + 32), v3 = load16(vr + 48);
        for (int g = 0; g < G; ++g) {
          const __m512 w = _mm512_set1_ps(p[g * len + j]);
          a[g][0] = _mm512_fmadd_ps(w, v0, a[g][0]);
          a[g][1] = _mm512_fmadd_ps(w, v1, a[g][1]);
          a[g][2] = _mm512_fmadd_ps(w, v2, a[g][2]);
          a[g][3] = _mm512_fmadd_ps(w, v3, a[g][3]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + g * D + d0 + 16 * i, a[g][i]);
    }
    return;
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t j = 0; j < len; ++j) {
    const KV* vr = vb + (c.slots[j] * s.Hkv + c.kh) * D;
    __m512 w[G];
    for (int g = 0; g < G; ++g) w[g] = _mm512_set1_ps(p[g * len + j]);
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 v = load16(vr + d);
      for (int g = 0; g < G; ++g) {
        float* a = acc + g * D + d;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(w[g], v, _mm512_loadu_ps(a)));
      }
    }
  }
}

#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)

// chunk_avx512's arithmetic eight lanes at a time, for CPUs with AVX2 but not AVX-512: the scores of all query heads
// of a kv head for 8/G keys at a time summed into one vector (`sum8`), the exponentials eight at a time, the values
// added into float32 sums held in registers (16 or 32 dims of every head a pass over the keys). A 600-token prompt's
// attention in per-query plain loops was a third of its prefill on a 2-core Zen 1 EPYC (the values' sums loaded
// and stored for every key, the exponentials one at a time).
template <typename KV, int G>
void chunk_avx2(const float* qf, const KV* kb, const KV* vb, const Chunk& c, const Shape& s, float* p, float* mx,
                float* l, float* acc) {
  const int64_t D = s.D, len = c.len;
  constexpr int KJ = 8 / G;
  __m256 running = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = 0; j0 < len; j0 += KJ) {
    const KV* kr[KJ];
    key_rows<KV, KJ>(kb, vb, c, s, j0, kr);
    __m256 dot[8];
    for (int i = 0; i < 8; ++i) dot[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      for (int kk = 0; kk < KJ; ++kk) {
        const __m256 k = load8(kr[kk] + d);
        for (int g = 0; g < G; ++g)
          dot[g * KJ + kk] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + d), k, dot[g * KJ + kk]);
      }
    }
    alignas(32) float scores[8];
    const __m256 summed = sum8(dot);
    running = _mm256_max_ps(running, summed);
    _mm256_store_ps(scores, summed);
    const int64_t live = std::min<int64_t>(KJ, len - j0);
    for (int g = 0; g < G; ++g) {
      for (int64_t kk = 0; kk < live; ++kk) {
        const float score = scores[g * KJ + kk];
        p[g * len + j0 + kk] = s.softcap > 0.f ? std::tanh(score * s.scaling / s.softcap) * s.softcap : score;
      }
    }
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, running);
  for (int g = 0; g < G; ++g) {
    float* pg = p + g * len;
    float top = -std::numeric_limits<float>::infinity();
    for (int kk = 0; kk < KJ; ++kk) top = std::max(top, lanes[g * KJ + kk]);
    if (s.softcap > 0.f && len > 0) top = std::tanh(top * s.scaling / s.softcap) * s.softcap;  // empty: stays -inf
    const __m256 t = _mm256_set1_ps(top);
    __m256 total = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
      const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(pg + j), t));
      _mm256_storeu_ps(pg + j, e);
      total = _mm256_add_ps(total, e);
    }
    if (j < len) {  // the tail through a padded copy: its padding's exponentials are 0
      alignas(32) float tail[8];
      std::fill(tail, tail + 8, -std::numeric_limits<float>::infinity());
      std::copy(pg + j, pg + len, tail);
      const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_load_ps(tail), t));
      _mm256_store_ps(tail, e);
      std::copy(tail, tail + (len - j), pg + j);
      total = _mm256_add_ps(total, e);
    }
    mx[g] = top;
    l[g] = lanes_sum8(total);
  }
  constexpr int NV = G <= 2 ? 4 : 2;  // registers of sums per head: 8 NV dims of every head a pass
  if (G <= 4 && D % (8 * NV) == 0) {
    for (int64_t d0 = 0; d0 < D; d0 += 8 * NV) {
      __m256 a[G][NV];
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < NV; ++i) a[g][i] = _mm256_setzero_ps();
      for (int64_t j = 0; j < len; ++j) {
        const KV* vr = vb + (c.slots[j] * s.Hkv + c.kh) * D + d0;
        __m256 v[NV];
        for (int i = 0; i < NV; ++i) v[i] = load8(vr + 8 * i);
        for (int g = 0; g < G; ++g) {
          const __m256 w = _mm256_broadcast_ss(p + g * len + j);
          for (int i = 0; i < NV; ++i) a[g][i] = _mm256_fmadd_ps(w, v[i], a[g][i]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + g * D + d0 + 8 * i, a[g][i]);
    }
    return;
  }
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t j = 0; j < len; ++j) {
    const KV* vr = vb + (c.slots[j] * s.Hkv + c.kh) * D;
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 v = load8(vr + d);
      for (int g = 0; g < G; ++g) {
        float* a = acc + g * D + d;
        _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * len + j), v, _mm256_loadu_ps(a)));
      }
    }
  }
}

#endif

// The chunk routine for this shape: vector code where it applies.
template <typename KV>
auto chunk_routine(const Shape& s) -> void (*)(const float*, const KV*, const KV*, const Chunk&, const Shape&, float*,
                                               float*, float*, float*) {
#if defined(__AVX512F__)
  if (s.D % 16 == 0) {
    switch (s.G) {
      case 1: return chunk_avx512<KV, 1>;
      case 2: return chunk_avx512<KV, 2>;
      case 4: return chunk_avx512<KV, 4>;
      case 8: return chunk_avx512<KV, 8>;
      default: break;
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (s.D % 8 == 0) {
    switch (s.G) {
      case 1: return chunk_avx2<KV, 1>;
      case 2: return chunk_avx2<KV, 2>;
      case 4: return chunk_avx2<KV, 4>;
      case 8: return chunk_avx2<KV, 8>;
      default: break;
    }
  }
#endif
  return chunk_plain<KV>;
}

inline void check_pools(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf) {
  check_float_or_bf16(q, "q");
  check_float_or_bf16(k_buf, "k_buf");
  check_float_or_bf16(v_buf, "v_buf");
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.sizes() == k_buf.sizes(),
              "q must be (B, H, D), k_buf and v_buf (S, Hkv, D) alike");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type(), "k_buf and v_buf must share a dtype");
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type(), "q and the KV buffers must share a dtype");
  TORCH_CHECK(k_buf.size(2) == q.size(2) && q.size(1) % k_buf.size(1) == 0, "head sizes disagree");
}

inline void check_int32(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous() && (n < 0 || t.numel() == n), what,
              " must be contiguous int32", n >= 0 ? " of the right length" : "");
}

}  // namespace attention
}  // namespace swa
