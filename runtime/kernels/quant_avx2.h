// The low-bit kernels over quant.cpp's layouts on AVX2 (with FMA and F16C), for CPUs without AVX512-VNNI: the same
// packed weights, the same activation blocks, the same sums. Included by quant_kernels.cpp in place of its AVX-512
// kernels; the entry points (`stream_rows`, `tiles`, `group_max`, `group_reaches`) have their signatures.
//
// AVX2 has no `vpdpbusd`. A 64-byte line (16 rows by 4 values) is two 32-byte halves of 8 rows each, and a half's
// four-value dot products are `vpmaddubsw` (unsigned bytes times signed bytes, adjacent pairs summed into 16 bits)
// then `vpmaddwd` by ones (pairs of those into 32 bits). The pair sums must not saturate 16 bits:
// - int8 weights are stored as w + 128 (0..255), and 255 * 127 * 2 would. So w is taken back (xor 0x80), its
//   magnitude (0..128) is the unsigned operand and the activation takes w's sign (`vpsignb`; activations lie in
//   -127..127, so negating one cannot overflow): at most 128 * 127 * 2 = 32512. Exact for every int8 weight, -128
//   too, and the sums start at zero (no +128 to take out). A kInt8Wide copy stores the magnitudes and the values
//   already (`kWideMagnitudes`), so its lines cost two loads and no instruction to take them apart;
// - int4 values (0..15) are unsigned already: 15 * 127 * 2 per pair, and a block's pairs, both nibbles', added in
//   16 bits before widening (at most 30480);
// - more lines are added in 16 bits before one widening where a copy's values allow it (`lines_in_16_bits`): a
//   narrow kInt8Block copy as w + 16 (stored so, `kNarrowStored`) against the activations as they are, a paired
//   kInt8Wide copy two lines.
// So the integer sums are the AVX-512 kernels' to the bit, and the float32 sums are built from them block by block in
// the same order (the activations' quantisation, quant.cpp, sums a block's own values in another order there).
//
// Registers: 16 of 32 bytes. A row's sums for a half-group take one register (8 columns), so the streaming kernel
// keeps for each row and half a float sum and an integer one: one row reads two groups (four halves) in lockstep,
// two rows one group, more rows one half at a time (the group's lines come back from L1 for the second half).

#pragma once

#include "quant.h"

#if defined(SWA_LOW_BIT_AVX2)

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "vecmath.h"

namespace swa {

inline __m256i broadcast_quad8(const int8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, 4);
  return _mm256_set1_epi32(quad);
}

// Eight float16 scales at index i of a scale array held as float* (its storage is float16).
inline __m256 load_halves8(const float* scales, int64_t i) {
  const uint16_t* halves = reinterpret_cast<const uint16_t*>(scales) + i;
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves)));
}

// The 8 scales of rows 8h..8h+7 of a (16 rows, block) whose 16 start at index i: float16 (kInt8Block), float32
// (kInt8Wide).
template <Format F>
inline __m256 block_scales8(const float* scales, int64_t i) {
  if constexpr (F == Format::kInt8Wide) return _mm256_loadu_ps(scales + i);
  else return load_halves8(scales, i);
}

// The 8 steps and offsets of rows 8h..8h+7 of the int4 (16 rows, block) `at`: float32, or float16 for kInt4Half.
template <Format F>
inline void int4_scales8(const float* scales, int64_t at, int h, __m256& step, __m256& low) {
  if constexpr (F == Format::kInt4Half) {
    step = load_halves8(scales, at * 32 + 8 * h);
    low = load_halves8(scales, at * 32 + 16 + 8 * h);
  } else {
    step = _mm256_loadu_ps(scales + at * 32 + 8 * h);
    low = _mm256_loadu_ps(scales + at * 32 + 16 + 8 * h);
  }
}

// The weights of one half-line, ready for every row's dot products: int8, the magnitudes and the values whose signs
// the activations take; int4, the low and high nibbles; a narrow kInt8Block copy's (`Deep`), w + 16 (0..32), the
// unsigned operand against the activations as they are (no sign to take: `add_block` takes 16 times the
// activations' block sum back out). A narrow copy and a kInt8Wide one are stored ready (quant.h, `kNarrowStored`,
// `kWideMagnitudes`): loads only.
struct HalfLine {
  __m256i a, b;
};

