// The low-bit kernels over quant.cpp's layouts, on AVX512-VNNI: up to 8 rows streamed (`Projection::run`: each
// thread walks S groups of rows in lockstep, so that S separate streams of weights are in flight: one stream per
// core reads at about half the memory's pace (16 GB/s for a 168 MB head with 2 threads on a Xeon), four at 36-40
// GB/s; four streams for one or two rows (on AMD, which reads ahead, two for two rows, and for one row one on Zen 5,
// four without read-ahead on Zen 4: `vnni_vendor`), two for three or four, one beyond, as the registers allow),
// more in tiles (`Projection::run_tiled`: 4 rows by 48 columns, one `vpdpbusd` for 64 multiply-adds, twice the rate
// of the bfloat16 `vdpbf16ps` that oneDNN's prepacked GEMM runs on; a tile's weights stay in the core's caches while
// its rows go by; with blocks of 128 (kInt8Wide), a quarter of the per-block scaling).

#include "quant.h"

#include <cpuid.h>

#include <algorithm>
#include <limits>

#include "quant_avx2.h"  // the AVX2 kernels, where the CPU has no AVX512-VNNI
#include "vecmath.h"

namespace swa {

#if defined(SWA_LOW_BIT_AVX512)

inline __m512i broadcast_quad(const int8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, 4);
  return _mm512_set1_epi32(quad);
}

// Sixteen float16 scales at index i of a per-block scale array (its storage handed around as float*).
inline __m512 load_halves(const float* scales, int64_t i) {
  const uint16_t* halves = reinterpret_cast<const uint16_t*>(scales) + i;
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves)));
}

// The 16 scales of an int8 (16 rows, block) at index i: float16 (kInt8Block) or float32 (kInt8Wide).
template <Format F>
inline __m512 block_scales(const float* scales, int64_t i) {
  if constexpr (F == Format::kInt8Wide) return _mm512_loadu_ps(scales + i);
  else return load_halves(scales, i);
}

// The 16 steps and 16 offsets of an int4 (16 rows, block) `at` (in (16 rows, block)s): float32, or float16 for
// kInt4Half.
template <Format F>
inline void int4_scales(const float* scales, int64_t at, __m512& step, __m512& low) {
  if constexpr (F == Format::kInt4Half) {
    step = load_halves(scales, at * 32);
    low = load_halves(scales, at * 32 + 16);
  } else {
    step = _mm512_loadu_ps(scales + at * 32);
    low = _mm512_loadu_ps(scales + at * 32 + 16);
  }
}

// Sixteen consecutive outputs (a group of columns), rounded as `store` rounds: in one vector store, not sixteen
// scalar roundings (those were a tenth of prefill's projections).
template <typename T>
inline void store_group(T* y, int64_t first, __m512 v) {
  store16(y + first, v);
}

// Lines a stream reads ahead with `prefetchnta` where `kAhead` (AMD, `vnni_vendor`), so that enough lines are in
// flight for the memory's pace (each core takes ~38 GB/s when the memory gives ~77, and the lines in flight a
// core needs grow with that pace). On a 2-core EPYC (family 26), batch-1 steps: 32 lines ahead against none, 5-10%
// faster at ~50 GB/s (`prefetcht1`: half the gain); 96 against 32, about 15% faster at ~75 GB/s (6.2-7.1 ->
// 5.2-5.6 ms, within the noise at 40-50 GB/s; 64 between them, 128 no better than 96).
constexpr int64_t kAheadLines = 96;

// Where a block's integer sums start: the int8 formats store w + 128, so their sums carry 128 times the sum of the
// block's activations, taken out by starting there below zero (the same integers as subtracting it after, without
// an instruction per sum); int4's offsets go through the float sums instead.
template <Format F>
inline __m512i start_sums(const QuantizedRows& x, int64_t block) {
  if constexpr (is_int4(F)) return _mm512_setzero_si512();
  else return _mm512_set1_epi32(-128 * x.qsum[block]);
}

