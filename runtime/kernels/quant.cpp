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
//
// This file: the activations' quantisation, the packing, the entry point; the kernels are in quant_kernels.cpp.

#include "quant.h"

#include <algorithm>

#include "vecmath.h"

namespace swa {

// One block of 32 values: symmetric int8 by its largest magnitude (round half to even), its scale, the sum of its
// int8 values and of its own values.
template <typename T>
inline void quantize_block(const T* v, int8_t* q, float* scale, int32_t* qsum, float* sum) {
#if defined(__AVX512F__)
  const __m512 a = load16(v), b = load16(v + 16);
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  *scale = top / 127.f;
  *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  *sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
#else
  float top = 0.f, total = 0.f;
  for (int64_t i = 0; i < kBlock; ++i) {
    top = std::max(top, std::fabs(load(v, i)));
    total += load(v, i);
  }
  const float inv = top > 0.f ? 127.f / top : 0.f;
  int32_t s = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    const int32_t qi = static_cast<int32_t>(std::nearbyint(load(v, i) * inv));
    q[i] = static_cast<int8_t>(qi);
    s += qi;
  }
  *scale = top / 127.f;
  *qsum = s;
  *sum = total;
#endif
}

template <typename T>
void QuantizedRows::quantize(const T* x, int64_t rows, int64_t cols) {
  M = rows;
  K = cols;
  const int64_t blocks = K / kBlock;
  q.resize(M * K);
  scale.resize(M * blocks);
  sum.resize(M * blocks);
  qsum.resize(M * blocks);
  auto body = [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * blocks; i < r1 * blocks; ++i) {
      quantize_block(x + i * kBlock, q.data() + i * kBlock, &scale[i], &qsum[i], &sum[i]);
    }
  };
  if (M <= kMaxRows) {
    body(0, M);
  } else {
    at::parallel_for(0, M, 16, body);
  }
}

template void QuantizedRows::quantize<float>(const float*, int64_t, int64_t);
template void QuantizedRows::quantize<bf16>(const bf16*, int64_t, int64_t);

Projection Projection::int8(const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(), "w must be contiguous int8 (N, K)");
  const int64_t N = w.size(0), K = w.size(1), blocks = K / kBlock;
  TORCH_CHECK(N % 16 == 0 && K % kBlock == 0, "N must be a multiple of 16 and K of 32");
  const bool per_block = scales.dim() == 2;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  (per_block ? scales.size(0) == N && scales.size(1) == blocks : scales.numel() == N),
              "scales must be contiguous float32 (N,) or (N, K / 32)");
  auto out = at::empty({N * K}, at::kByte);
  // Per-block scales are kept as float16, the GGUF's own (Q8_0 and Q5_0 store d in float16): exact, 2 bytes a block.
  auto sc = per_block ? at::empty({N * blocks}, at::kHalf) : scales.clone();
  const int8_t* src = w.data_ptr<int8_t>();
  const float* ssrc = scales.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  if (per_block) {
    for (int64_t i = 0; i < N * blocks; ++i) {
      TORCH_CHECK(static_cast<float>(c10::Half(ssrc[i])) == ssrc[i],
                  "per-block scales must be float16 values (a GGUF's Q8_0 or Q5_0 scales), got ", ssrc[i]);
    }
  }
  auto* hdst = per_block ? sc.data_ptr<at::Half>() : nullptr;
  at::parallel_for(0, N / 16, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t j = 0; j < K / 4; ++j) {
        uint8_t* line = dst + (g * (K / 4) + j) * 64;
        for (int64_t r = 0; r < 16; ++r) {
          for (int64_t t = 0; t < 4; ++t) {
            line[r * 4 + t] = static_cast<uint8_t>(static_cast<int>(src[(g * 16 + r) * K + j * 4 + t]) + 128);
          }
        }
      }
      if (per_block) {  // 16 scales per (16 rows, block), in the order the kernels read them
        for (int64_t b = 0; b < blocks; ++b)
          for (int64_t r = 0; r < 16; ++r) hdst[(g * blocks + b) * 16 + r] = c10::Half(ssrc[(g * 16 + r) * blocks + b]);
      }
    }
  });
  return Projection(out, sc, N, K, per_block ? Format::kInt8Block : Format::kInt8);
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

at::Tensor Projection::matmul(const at::Tensor& x, bool float_out) const {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(1) == K_, "x must be (M, ", K_, "), got ", x.sizes());
  QuantizedRows xq;
  with_float_type(x.scalar_type(), [&](auto tag) { xq.quantize(data_of<decltype(tag)>(x), x.size(0), K_); });
  auto y = at::empty({x.size(0), N_}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  with_float_type(y.scalar_type(), [&](auto tag) {
    if (xq.M <= kMaxRows) {
      run(xq, mutable_data_of<decltype(tag)>(y));
    } else {
      run_tiled(xq, mutable_data_of<decltype(tag)>(y));
    }
  });
  return y;
}

int64_t Projection::refine(const at::Tensor& x, const at::Tensor& y, double margin) const {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(!is_int4(format_), "refine recomputes with an int8 weight; this one is int4");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows && x.size(1) == K_, "x must be (M, ", K_,
              ") with M in 1..", kMaxRows, ", got ", x.sizes());
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.dim() == 2 && y.size(0) == x.size(0) &&
                  y.size(1) == N_,
              "y must be contiguous float32 (", x.size(0), ", ", N_, "), got ", y.sizes());
  TORCH_CHECK(margin >= 0, "margin must not be negative, got ", margin);
  QuantizedRows xq;
  const auto xc = x.contiguous();
  with_float_type(xc.scalar_type(), [&](auto tag) { xq.quantize(data_of<decltype(tag)>(xc), xc.size(0), K_); });
  return refine_groups(xq, y.data_ptr<float>(), static_cast<float>(margin));
}

}  // namespace swa