template <Format F, bool Deep>
constexpr bool offset_by_16() { return F == Format::kInt8Block && Deep; }

// Bytes a line takes in a copy of format F: a kInt8Wide line is its magnitudes then its values (`kWideMagnitudes`).
template <Format F>
constexpr int64_t line_bytes() { return F == Format::kInt8Wide ? 128 : 64; }

template <Format F, bool Deep>
inline HalfLine half_line(const uint8_t* at) {
  const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
  if constexpr (is_int4(F)) {
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    return {_mm256_and_si256(line, nibble), _mm256_and_si256(_mm256_srli_epi16(line, 4), nibble)};
  } else if constexpr (offset_by_16<F, Deep>()) {
    static_assert(kNarrowStored == kNarrowMax, "a narrow copy is stored as w + 16 on AVX2");
    return {line, line};
  } else if constexpr (F == Format::kInt8Wide) {
    static_assert(kWideMagnitudes, "a wide copy is stored as magnitudes then values on AVX2");
    return {line, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 64))};
  } else {
    const __m256i w = _mm256_xor_si256(line, _mm256_set1_epi8(static_cast<char>(0x80)));
    return {_mm256_abs_epi8(w), w};
  }
}

// The 8 rows' 16-bit pair sums of an int8 half-line against a row's activations at xb (its 4 values of this line), not
// yet widened: two products of at most 128 * 127 a lane (a narrow copy's, 32 * 127). int4's: `add_pairs`.
template <Format F, bool Deep>
inline __m256i pair_sums(const HalfLine& w, const int8_t* xb) {
  if constexpr (offset_by_16<F, Deep>()) {
    return _mm256_maddubs_epi16(w.a, broadcast_quad8(xb));
  } else {
    return _mm256_maddubs_epi16(w.a, _mm256_sign_epi8(broadcast_quad8(xb), w.b));
  }
}

// Keeps `v` where it is in the program: an empty asm that GCC must assume reads and changes it. Without it GCC
// reassociated a tile's 16-bit sums into trees, computing every product of a block first: an int4 tile's 32 of them
// (4 rows, 4 lines, 2 nibbles) overflowed AVX2's 16 registers and went to the stack and back. With it, on a 2-core
// Zen 1 EPYC: an int4 tile's loop 14% faster alone, the model's int4 projections and screened head 4-6%
// (docs/performance.md).
inline void in_order(__m256i& v) { __asm__("" : "+x"(v)); }

// pairs (16-bit pair sums so far; `first`: none yet) + a half-line's against a row's activations at xb (its 4 or 8
// values of this line), one chain in program order (`in_order`): int4's two nibbles one after the other, four
// products of at most 15 * 127 a lane.
// `Ordered` off (the streaming kernel): as GCC schedules it; kept in order there, batch-1 steps were ~12% slower.
template <Format F, bool Deep, bool Ordered = true>
inline void add_pairs(__m256i& pairs, const HalfLine& w, const int8_t* xb, bool first) {
  if constexpr (is_int4(F)) {
    const __m256i low = _mm256_maddubs_epi16(w.a, broadcast_quad8(xb));
    const __m256i high = _mm256_maddubs_epi16(w.b, broadcast_quad8(xb + 4));
    if constexpr (Ordered) {
      pairs = first ? low : _mm256_add_epi16(pairs, low);
      in_order(pairs);
      pairs = _mm256_add_epi16(pairs, high);
    } else {
      pairs = first ? _mm256_add_epi16(low, high) : _mm256_add_epi16(pairs, _mm256_add_epi16(low, high));
    }
  } else {
    const __m256i p = pair_sums<F, Deep>(w, xb);
    pairs = first ? p : _mm256_add_epi16(pairs, p);
  }
  if constexpr (Ordered) in_order(pairs);
}