// Groups g0..g1 of 16 columns, or with `list` the groups list[g0..g1] (refine's scattered ones), in S streams.
template <Format F, typename T, int M, int S, bool kAhead>
void vnni_rows(const uint8_t* w, const float* scales, const QuantizedRows& x, T* y, int64_t N, int64_t g0,
               int64_t g1, const int64_t* list) {
  constexpr int64_t kValues = block_values(F), kLines = block_lines(F);  // a block's values; its lines a 16 rows
  const int64_t K = x.K, blocks = K / kValues;
  const int64_t group_bytes = blocks * kLines * 64;
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const int8_t* xq = x.q.data();
  const int64_t per = (g1 - g0 + S - 1) / S;
  for (int64_t i = 0; i < per; ++i) {
    int64_t gs[S];
    int live = 0;
    for (int st = 0; st < S; ++st) {
      const int64_t g = g0 + st * per + i;
      if (g < g1) gs[live++] = list != nullptr ? list[g] : g;
    }
    __m512 acc[S][M];
    for (int st = 0; st < live; ++st)
      for (int m = 0; m < M; ++m) acc[st][m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i dot[S][M];  // the int8 formats' +128 taken out up front (`start_sums`)
      for (int m = 0; m < M; ++m) {
        const __m512i start = start_sums<F>(x, m * blocks + b);
        for (int st = 0; st < live; ++st) dot[st][m] = start;
      }
      for (int64_t j = 0; j < kLines; ++j) {
        for (int st = 0; st < live; ++st) {
          const uint8_t* at = w + gs[st] * group_bytes + (b * kLines + j) * 64;
          if constexpr (kAhead)  // an address past the weights is harmless: a prefetch never faults
            _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(at) + kAheadLines * 64),
                         _MM_HINT_NTA);
          const __m512i line = _mm512_loadu_si512(at);
          if constexpr (!is_int4(F)) {
            for (int m = 0; m < M; ++m)
              dot[st][m] = _mm512_dpbusd_epi32(dot[st][m], line, broadcast_quad(xq + m * K + b * kValues + j * 4));
          } else {
            const __m512i lo = _mm512_and_si512(line, nibble);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(line, 4), nibble);
            for (int m = 0; m < M; ++m) {
              const int8_t* xb = xq + m * K + b * kValues + j * 8;
              dot[st][m] = _mm512_dpbusd_epi32(dot[st][m], lo, broadcast_quad(xb));
              dot[st][m] = _mm512_dpbusd_epi32(dot[st][m], hi, broadcast_quad(xb + 4));
            }
          }
        }
      }
      if constexpr (F == Format::kInt8) {
        for (int m = 0; m < M; ++m) {
          const __m512 sx = _mm512_set1_ps(x.scale[m * blocks + b]);
          for (int st = 0; st < live; ++st)
            acc[st][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[st][m]), sx, acc[st][m]);
        }
      } else if constexpr (F == Format::kInt8Block || F == Format::kInt8Wide) {
        for (int st = 0; st < live; ++st) {
          const __m512 ws = block_scales<F>(scales, (gs[st] * blocks + b) * 16);
          for (int m = 0; m < M; ++m) {
            const __m512 sx = _mm512_mul_ps(ws, _mm512_set1_ps(x.scale[m * blocks + b]));
            acc[st][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[st][m]), sx, acc[st][m]);
          }
        }
      } else {
        for (int st = 0; st < live; ++st) {
          __m512 step, low;
          int4_scales<F>(scales, gs[st] * blocks + b, step, low);
          for (int m = 0; m < M; ++m) {
            const __m512 sx = _mm512_mul_ps(step, _mm512_set1_ps(x.scale[m * blocks + b]));
            acc[st][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[st][m]), sx, acc[st][m]);
            acc[st][m] = _mm512_fmadd_ps(low, _mm512_set1_ps(x.sum[m * blocks + b]), acc[st][m]);
          }
        }
      }
    }
    for (int st = 0; st < live; ++st) {
      for (int m = 0; m < M; ++m) {
        __m512 out = acc[st][m];
        if constexpr (F == Format::kInt8) out = _mm512_mul_ps(out, _mm512_loadu_ps(scales + gs[st] * 16));
        store_group(y + m * N, gs[st] * 16, out);
      }
    }
  }
}

