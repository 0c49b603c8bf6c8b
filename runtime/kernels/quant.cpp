// Low-bit projections on AVX512-VNNI, decode's few rows and prefill's many.
//
// A decode step multiplies a few rows by every weight once, so a projection costs what reading its bytes
// costs. The activations are quantised per block of 32 values (symmetric int8, one float scale a block, as
// llama.cpp's Q8 blocks), so that each 64-byte line of weights is one or two `vpdpbusd` (16 rows x 4 values):
// few instructions per byte, and the pass over the weights runs at the memory's pace (torch's int8 kernel
// converts every weight to float and streamed at half of it; its int4 kernel at a third).
//
// Layouts, made once at load (`Projection::int8`, `Projection::int4`), in groups of 16 rows:
// - int8: per block of 32 values, 8 lines; line j holds, for each of the 16 rows in turn, its values 4j..4j+3
//   stored as w + 128 (unsigned, what the instruction's first operand takes); the 128 comes back out through
//   each activation block's sum. One float scale a row, or one float16 per row and block (a GGUF's Q5_0 and Q8_0
//   tensors are int8 values times a float16 scale per block of 32: used exactly, in 8.5 bits a weight, Q8_0's
//   own size), 16 of them per (16 rows, block).
// - int4 (a GGUF's Q4_K tensors, exactly: 16 levels `low + step * q` per group of 32): per block, 4 lines;
//   line j holds for each row 4 bytes, values 8j..8j+3 in the low nibbles and 8j+4..8j+7 in the high ones.
//   The group's step and low are float32, 16 steps then 16 lows per (16 rows, block), so nothing is rounded:
//   y = sum over blocks of step * xscale * (q . xq) + low * (sum of the block's activations). A screen's coarse
//   copy (`half_scales`, kInt4Half) keeps them as float16 instead: 64 bytes a (16 rows, block), not 128.
// - int8 in blocks of 128 (kInt8Wide, `Projection::int8_wide`): the int8 lines, one float32 scale per row and block of
//   128, the activations quantised per 128 values too. Prefill's tiles are bound by the `vpdpbusd` port, and each
//   block's scaling (convert, multiply, add: two of them on that port) came once per 8 `vpdpbusd`s with blocks of
//   32: 80% of the port's rate in a tile whose data sit in L1, 93% with blocks of 128 (a 2-core Zen 4 EPYC). A
//   projection's copy for rows past eight (`set_tiles`), requantised from the GGUF's values at load. Smoothed
//   (`smooth`): a few activation columns are tens of times their neighbours', and one such value in a block of 128
//   sets the block's scale alone; the copy holds W * s and the activations are multiplied by 1 / s as they are
//   quantised (`QuantizedRows::quantize`), s chosen from the activations' and the weight's column maxima. Paired
//   (`paired`, found here from the values): every four weights of a row that one 16-bit sum of the AVX2 tiles holds
//   add up to at most kPairBudget, and those tiles then take two lines a step (quant_avx2.h, `lines_in_16_bits`).
// - Narrow (`narrow`, a kInt8Block copy whose weights lie within -kNarrowMax..kNarrowMax, as a GGUF's Q5_0 values):
//   the AVX2 kernels add four lines' pair sums in 16 bits before widening them (quant_avx2.h, `lines_in_16_bits`).
// - On AVX2 a narrow copy stores w + 16 and a kInt8Wide copy each line's magnitudes beside its values (quant.h,
//   `kNarrowStored`, `kWideMagnitudes`): the bytes its kernels take, nothing to undo a line.
//
// This file: the activations' quantisation, the packing, the entry point; the kernels are in quant_kernels.cpp.

#include "quant.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "vecmath.h"

namespace swa {

// One block of B values (32 or 128), each times `mul`'s where it is not null: symmetric int8 by its largest magnitude
// (round half to even), its scale, the sum of its int8 values and of its own values.
template <int64_t B, typename T>
inline void quantize_block(const T* v, const float* mul, int8_t* q, float* scale, int32_t* qsum, float* sum) {
#if defined(__AVX512F__)
  constexpr int64_t V = B / 16;
  __m512 a[V];
  __m512 top16 = _mm512_setzero_ps();
  for (int64_t i = 0; i < V; ++i) {
    a[i] = load16(v + 16 * i);
    if (mul != nullptr) a[i] = _mm512_mul_ps(a[i], _mm512_loadu_ps(mul + 16 * i));
    top16 = _mm512_max_ps(top16, _mm512_abs_ps(a[i]));
  }
  const float top = _mm512_reduce_max_ps(top16);
  const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
  __m512i qs = _mm512_setzero_si512();
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < V; ++i) {
    const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(a[i], inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * i), _mm512_cvtepi32_epi8(qi));
    qs = _mm512_add_epi32(qs, qi);
    total = _mm512_add_ps(total, a[i]);
  }
  *scale = top / 127.f;
  *qsum = _mm512_reduce_add_epi32(qs);
  *sum = _mm512_reduce_add_ps(total);