// dot + pairs (16-bit pair sums) widened to the 8 rows' 32-bit sums: one `vpmaddwd` by ones.
inline __m256i widen_into(__m256i dot, __m256i pairs) {
  return _mm256_add_epi32(dot, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// Half-lines whose pair sums add up in 16 bits before one `vpmaddwd` widens them: on Zen 1 every integer multiply
// issues on one pipe, so each widening saved is a multiply saved. `Deep` selects a format's deeper sums where its
// copy allows them. The sums stay within 32767 against activations within -127..127:
// - int4 (0..15), always: a block's 4 lines, 16 products of at most 15 * 127 a lane (30480);
// - a narrow kInt8Block copy (`Projection::narrow`, weights within -16..16, a GGUF's Q5_0), as w + 16 (0..32): 4
//   lines, 8 products of at most 32 * 127 (32512);
// - a paired kInt8Wide copy (`Projection::paired`): 2 lines, the four weights behind each lane within kPairBudget;
// - else 1.
template <Format F>
constexpr int64_t lines_in_16_bits(bool deep) {
  if constexpr (is_int4(F)) return block_lines(F);
  else if constexpr (F == Format::kInt8Block) return deep ? 4 : 1;
  else if constexpr (F == Format::kInt8Wide) return deep ? 2 : 1;
  else return 1;
}

// acc + a block's integer sums (a narrow copy's less 16 times the activations' integer sum `xqsum`) scaled: by the
// activations' scale (kInt8, whose row scale comes at the end), times the weights' block scales (kInt8Block,
// kInt8Wide), or step times that plus offset times the activations' sum (int4).
template <Format F, bool Deep>
inline __m256 add_block(__m256 acc, __m256i dot, const float* scales, int64_t group, int64_t blocks, int64_t b, int h,
                        float xscale, float xsum, int32_t xqsum) {
  const __m256 sx = _mm256_set1_ps(xscale);
  if constexpr (offset_by_16<F, Deep>()) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(kNarrowMax * xqsum));
  if constexpr (F == Format::kInt8) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sx, acc);
  } else if constexpr (F == Format::kInt8Block || F == Format::kInt8Wide) {
    const __m256 ws = _mm256_mul_ps(block_scales8<F>(scales, (group * blocks + b) * 16 + 8 * h), sx);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), ws, acc);
  } else {
    __m256 step, low;
    int4_scales8<F>(scales, group * blocks + b, h, step, low);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(step, sx), acc);
    return _mm256_fmadd_ps(low, _mm256_set1_ps(xsum), acc);
  }
}

// Eight outputs (rows 8h..8h+7 of a group) of row m stored, the int8 format's row scales applied.
template <Format F, typename T>
inline void store_half(T* y, const float* scales, int64_t group, int h, __m256 out) {
  if constexpr (F == Format::kInt8) out = _mm256_mul_ps(out, _mm256_loadu_ps(scales + group * 16 + 8 * h));
  store8(y + group * 16 + 8 * h, out);
}