// The streaming kernels' choices by kind of CPU, each measured on one kind only. Intel: four streams a thread for
// one or two rows (a Xeon read a 168 MB head at 36-40 GB/s with four, 16 with one), no read-ahead. AMD: every
// stream reads ahead (`kAheadLines`; a batch-1 step 5-10% further, the head at four and eight rows 10-20%), and
// with that two streams a thread for two rows, where four crowd its prefetchers. For one row the two AMD families
// measured part ways:
// - Zen 5 (family 0x1A, a 2-core EPYC): one stream reading ahead. Batch-1 steps alternated with two streams inside
//   one process, rounds paired: 7-13% faster when the memory gives 70-80 GB/s (median ratio to the floor 1.37
//   against 1.48, 1.33 against 1.52), 1-2% slower at 40-50 (within the noise); 128 lines ahead as good as 96, 160
//   and 256 worse (1.6x) at 70-80 GB/s.
// - Zen 4 (family 0x19, a 2-core EPYC): four streams without read-ahead, as on Intel. The head alone at 0.93-0.95
//   of the probed bandwidth against 0.76-0.78 at ~33 GB/s, 0.77-0.82 against 0.53 at ~57; batch-1 steps alternated
//   inside one process, 12 rounds at 57-66 GB/s: median 1.67x the floor against 2.24x. Reading ahead with four
//   streams (16, 32 or 96 lines) or two streams without it: 2-15% slower heads. At two to eight rows the AMD
//   setting above stays ahead (the head at 0.81 against 0.64 of the probe at two rows, 0.51 against 0.41 at eight).
//   A weight in 2 MB pages (`Projection::place`) and long (`kLongStream`: an LM head) reads as Zen 5 does instead: one
//   stream reading ahead. Weights in one arena of 2 MB pages, batch-1 steps alternated inside one process, rounds
//   grouped by the probe: the screened head 58.6 against 43.9 GB/s when the memory gives ~60 (35.3 against 32.9 at
//   ~35), the step 6.32 against 6.84 ms; the layers' projections (at most 2.8 MB) 37.6 against 41.8 GB/s, so they
//   keep four streams.
inline int amd_family() {  // 0 when not AMD
  static const int family = [] {
    if (!__builtin_cpu_is("amd")) return 0;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 0;
    const unsigned base = (eax >> 8) & 0xf;
    return static_cast<int>(base == 0xf ? base + ((eax >> 20) & 0xff) : base);
  }();
  return family;
}

template <Format F, typename T, int M, int S>
void vnni_vendor(const uint8_t* w, const float* sc, const QuantizedRows& x, T* y, int64_t N, int64_t g0,
                 int64_t g1, const int64_t* list, bool long_stream) {
  const int family = amd_family();
  if (family == 0 || (M == 1 && family < 0x1a && !long_stream))
    vnni_rows<F, T, M, S, false>(w, sc, x, y, N, g0, g1, list);
  else vnni_rows<F, T, M, (M == 1 ? 1 : S > 2 ? 2 : S), true>(w, sc, x, y, N, g0, g1, list);
}

// The row count as a template argument, with the streams the registers allow for it. (The last argument is the AVX2
// kernels'.)
template <Format F, typename T>
void stream_rows(int64_t M, const uint8_t* w, const float* sc, const QuantizedRows& x, T* y, int64_t N,
                   int64_t g0, int64_t g1, const int64_t* list = nullptr, bool long_stream = false, bool = false) {
  switch (M) {
    case 1: vnni_vendor<F, T, 1, 4>(w, sc, x, y, N, g0, g1, list, long_stream); break;
    case 2: vnni_vendor<F, T, 2, 4>(w, sc, x, y, N, g0, g1, list, long_stream); break;
    case 3: vnni_vendor<F, T, 3, 2>(w, sc, x, y, N, g0, g1, list, long_stream); break;
    case 4: vnni_vendor<F, T, 4, 2>(w, sc, x, y, N, g0, g1, list, long_stream); break;
    case 5: vnni_vendor<F, T, 5, 1>(w, sc, x, y, N, g0, g1, list, long_stream); break;
    case 6: vnni_vendor<F, T, 6, 1>(w, sc, x, y, N, g0, g1, list, long_stream); break;
    case 7: vnni_vendor<F, T, 7, 1>(w, sc, x, y, N, g0, g1, list, long_stream); break;
    default: vnni_vendor<F, T, 8, 1>(w, sc, x, y, N, g0, g1, list, long_stream); break;
  }
}

