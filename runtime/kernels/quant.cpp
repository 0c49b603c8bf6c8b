// Low-bit projections at decode sizes on AVX512-VNNI.
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
//   each activation block's sum. One float scale a row.
// - int4 (a GGUF's Q4_K tensors, exactly: 16 levels `low + step * q` per group of 32): per block, 4 lines;
//   line j holds for each row 4 bytes, values 8j..8j+3 in the low nibbles and 8j+4..8j+7 in the high ones.
//   The group's step and low are float32, 16 steps then 16 lows per (16 rows, block), so nothing is rounded:
//   y = sum over blocks of step * xscale * (q . xq) + low * (sum of the block's activations).
//
// Each thread walks S groups of rows in lockstep, so that S separate streams of weights are in flight: one
// stream per core reads at about half the memory's pace (16 GB/s for a 168 MB head with 2 threads on a Xeon),
// four at 36-40 GB/s. Four streams for one or two rows, two for three or four, one beyond (registers).

#include "quant.h"

#include <algorithm>

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#endif

namespace swa {

template <typename T>
void QuantizedRows::quantize(const T* x, int64_t rows, int64_t cols) {
  M = rows;
  K = cols;
  const int64_t blocks = K / kBlock;
  q.resize(M * K);
  scale.resize(M * blocks);
  sum.resize(M * blocks);
  qsum.resize(M * blocks);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      float v[kBlock], top = 0.f, total = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) {
        v[i] = load(x, m * K + b * kBlock + i);
        top = std::max(top, std::fabs(v[i]));
        total += v[i];
      }
      const float inv = top > 0.f ? 127.f / top : 0.f;
      int32_t s = 0;
      for (int64_t i = 0; i < kBlock; ++i) {
        const int32_t qi = static_cast<int32_t>(std::nearbyint(v[i] * inv));
        q[m * K + b * kBlock + i] = static_cast<int8_t>(qi);
        s += qi;
      }
      scale[m * blocks + b] = top / 127.f;
      qsum[m * blocks + b] = s;
      sum[m * blocks + b] = total;
    }
  }
}

template void QuantizedRows::quantize<float>(const float*, int64_t, int64_t);
template void QuantizedRows::quantize<bf16>(const bf16*, int64_t, int64_t);

Projection Projection::int8(const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.is_contiguous(), "w must be contiguous int8 (N, K)");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0 && K % kBlock == 0, "N must be a multiple of 16 and K of 32");
  check_scale(scales, N, "scales");
  auto out = at::empty({N * K}, at::kByte);
  const int8_t* src = w.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
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
    }
  });
  return Projection(out, scales.clone(), N, K, Format::kInt8);
}

Projection Projection::int4(const at::Tensor& q_in, const at::Tensor& step, const at::Tensor& low) {
  TORCH_CHECK((q_in.scalar_type() == at::kByte || q_in.scalar_type() == at::kInt) && q_in.dim() == 2,
              "q must be (N, K) uint8 or int32 in 0..15");
  const auto q = q_in.to(at::kByte).contiguous();
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(N % 16 == 0 && K % kBlock == 0, "N must be a multiple of 16 and K of 32");
  TORCH_CHECK(q_in.min().item<int64_t>() >= 0 && q_in.max().item<int64_t>() <= 15, "q must hold values in 0..15");
  const int64_t blocks = K / kBlock;
  check_scale(step, N * blocks, "step");
  check_scale(low, N * blocks, "low");
  auto out = at::empty({N * K / 2}, at::kByte);
  auto sc = at::empty({N * blocks * 2}, at::kFloat);
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
  return Projection(out, sc, N, K, Format::kInt4);
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)

inline __m512i broadcast_quad(const int8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, 4);
  return _mm512_set1_epi32(quad);
}

template <typename T>
inline void store_group(T* y, int64_t first, __m512 v) {
  alignas(64) float out[16];
  _mm512_store_ps(out, v);
  for (int r = 0; r < 16; ++r) store(y, first + r, out[r]);
}