// Groups g0..g1 of 16 columns, or with `list` the groups list[g0..g1], G groups in lockstep (G separate streams of
// weights), each as H halves at once: H = 2 both halves of each line together, H = 1 one half then the other; `Deep`,
// as `lines_in_16_bits`.
template <Format F, typename T, int M, int G, int H, bool Deep>
void avx2_rows(const uint8_t* w, const float* scales, const QuantizedRows& x, T* y, int64_t N, int64_t g0, int64_t g1,
               const int64_t* list) {
  constexpr int64_t kValues = block_values(F), kLines = block_lines(F);
  constexpr int64_t kStep = is_int4(F) ? 8 : 4;  // activation values a line takes per row
  constexpr int64_t kDepth = lines_in_16_bits<F>(Deep);
  static_assert(kLines % kDepth == 0, "whole blocks");
  const int64_t K = x.K, blocks = K / kValues;
  const int64_t group_bytes = blocks * kLines * line_bytes<F>();
  const int8_t* xq = x.q.data();
  const int64_t per = (g1 - g0 + G - 1) / G;
  for (int64_t i = 0; i < per; ++i) {
    int64_t gs[G];
    int live = 0;
    for (int st = 0; st < G; ++st) {
      const int64_t g = g0 + st * per + i;
      if (g < g1) gs[live++] = list != nullptr ? list[g] : g;
    }
    for (int h0 = 0; h0 < 2; h0 += H) {
      __m256 acc[G][H][M];
      for (int st = 0; st < live; ++st)
        for (int h = 0; h < H; ++h)
          for (int m = 0; m < M; ++m) acc[st][h][m] = _mm256_setzero_ps();
      for (int64_t b = 0; b < blocks; ++b) {
        __m256i dot[G][H][M];
        for (int st = 0; st < live; ++st)
          for (int h = 0; h < H; ++h)
            for (int m = 0; m < M; ++m) dot[st][h][m] = _mm256_setzero_si256();
        for (int64_t j = 0; j < kLines; j += kDepth) {
          __m256i pairs[G][H][M];
          for (int64_t d = 0; d < kDepth; ++d) {
            for (int st = 0; st < live; ++st) {
              for (int h = 0; h < H; ++h) {
                const HalfLine line =
                    half_line<F, Deep>(w + gs[st] * group_bytes + (b * kLines + j + d) * line_bytes<F>() + (h0 + h) * 32);
                for (int m = 0; m < M; ++m)
                  add_pairs<F, Deep, false>(pairs[st][h][m], line, xq + m * K + b * kValues + (j + d) * kStep,
                                            d == 0);
              }
            }
          }
          for (int st = 0; st < live; ++st)
            for (int h = 0; h < H; ++h)
              for (int m = 0; m < M; ++m) dot[st][h][m] = widen_into(dot[st][h][m], pairs[st][h][m]);
        }
        for (int st = 0; st < live; ++st)
          for (int h = 0; h < H; ++h)
            for (int m = 0; m < M; ++m)
              acc[st][h][m] = add_block<F, Deep>(acc[st][h][m], dot[st][h][m], scales, gs[st], blocks, b, h0 + h,
                                                 x.scale[m * blocks + b], x.sum[m * blocks + b],
                                                 x.qsum[m * blocks + b]);
      }
      for (int st = 0; st < live; ++st)
        for (int h = 0; h < H; ++h)
          for (int m = 0; m < M; ++m) store_half<F>(y + m * N, scales, gs[st], h0 + h, acc[st][h][m]);
    }
  }
}

template <Format F, typename T, bool Deep>
void stream_rows_at(int64_t M, const uint8_t* w, const float* sc, const QuantizedRows& x, T* y, int64_t N, int64_t g0,
                    int64_t g1, const int64_t* list) {
  switch (M) {
    case 1: avx2_rows<F, T, 1, 2, 2, Deep>(w, sc, x, y, N, g0, g1, list); break;
    case 2: avx2_rows<F, T, 2, 1, 2, Deep>(w, sc, x, y, N, g0, g1, list); break;
    case 3: avx2_rows<F, T, 3, 1, 1, Deep>(w, sc, x, y, N, g0, g1, list); break;
    case 4: avx2_rows<F, T, 4, 1, 1, Deep>(w, sc, x, y, N, g0, g1, list); break;
    case 5: avx2_rows<F, T, 5, 1, 1, Deep>(w, sc, x, y, N, g0, g1, list); break;
    case 6: avx2_rows<F, T, 6, 1, 1, Deep>(w, sc, x, y, N, g0, g1, list); break;
    case 7: avx2_rows<F, T, 7, 1, 1, Deep>(w, sc, x, y, N, g0, g1, list); break;
    default: avx2_rows<F, T, 8, 1, 1, Deep>(w, sc, x, y, N, g0, g1, list); break;
  }
}

// The row count as a template argument, with the streams and halves the 16 registers allow for it. `narrow`: a
// kInt8Block copy's weights lie within -16..16 (`Projection::narrow`, `lines_in_16_bits`).
template <Format F, typename T>
void stream_rows(int64_t M, const uint8_t* w, const float* sc, const QuantizedRows& x, T* y, int64_t N, int64_t g0,
                 int64_t g1, const int64_t* list = nullptr, bool = false, bool narrow = false) {
  if (is_int4(F) || (F == Format::kInt8Block && narrow)) stream_rows_at<F, T, true>(M, w, sc, x, y, N, g0, g1, list);
  else stream_rows_at<F, T, false>(M, w, sc, x, y, N, g0, g1, list);
}

