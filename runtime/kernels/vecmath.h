// Vector code for the kernels: loads and stores of 16 values on AVX-512 (8 on AVX2, for CPUs without AVX-512), the
// exponential of softmax inputs, tanh for the GELU.

#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include "common.h"

namespace swa {

// Sixteen float32 or bfloat16 values as float32, and back (bfloat16 rounded to nearest even, NaN kept quiet, as
// `store` does).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

// e^x for x <= 0 (softmax inputs less their maximum): x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to
// r^6 (relative error below 2e-7), times 2^n; below -87 the result is 0 or a denormal, as the scalar exp's.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 y = _mm512_set1_ps(1.f / 720);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 120));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 24));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f / 6));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// tanh(x) = sign(x) (1 - e^-2|x|) / (1 + e^-2|x|): absolute error below 2e-7, which the GELU's output, rounded to
// bfloat16 (2^-9 relative), does not see.
inline __m512 tanh16(__m512 x) {
  const __m512 ax = _mm512_abs_ps(x);
  const __m512 e = exp_nonpositive(_mm512_mul_ps(ax, _mm512_set1_ps(-2.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t),
                                             _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN))));
}

// The sums of sixteen vectors, lane i holding v[i]'s: pairs interleaved and added, then pairs of pairs, then the four
// 128-bit quarters folded (45 instructions, where sixteen reductions take about 140).
inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int k = 0; k < 8; ++k)
    t[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int m = 0; m < 4; ++m) {
    const __m512d a = _mm512_castps_pd(t[2 * m]), b = _mm512_castps_pd(t[2 * m + 1]);
    u[m] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // u[m]'s quarter L holds quarter L's sums of v[4m..4m+3]; fold the quarters so that quarter m holds their totals.
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

}  // namespace swa

#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "common.h"

namespace swa {

// Eight float32 or bfloat16 values as float32, and back (bfloat16 rounded to nearest even, NaN kept quiet, as
// `store` does).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// Eight floats rounded to bfloat16 (to nearest even, NaN kept quiet), each in its lane's top 16 bits; the low 16 bits
// are left as they come.
inline __m256i bf16_in_high_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
  return _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
inline void store8(bf16* p, __m256 v) {
  const __m256i r = _mm256_srli_epi32(bf16_in_high_bits8(v), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

// e^x for x <= 0, as `exp_nonpositive` (the same series, relative error below 2e-7), times 2^n built in the exponent
// bits (AVX2 has no `scalef`): below -87.3, where e^x is no normal float, 0 (the scalar exp's denormals there are
// below 1.2e-38 of a softmax's largest weight, 1).
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 normal = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 y = _mm256_set1_ps(1.f / 720);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 120));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 24));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f / 6));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(0.5f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(bits)), normal);
}

// tanh as `tanh16`, eight at a time.
inline __m256 tanh8(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 ax = _mm256_andnot_ps(sign, x);
  const __m256 e = exp_nonpositive8(_mm256_mul_ps(ax, _mm256_set1_ps(-2.f)));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_or_ps(t, _mm256_and_ps(x, sign));
}

// The sums of eight vectors, lane i holding v[i]'s.
inline __m256 sum8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a holds v[0..3]'s sums of the low 128 bits, then of the high; b the same for v[4..7]
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// The sum of a vector's eight lanes.
inline float lanes_sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace swa

#endif