// A tile of MR rows by NR groups of 16 columns, whole K: per block of 32 values the integer sums of each (row, column),
// then scaled into float32 sums; the weights of the NR groups are read once for the MR rows. With `next`, the three
// groups from there on are fetched into L2 meanwhile, the blocks b with b % parts == part (`tiles`).
template <Format F, typename T, int MR, int NR>
void tile(const uint8_t* w, const float* scales, const QuantizedRows& x, int64_t m0, int64_t g0, T* y, int64_t N,
          const uint8_t* next = nullptr, int64_t part = 0, int64_t parts = 1) {
  constexpr int64_t kValues = block_values(F), kLines = block_lines(F);
  const int64_t K = x.K, blocks = K / kValues;
  const int64_t group_bytes = blocks * kLines * 64;
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  // Pointers walked block by block and the lines of a block unrolled, so that a block's loads take constant offsets:
  // with indices recomputed a line, the loop carried its sums through register copies (3-4% slower, prefill's
  // projections in one process alternated on a 2-core Zen 4 EPYC; int4 8%).
  const uint8_t* wp = w + g0 * group_bytes;
  const int8_t* xp = x.q.data() + m0 * K;
  const float* xscale = x.scale.data() + m0 * blocks;
  const float* xsum = x.sum.data() + m0 * blocks;
  __m512 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, wp += kLines * 64, xp += kValues) {
    const bool fetch = next != nullptr && b % parts == part;
    __m512i dot[MR][NR];
    for (int m = 0; m < MR; ++m) {
      const __m512i start = start_sums<F>(x, (m0 + m) * blocks + b);
      for (int n = 0; n < NR; ++n) dot[m][n] = start;
    }
#pragma GCC unroll 8
    for (int64_t j = 0; j < kLines; ++j) {
      __m512i lines[NR];
      for (int n = 0; n < NR; ++n) lines[n] = _mm512_loadu_si512(wp + n * group_bytes + j * 64);
      if (fetch)  // past the weights is harmless: a prefetch never faults
        for (int n = 0; n < 3; ++n)
          _mm_prefetch(reinterpret_cast<const char*>(next + n * group_bytes + (b * kLines + j) * 64), _MM_HINT_T1);
      if constexpr (!is_int4(F)) {
        for (int m = 0; m < MR; ++m) {
          const __m512i xb = broadcast_quad(xp + m * K + j * 4);
          for (int n = 0; n < NR; ++n) dot[m][n] = _mm512_dpbusd_epi32(dot[m][n], lines[n], xb);
        }
      } else {
        __m512i lo[NR], hi[NR];
        for (int n = 0; n < NR; ++n) {
          lo[n] = _mm512_and_si512(lines[n], nibble);
          hi[n] = _mm512_and_si512(_mm512_srli_epi16(lines[n], 4), nibble);
        }
        for (int m = 0; m < MR; ++m) {
          const __m512i xl = broadcast_quad(xp + m * K + j * 8);
          const __m512i xh = broadcast_quad(xp + m * K + j * 8 + 4);
          for (int n = 0; n < NR; ++n) {
            dot[m][n] = _mm512_dpbusd_epi32(dot[m][n], lo[n], xl);
            dot[m][n] = _mm512_dpbusd_epi32(dot[m][n], hi[n], xh);
          }
        }
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 sx = _mm512_set1_ps(xscale[m * blocks + b]);
      if constexpr (F == Format::kInt8) {
        for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][n]), sx, acc[m][n]);
      } else if constexpr (F == Format::kInt8Block || F == Format::kInt8Wide) {
        for (int n = 0; n < NR; ++n) {
          const __m512 ws = _mm512_mul_ps(block_scales<F>(scales, ((g0 + n) * blocks + b) * 16), sx);
          acc[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][n]), ws, acc[m][n]);
        }
      } else {
        const __m512 total = _mm512_set1_ps(xsum[m * blocks + b]);
        for (int n = 0; n < NR; ++n) {
          __m512 step, low;
          int4_scales<F>(scales, (g0 + n) * blocks + b, step, low);
          acc[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][n]), _mm512_mul_ps(step, sx), acc[m][n]);
          acc[m][n] = _mm512_fmadd_ps(low, total, acc[m][n]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int n = 0; n < NR; ++n) {
      __m512 out = acc[m][n];
      if constexpr (F == Format::kInt8) out = _mm512_mul_ps(out, _mm512_loadu_ps(scales + (g0 + n) * 16));
      store_group(y + (m0 + m) * N, (g0 + n) * 16, out);
    }
  }
}