#else
  auto value = [&](int64_t i) { return mul != nullptr ? load(v, i) * mul[i] : load(v, i); };
  float top = 0.f, total = 0.f;
  for (int64_t i = 0; i < B; ++i) {
    top = std::max(top, std::fabs(value(i)));
    total += value(i);
  }
  const float inv = top > 0.f ? 127.f / top : 0.f;
  int32_t s = 0;
  for (int64_t i = 0; i < B; ++i) {
    const int32_t qi = static_cast<int32_t>(std::nearbyint(value(i) * inv));
    q[i] = static_cast<int8_t>(qi);
    s += qi;
  }
  *scale = top / 127.f;
  *qsum = s;
  *sum = total;
#endif
}

template <typename T>
void QuantizedRows::quantize(const T* x, int64_t rows, int64_t cols, int64_t block_values, const float* column_mul) {
  TORCH_CHECK(block_values == kBlock || block_values == kWideBlock, "blocks of 32 or 128 values, not ", block_values);
  TORCH_CHECK(cols % block_values == 0, "a row of ", cols, " values is no whole number of blocks of ", block_values);
  M = rows;
  K = cols;
  block = block_values;
  const int64_t blocks = K / block;
  q.resize(M * K);
  scale.resize(M * blocks);
  sum.resize(M * blocks);
  qsum.resize(M * blocks);
  auto body = [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * blocks; i < r1 * blocks; ++i) {
      const float* mul = column_mul == nullptr ? nullptr : column_mul + (i % blocks) * block;
      if (block == kWideBlock)
        quantize_block<kWideBlock>(x + i * block, mul, q.data() + i * block, &scale[i], &qsum[i], &sum[i]);
      else
        quantize_block<kBlock>(x + i * block, mul, q.data() + i * block, &scale[i], &qsum[i], &sum[i]);
    }
  };
  if (M <= kMaxRows) {
    body(0, M);
  } else {
    at::parallel_for(0, M, 16, body);
  }
}

QuantizedRows QuantizedRows::rows(const std::vector<int64_t>& which) const {
  QuantizedRows out;
  const int64_t blocks = K / block;
  out.M = static_cast<int64_t>(which.size());
  out.K = K;
  out.block = block;
  for (const int64_t m : which) {
    out.q.insert(out.q.end(), q.begin() + m * K, q.begin() + (m + 1) * K);
    out.scale.insert(out.scale.end(), scale.begin() + m * blocks, scale.begin() + (m + 1) * blocks);
    out.sum.insert(out.sum.end(), sum.begin() + m * blocks, sum.begin() + (m + 1) * blocks);
    out.qsum.insert(out.qsum.end(), qsum.begin() + m * blocks, qsum.begin() + (m + 1) * blocks);
  }
  return out;
}

template void QuantizedRows::quantize<float>(const float*, int64_t, int64_t, int64_t, const float*);
template void QuantizedRows::quantize<bf16>(const bf16*, int64_t, int64_t, int64_t, const float*);

namespace {

// int8 (N, K) into the int8 formats' lines: per group of 16 rows, line j holds each row's values 4j..4j+3 in turn,
// stored as w + `offset` (128; a narrow copy's on AVX2, `kNarrowStored`). With `magnitudes` (a kInt8Wide copy on AVX2,
// `kWideMagnitudes`) a line is 128 bytes: the 64 values' magnitudes |w|, then the values w themselves.
at::Tensor pack_int8(const at::Tensor& w, int offset = 128, bool magnitudes = false) {
  const int64_t N = w.size(0), K = w.size(1), line_bytes = magnitudes ? 128 : 64;
  auto out = at::empty({N * K * line_bytes / 64}, at::kByte);
  const int8_t* src = w.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N / 16, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t j = 0; j < K / 4; ++j) {
        uint8_t* line = dst + (g * (K / 4) + j) * line_bytes;
        for (int64_t r = 0; r < 16; ++r) {
          for (int64_t t = 0; t < 4; ++t) {
            const int v = src[(g * 16 + r) * K + j * 4 + t];
            if (magnitudes) {
              line[r * 4 + t] = static_cast<uint8_t>(std::abs(v));
              line[64 + r * 4 + t] = static_cast<uint8_t>(static_cast<int8_t>(v));
            } else {
              line[r * 4 + t] = static_cast<uint8_t>(v + offset);
            }
          }
        }
      }
    }
  });
  return out;
}