template <Format F, typename T, int M, int S>
void vnni_rows(const uint8_t* w, const float* scales, const QuantizedRows& x, T* y, int64_t N, int64_t g0,
               int64_t g1) {
  const int64_t K = x.K, blocks = K / kBlock;
  constexpr int64_t kLines = F == Format::kInt8 ? 8 : 4;  // 64-byte lines per 16 rows and block
  const int64_t group_bytes = blocks * kLines * 64;
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const int8_t* xq = x.q.data();
  const int64_t per = (g1 - g0 + S - 1) / S;
  for (int64_t i = 0; i < per; ++i) {
    int64_t gs[S];
    int live = 0;
    for (int st = 0; st < S; ++st) {
      const int64_t g = g0 + st * per + i;
      if (g < g1) gs[live++] = g;
    }
    __m512 acc[S][M];
    for (int st = 0; st < live; ++st)
      for (int m = 0; m < M; ++m) acc[st][m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i dot[S][M];
      for (int st = 0; st < live; ++st)
        for (int m = 0; m < M; ++m) dot[st][m] = _mm512_setzero_si512();
      for (int64_t j = 0; j < kLines; ++j) {
        for (int st = 0; st < live; ++st) {
          const __m512i line = _mm512_loadu_si512(w + gs[st] * group_bytes + (b * kLines + j) * 64);
          if constexpr (F == Format::kInt8) {
            for (int m = 0; m < M; ++m)
              dot[st][m] = _mm512_dpbusd_epi32(dot[st][m], line, broadcast_quad(xq + m * K + b * kBlock + j * 4));
          } else {
            const __m512i lo = _mm512_and_si512(line, nibble);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(line, 4), nibble);
            for (int m = 0; m < M; ++m) {
              const int8_t* xb = xq + m * K + b * kBlock + j * 8;
              dot[st][m] = _mm512_dpbusd_epi32(dot[st][m], lo, broadcast_quad(xb));
              dot[st][m] = _mm512_dpbusd_epi32(dot[st][m], hi, broadcast_quad(xb + 4));
            }
          }
        }
      }
      if constexpr (F == Format::kInt8) {
        for (int m = 0; m < M; ++m) {
          const __m512i corr = _mm512_set1_epi32(128 * x.qsum[m * blocks + b]);
          const __m512 sx = _mm512_set1_ps(x.scale[m * blocks + b]);
          for (int st = 0; st < live; ++st)
            acc[st][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[st][m], corr)), sx, acc[st][m]);
        }
      } else {
        for (int st = 0; st < live; ++st) {
          const float* s = scales + (gs[st] * blocks + b) * 32;
          const __m512 step = _mm512_loadu_ps(s), low = _mm512_loadu_ps(s + 16);
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

// The row count as a template argument, with the streams the registers allow for it.
template <Format F, typename T>
void vnni_dispatch(int64_t M, const uint8_t* w, const float* sc, const QuantizedRows& x, T* y, int64_t N,
                   int64_t g0, int64_t g1) {
  switch (M) {
    case 1: vnni_rows<F, T, 1, 4>(w, sc, x, y, N, g0, g1); break;
    case 2: vnni_rows<F, T, 2, 4>(w, sc, x, y, N, g0, g1); break;
    case 3: vnni_rows<F, T, 3, 2>(w, sc, x, y, N, g0, g1); break;
    case 4: vnni_rows<F, T, 4, 2>(w, sc, x, y, N, g0, g1); break;
    case 5: vnni_rows<F, T, 5, 1>(w, sc, x, y, N, g0, g1); break;
    case 6: vnni_rows<F, T, 6, 1>(w, sc, x, y, N, g0, g1); break;
    case 7: vnni_rows<F, T, 7, 1>(w, sc, x, y, N, g0, g1); break;
    default: vnni_rows<F, T, 8, 1>(w, sc, x, y, N, g0, g1); break;
  }
}

template <typename T>
void Projection::run(const QuantizedRows& x, T* y) const {
  TORCH_CHECK(x.K == K_ && x.M >= 1 && x.M <= kMaxRows, "activations must be (M, ", K_, ") with M in 1..8");
  const uint8_t* w = packed_.data_ptr<uint8_t>();
  const float* sc = scales_.data_ptr<float>();
  at::parallel_for(0, N_ / 16, 8, [&](int64_t g0, int64_t g1) {
    if (format_ == Format::kInt8) {
      vnni_dispatch<Format::kInt8>(x.M, w, sc, x, y, N_, g0, g1);
    } else {
      vnni_dispatch<Format::kInt4>(x.M, w, sc, x, y, N_, g0, g1);
    }
  });
}

#else

template <typename T>
void Projection::run(const QuantizedRows&, T*) const {
  TORCH_CHECK(false, "built without AVX512-VNNI: the low-bit decode kernels are unavailable (see has_vnni)");
}

#endif

template void Projection::run<float>(const QuantizedRows&, float*) const;
template void Projection::run<bf16>(const QuantizedRows&, bf16*) const;

at::Tensor Projection::matmul(const at::Tensor& x, bool float_out) const {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows && x.size(1) == K_, "x must be (M, ", K_,
              ") with M in 1..8, got ", x.sizes());
  QuantizedRows xq;
  with_float_type(x.scalar_type(), [&](auto tag) { xq.quantize(data_of<decltype(tag)>(x), x.size(0), K_); });
  auto y = at::empty({x.size(0), N_}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  with_float_type(y.scalar_type(), [&](auto tag) { run(xq, mutable_data_of<decltype(tag)>(y)); });
  return y;
}

}  // namespace swa