// Rows m0..m1 against groups g0..g1, in tiles of 4 rows by 3 groups (fewer at the edges). The tiles over three groups
// fetch the next three into L2 meanwhile, each its share of their blocks (`part` of `parts`): where the weights come
// from memory (an LM head at 9 or 16 rows, 168 MB) that hides the reads behind the work. On a 2-core Zen 4 EPYC, all
// fetched by the first tile: 12-14% faster than none; shared among the tiles: a further 10% at 9 and 16 rows, 4.5% at
// 32 (likely because the first tile alone issued more fetches than a core keeps in flight). Prefill's layer weights,
// read from L3: no faster either way; into L1 10% slower, six groups ahead no better. (The last argument is the AVX2
// kernels': `vpdpbusd` widens as it multiplies.)
template <Format F, typename T>
void tiles(const uint8_t* w, const float* sc, const QuantizedRows& x, int64_t m0, int64_t m1, int64_t g0, int64_t g1,
           T* y, int64_t N, bool = false) {
  const int64_t group_bytes = x.K / block_values(F) * block_lines(F) * 64;
  for (int64_t g = g0; g < g1; g += 3) {
    const int64_t ng = std::min<int64_t>(3, g1 - g);
    const uint8_t* next = g + 3 < N / 16 ? w + (g + 3) * group_bytes : nullptr;
    const int64_t quads = (m1 - m0) / 4, parts = quads + (m0 + 4 * quads < m1);  // the tiles over these groups
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4) {
      if (ng == 3) tile<F, T, 4, 3>(w, sc, x, m, g, y, N, next, (m - m0) / 4, parts);
      else if (ng == 2) tile<F, T, 4, 2>(w, sc, x, m, g, y, N);
      else tile<F, T, 4, 1>(w, sc, x, m, g, y, N);
    }
    for (; m < m1; ++m) {
      const uint8_t* fetch = m == m0 + 4 * quads ? next : nullptr;  // the first of the rows left: the last part
      if (ng == 3) tile<F, T, 1, 3>(w, sc, x, m, g, y, N, fetch, quads, parts);
      else if (ng == 2) tile<F, T, 1, 2>(w, sc, x, m, g, y, N);
      else tile<F, T, 1, 1>(w, sc, x, m, g, y, N);
    }
  }
}

// The largest of groups g0..g1's values (16 a group) of a row of outputs.
inline float group_max(const float* y, int64_t g0, int64_t g1) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = g0; g < g1; ++g) best = _mm512_max_ps(best, _mm512_loadu_ps(y + g * 16));
  return _mm512_reduce_max_ps(best);
}

// Whether any of the 16 values at y reaches `floor`.
inline bool group_reaches(const float* y, float floor) {
  return _mm512_cmp_ps_mask(_mm512_loadu_ps(y), _mm512_set1_ps(floor), _CMP_GE_OQ) != 0;
}

#endif  // SWA_LOW_BIT_AVX512 (the AVX2 kernels: quant_avx2.h)

#if defined(SWA_LOW_BIT_AVX512) || defined(SWA_LOW_BIT_AVX2)