// (N, blocks) scales as the kernels read them: 16 per (16 rows, block), in dtype.
at::Tensor group_scales(const at::Tensor& scales, at::ScalarType dtype) {
  const int64_t N = scales.size(0), blocks = scales.size(1);
  return scales.view({N / 16, 16, blocks}).transpose(1, 2).contiguous().to(dtype).view({-1});
}

}  // namespace

Projection Projection::int8(const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(), "w must be contiguous int8 (N, K)");
  const int64_t N = w.size(0), K = w.size(1), blocks = K / kBlock;
  TORCH_CHECK(N % 16 == 0 && K % kBlock == 0, "N must be a multiple of 16 and K of 32");
  const bool per_block = scales.dim() == 2;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  (per_block ? scales.size(0) == N && scales.size(1) == blocks : scales.numel() == N),
              "scales must be contiguous float32 (N,) or (N, K / 32)");
  if (!per_block) return Projection(pack_int8(w), scales.clone(), N, K, Format::kInt8);
  // Per-block scales are kept as float16, the GGUF's own (Q8_0 and Q5_0 store d in float16): exact, 2 bytes a block.
  const auto inexact = scales.to(at::kHalf).to(at::kFloat).ne(scales);
  TORCH_CHECK(!inexact.any().item<bool>(), "per-block scales must be float16 values (a GGUF's Q8_0 or Q5_0 scales), got ",
              scales.masked_select(inexact)[0].item<float>());
  std::atomic<bool> wide{false};  // one pass: the LM head's 168M values took 0.4 s through torch's int32 copies
  const int8_t* values = w.data_ptr<int8_t>();
  at::parallel_for(0, N * K, 1 << 16, [&](int64_t i0, int64_t i1) {
    int top = 0;
    for (int64_t i = i0; i < i1; ++i) top = std::max(top, std::abs(static_cast<int>(values[i])));
    if (top > kNarrowMax) wide = true;
  });
  const bool narrow = !wide;
  Projection p(pack_int8(w, narrow ? kNarrowStored : 128), group_scales(scales, at::kHalf), N, K, Format::kInt8Block);
  p.narrow_ = narrow;
  return p;
}

Projection Projection::int8_wide(const at::Tensor& w, const at::Tensor& scales, const std::optional<at::Tensor>& smooth) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(), "w must be contiguous int8 (N, K)");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0 && K % kWideBlock == 0, "N must be a multiple of 16 and K of 128");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == N &&
                  scales.size(1) == K / kWideBlock,
              "scales must be float32 (N, K / 128)");
  Projection p(pack_int8(w, 128, kWideMagnitudes), group_scales(scales.contiguous(), at::kFloat), N, K,
               Format::kInt8Wide);
  // values 8i + 4a + 2p + b: the four of one 16-bit sum share (i, p), over a (the line) and b (the pair)
  const at::Tensor quads = w.to(at::kInt).abs().view({N, K / 8, 2, 2, 2}).sum({2, 4});
  p.paired_ = quads.le(kPairBudget).all().item<bool>();
  if (smooth.has_value()) {
    const at::Tensor& s = *smooth;
    TORCH_CHECK(s.device().is_cpu() && s.scalar_type() == at::kFloat && s.dim() == 1 && s.size(0) == K,
                "smooth must be float32 (", K, ",) on the CPU, got ", s.scalar_type(), " ", s.sizes(), " on ", s.device());
    const at::Tensor mul = s.reciprocal().contiguous();
    TORCH_CHECK(at::isfinite(s).all().item<bool>() && s.gt(0).all().item<bool>() && at::isfinite(mul).all().item<bool>(),
                "smooth must be finite and positive with finite reciprocals, got ", s.min().item<float>(), "..",
                s.max().item<float>());
    p.column_mul_ = mul;
  }
  return p;
}