// Rows m0..m1 against groups g0..g1 in tiles of up to 4 rows by one half-group, whole K: a half-group's weights (at
// most 32 kB for K = 2048 in int8) stay in L1 while the rows go by; `Deep`, as `lines_in_16_bits`.
template <Format F, typename T, int MR, bool Deep>
void avx2_tile(const uint8_t* w, const float* scales, const QuantizedRows& x, int64_t m0, int64_t g, int h, T* y,
               int64_t N) {
  constexpr int64_t kValues = block_values(F), kLines = block_lines(F);
  constexpr int64_t kStep = is_int4(F) ? 8 : 4;
  constexpr int64_t kDepth = lines_in_16_bits<F>(Deep);
  static_assert(kLines % kDepth == 0, "whole blocks");
  const int64_t K = x.K, blocks = K / kValues;
  const uint8_t* wp = w + g * blocks * kLines * line_bytes<F>() + h * 32;
  const int8_t* xp = x.q.data() + m0 * K;
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, wp += kLines * line_bytes<F>(), xp += kValues) {
    __m256i dot[MR];
    for (int m = 0; m < MR; ++m) dot[m] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int64_t j = 0; j < kLines; j += kDepth) {
      __m256i pairs[MR];
      for (int64_t d = 0; d < kDepth; ++d) {
        const HalfLine line = half_line<F, Deep>(wp + (j + d) * line_bytes<F>());
        for (int m = 0; m < MR; ++m) add_pairs<F, Deep>(pairs[m], line, xp + m * K + (j + d) * kStep, d == 0);
      }
      for (int m = 0; m < MR; ++m) dot[m] = widen_into(dot[m], pairs[m]);
    }
    for (int m = 0; m < MR; ++m)
      acc[m] = add_block<F, Deep>(acc[m], dot[m], scales, g, blocks, b, h, x.scale[(m0 + m) * blocks + b],
                                  x.sum[(m0 + m) * blocks + b], x.qsum[(m0 + m) * blocks + b]);
  }
  for (int m = 0; m < MR; ++m) store_half<F>(y + (m0 + m) * N, scales, g, h, acc[m]);
}

template <Format F, typename T, bool Deep>
void tiles_at(const uint8_t* w, const float* sc, const QuantizedRows& x, int64_t m0, int64_t m1, int64_t g0,
              int64_t g1, T* y, int64_t N) {
  for (int64_t g = g0; g < g1; ++g) {
    for (int h = 0; h < 2; ++h) {
      int64_t m = m0;
      for (; m + 4 <= m1; m += 4) avx2_tile<F, T, 4, Deep>(w, sc, x, m, g, h, y, N);
      for (; m < m1; ++m) avx2_tile<F, T, 1, Deep>(w, sc, x, m, g, h, y, N);
    }
  }
}

// Rows m0..m1 against groups g0..g1. `narrow_or_paired`: a narrow kInt8Block or a paired kInt8Wide copy (`Deep`,
// `lines_in_16_bits`).
template <Format F, typename T>
void tiles(const uint8_t* w, const float* sc, const QuantizedRows& x, int64_t m0, int64_t m1, int64_t g0, int64_t g1,
           T* y, int64_t N, bool narrow_or_paired = false) {
  if (is_int4(F) || narrow_or_paired) tiles_at<F, T, true>(w, sc, x, m0, m1, g0, g1, y, N);
  else tiles_at<F, T, false>(w, sc, x, m0, m1, g0, g1, y, N);
}

// The largest of groups g0..g1's values (16 a group) of a row of outputs.
inline float group_max(const float* y, int64_t g0, int64_t g1) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = g0; g < g1; ++g)
    best = _mm256_max_ps(best, _mm256_max_ps(_mm256_loadu_ps(y + g * 16), _mm256_loadu_ps(y + g * 16 + 8)));
  float lanes[8];
  _mm256_storeu_ps(lanes, best);
  return *std::max_element(lanes, lanes + 8);
}

// Whether any of the 16 values at y reaches `floor`.
inline bool group_reaches(const float* y, float floor) {
  const __m256 f = _mm256_set1_ps(floor);
  const __m256 ge = _mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(y), f, _CMP_GE_OQ),
                                 _mm256_cmp_ps(_mm256_loadu_ps(y + 8), f, _CMP_GE_OQ));
  return _mm256_movemask_ps(ge) != 0;
}

}  // namespace swa

#endif  // SWA_LOW_BIT_AVX2