template <typename T>
void Projection::run_tiled(const QuantizedRows& x, T* y) const {
  TORCH_CHECK(x.K == K_ && x.M >= 1 && x.block == block_values(format_), "activations must be (M, ", K_,
              ") in blocks of ", block_values(format_));
  const uint8_t* w = packed_.data_ptr<uint8_t>();
  const float* sc = static_cast<const float*>(scales_.data_ptr());  // float16 for kInt8Block, kInt4Half
  // Blocks of 32 rows, each against every column, the groups in chunks whose weights stay in the core's cache
  // while the block's rows go by.
  constexpr int64_t kRowBlock = 32, kGroupChunk = 12;
  const int64_t groups = N_ / 16, row_blocks = (x.M + kRowBlock - 1) / kRowBlock;
  const int64_t chunks = (groups + kGroupChunk - 1) / kGroupChunk;
  at::parallel_for(0, row_blocks * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t rb = i / chunks, c = i % chunks;
      const int64_t m0 = rb * kRowBlock, m1 = std::min(x.M, m0 + kRowBlock);
      const int64_t g0 = c * kGroupChunk, g1 = std::min(groups, g0 + kGroupChunk);
      const bool deep = narrow_ || paired_;  // AVX2: a block's or two lines' pair sums in 16 bits (quant_avx2.h)
      switch (format_) {
        case Format::kInt8: tiles<Format::kInt8>(w, sc, x, m0, m1, g0, g1, y, N_, deep); break;
        case Format::kInt8Block: tiles<Format::kInt8Block>(w, sc, x, m0, m1, g0, g1, y, N_, deep); break;
        case Format::kInt4: tiles<Format::kInt4>(w, sc, x, m0, m1, g0, g1, y, N_, deep); break;
        case Format::kInt4Half: tiles<Format::kInt4Half>(w, sc, x, m0, m1, g0, g1, y, N_, deep); break;
        case Format::kInt8Wide: tiles<Format::kInt8Wide>(w, sc, x, m0, m1, g0, g1, y, N_, deep); break;
      }
    }
  });
}

template <typename T>
void Projection::run(const QuantizedRows& x, T* y) const {
  TORCH_CHECK(x.K == K_ && x.M >= 1 && x.M <= kMaxRows && x.block == block_values(format_), "activations must be (M, ",
              K_, ") with M in 1..8, in blocks of ", block_values(format_));
  const uint8_t* w = packed_.data_ptr<uint8_t>();
  const float* sc = static_cast<const float*>(scales_.data_ptr());  // float16 for kInt8Block, kInt4Half
  const bool long_stream = huge_pages_ && packed_.numel() >= kLongStream;
  at::parallel_for(0, N_ / 16, 8, [&](int64_t g0, int64_t g1) {
    auto rows = [&](auto format) {
      stream_rows<decltype(format)::value>(x.M, w, sc, x, y, N_, g0, g1, nullptr, long_stream, narrow_);
    };
    switch (format_) {
      case Format::kInt8: rows(std::integral_constant<Format, Format::kInt8>{}); break;
      case Format::kInt8Block: rows(std::integral_constant<Format, Format::kInt8Block>{}); break;
      case Format::kInt4: rows(std::integral_constant<Format, Format::kInt4>{}); break;
      case Format::kInt4Half: rows(std::integral_constant<Format, Format::kInt4Half>{}); break;
      case Format::kInt8Wide: rows(std::integral_constant<Format, Format::kInt8Wide>{}); break;
    }
  });
}