Projection Projection::int4(const at::Tensor& q_in, const at::Tensor& step, const at::Tensor& low, bool half_scales) {
  TORCH_CHECK((q_in.scalar_type() == at::kByte || q_in.scalar_type() == at::kInt) && q_in.dim() == 2,
              "q must be (N, K) uint8 or int32 in 0..15");
  const auto q = q_in.to(at::kByte).contiguous();
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % 16 == 0 && K % kBlock == 0, "N must be a multiple of 16 and K of 32");
  TORCH_CHECK(q_in.min().item<int64_t>() >= 0 && q_in.max().item<int64_t>() <= 15, "q must hold values in 0..15");
  const int64_t blocks = K / kBlock;
  check_scale(step, N * blocks, "step");
  check_scale(low, N * blocks, "low");
  if (half_scales) {
    constexpr float kHalfMax = 65504.f;
    TORCH_CHECK(step.abs().max().item<float>() <= kHalfMax && low.abs().max().item<float>() <= kHalfMax,
                "float16 scales must be within +-65504");
  }
  auto out = at::empty({N * K / 2}, at::kByte);
  auto sc = at::empty({N * blocks * 2}, at::kFloat);  // float32, or rounded to float16 below
  const uint8_t* src = q.data_ptr<uint8_t>();
  const float* st = step.data_ptr<float>();
  const float* lo = low.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  float* sdst = sc.data_ptr<float>();
  at::parallel_for(0, N / 16, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t b = 0; b < blocks; ++b) {
        for (int64_t j = 0; j < 4; ++j) {
          uint8_t* line = dst + ((g * blocks + b) * 4 + j) * 64;
          for (int64_t r = 0; r < 16; ++r) {
            const uint8_t* row = src + (g * 16 + r) * K + b * kBlock + j * 8;
            for (int64_t t = 0; t < 4; ++t) line[r * 4 + t] = static_cast<uint8_t>(row[t] | (row[t + 4] << 4));
          }
        }
        float* s = sdst + (g * blocks + b) * 32;
        for (int64_t r = 0; r < 16; ++r) {
          s[r] = st[(g * 16 + r) * blocks + b];
          s[16 + r] = lo[(g * 16 + r) * blocks + b];
        }
      }
    }
  });
  if (half_scales)  // the same order, 2 bytes a value (`load_halves` in the kernels)
    return Projection(out, sc.to(at::kHalf), N, K, Format::kInt4Half);
  return Projection(out, sc, N, K, Format::kInt4);
}

void Projection::set_tiles(const Projection& tiles) {
  TORCH_CHECK(tiles.N_ == N_ && tiles.K_ == K_, "the tiles' copy must have this weight's shape (", N_, ", ", K_,
              "), not (", tiles.N_, ", ", tiles.K_, ")");
  TORCH_CHECK(tiles.tiles_ == nullptr, "the tiles' copy must not have one of its own");
  tiles_ = std::make_shared<const Projection>(tiles);
}

bool Projection::rows_in_tiles(int64_t rows) const {
#if defined(SWA_LOW_BIT_AVX2)
  return (narrow_ && rows >= 7) || (is_int4(format_) && rows >= 8);
#else
  (void)rows;
  return false;
#endif
}

template <typename T, typename Y>
void Projection::apply(const T* x, int64_t rows, Y* y, QuantizedRows& xq) const {
  const Projection& p = rows > kMaxRows && tiles_ != nullptr ? *tiles_ : *this;
  xq.quantize(x, rows, K_, block_values(p.format_), p.column_mul());
  if (rows <= kMaxRows && !p.rows_in_tiles(rows)) {
    p.run(xq, y);
  } else {
    p.run_tiled(xq, y);
  }
}

template void Projection::apply<float, float>(const float*, int64_t, float*, QuantizedRows&) const;
template void Projection::apply<bf16, bf16>(const bf16*, int64_t, bf16*, QuantizedRows&) const;
template void Projection::apply<bf16, float>(const bf16*, int64_t, float*, QuantizedRows&) const;

at::Tensor Projection::matmul(const at::Tensor& x, bool float_out) const {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(1) == K_, "x must be (M, ", K_, "), got ", x.sizes());
  QuantizedRows xq;
  auto y = at::empty({x.size(0), N_}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  with_float_type(x.scalar_type(), [&](auto xtag) {
    using X = decltype(xtag);
    with_float_type(y.scalar_type(), [&](auto ytag) {
      using Y = decltype(ytag);
      if constexpr (std::is_same_v<X, float> && !std::is_same_v<Y, float>) {
        TORCH_CHECK(false, "float32 rows give float32 outputs");
      } else {
        apply<X, Y>(data_of<X>(x), x.size(0), mutable_data_of<Y>(y), xq);
      }
    });
  });
  return y;
}

int64_t Projection::refine(const at::Tensor& x, const at::Tensor& y, double margin) const {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(!is_int4(format_), "refine recomputes with an int8 weight; this one is int4");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(1) == K_, "x must be (M, ", K_, ") with M >= 1, got ",
              x.sizes());
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.dim() == 2 && y.size(0) == x.size(0) &&
                  y.size(1) == N_,
              "y must be contiguous float32 (", x.size(0), ", ", N_, "), got ", y.sizes());
  TORCH_CHECK(margin >= 0, "margin must not be negative, got ", margin);
  QuantizedRows xq;
  const auto xc = x.contiguous();
  with_float_type(xc.scalar_type(), [&](auto tag) {
    xq.quantize(data_of<decltype(tag)>(xc), xc.size(0), K_, block_values(format_), column_mul());
  });
  return refine_groups(xq, y.data_ptr<float>(), static_cast<float>(margin));
}

}  // namespace swa