// The screen's rows scanned twice: each row's largest value (in pieces, one maximum a piece and row), then the groups
// of 16 columns holding a value at or above that less the margin. The streaming kernel recomputes a row's groups from
// its own list, the row alone, with the same instructions in the same order as `run` (the sums are `matmul`'s to the
// bit at any row count: the kernels add a row's blocks in the same order), over the screen's values in place. A row
// with more than half its groups near its top (a flat row) is recomputed whole instead, the flat rows together as
// `matmul` takes that many: a list of most groups read ~20% slower than all of them in order (a 2-core Zen 4 EPYC,
// Gemma 3 270M's head: 95% of the groups listed 4.6-6.4 ms, all 4.0-4.1), and a row alone reads the whole weight for
// itself (a 2-core Zen 1 EPYC: 9.3 ms a row alone, 6.1 a row at 8 rows). Lists per row, not one for all: a decode
// batch's rows peak at different tokens, and one flat row would otherwise refine every group of every row.
int64_t Projection::refine_groups(const QuantizedRows& x, float* y, float margin) const {
  const int64_t M = x.M, N = N_, groups = N_ / 16;
  constexpr int64_t kPieces = 64;
  std::vector<float> top(kPieces * M, -std::numeric_limits<float>::infinity());
  at::parallel_for(0, kPieces, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t g0 = groups * p / kPieces, g1 = groups * (p + 1) / kPieces;
      for (int64_t m = 0; m < M; ++m) top[p * M + m] = group_max(y + m * N, g0, g1);
    }
  });
  std::vector<float> floor(M);
  for (int64_t m = 0; m < M; ++m) {
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < kPieces; ++p) best = std::max(best, top[p * M + m]);
    floor[m] = best - margin;
  }
  std::vector<uint8_t> near(M * groups);
  at::parallel_for(0, M * groups, 2048, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / groups;
      near[i] = group_reaches(y + m * N + (i % groups) * 16, floor[m]);
    }
  });
  std::vector<std::vector<int64_t>> chosen(M);
  std::vector<int64_t> flat;
  struct Piece {
    int64_t row, i0, i1;  // the row's list[i0..i1]
  };
  std::vector<Piece> pieces;
  constexpr int64_t kPieceGroups = 16;
  int64_t refined = 0;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g)
      if (near[m * groups + g]) chosen[m].push_back(g);
    const int64_t n = static_cast<int64_t>(chosen[m].size());
    if (2 * n > groups) {
      flat.push_back(m);
      refined += groups;
      continue;
    }
    refined += n;
    for (int64_t i = 0; i < n; i += kPieceGroups) pieces.push_back({m, i, std::min(n, i + kPieceGroups)});
  }
  auto whole = [&](const QuantizedRows& rows, float* out) {  // as `matmul` takes that many rows on this copy
    if (rows.M <= kMaxRows && !rows_in_tiles(rows.M)) run(rows, out);
    else run_tiled(rows, out);
  };
  if (static_cast<int64_t>(flat.size()) == M) {
    whole(x, y);
  } else if (!flat.empty()) {
    std::vector<float> yf(flat.size() * N);
    whole(x.rows(flat), yf.data());
    for (size_t f = 0; f < flat.size(); ++f) std::copy(yf.begin() + f * N, yf.begin() + (f + 1) * N, y + flat[f] * N);
  }
  std::vector<QuantizedRows> taken(M);  // a listed row's activations alone (the row itself where there is one)
  std::vector<const QuantizedRows*> alone(M, &x);
  for (const Piece& pc : pieces)
    if (M > 1 && pc.i0 == 0) alone[pc.row] = &(taken[pc.row] = x.rows({pc.row}));
  const uint8_t* w = packed_.data_ptr<uint8_t>();
  const float* sc = static_cast<const float*>(scales_.data_ptr());
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const Piece& pc = pieces[p];
      const QuantizedRows& xr = *alone[pc.row];
      float* yr = y + pc.row * N;
      const int64_t* list = chosen[pc.row].data();
      if (format_ == Format::kInt8Block)
        stream_rows<Format::kInt8Block>(1, w, sc, xr, yr, N, pc.i0, pc.i1, list, false, narrow_);
      else if (format_ == Format::kInt8Wide) stream_rows<Format::kInt8Wide>(1, w, sc, xr, yr, N, pc.i0, pc.i1, list);
      else stream_rows<Format::kInt8>(1, w, sc, xr, yr, N, pc.i0, pc.i1, list);
    }
  });
  return refined;
}

#else

int64_t Projection::refine_groups(const QuantizedRows&, float*, float) const {
  TORCH_CHECK(false, "built without AVX512-VNNI or AVX2: the low-bit kernels are unavailable (see has_low_bit)");
}

template <typename T>
void Projection::run(const QuantizedRows&, T*) const {
  TORCH_CHECK(false, "built without AVX512-VNNI or AVX2: the low-bit kernels are unavailable (see has_low_bit)");
}

template <typename T>
void Projection::run_tiled(const QuantizedRows&, T*) const {
  TORCH_CHECK(false, "built without AVX512-VNNI or AVX2: the low-bit kernels are unavailable (see has_low_bit)");
}

#endif

template void Projection::run<float>(const QuantizedRows&, float*) const;
template void Projection::run<bf16>(const QuantizedRows&, bf16*) const;
template void Projection::run_tiled<float>(const QuantizedRows&, float*) const;
template void Projection::run_tiled<bf16>(const QuantizedRows&, bf16*) const;

}  // namespace swa
