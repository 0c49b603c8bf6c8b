// Fused CPU kernels for decode in a bfloat16 model (see runtime/kernels/__init__.py for why and when).
//
// Each kernel does in one pass what the torch path does in five to ten operations, whose fixed costs (a
// dispatch, an allocation, a pass over memory) dominate at batch 1. Arithmetic is float32 throughout;
// bfloat16 values are rounded to nearest-even where the torch path rounds them, so results match it up to
// the order of float32 sums. Plain loops written for the compiler's vectoriser (`-O3 -march=native`);
// threads from ATen's pool (at::parallel_for), so they never compete with torch's own.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using bf16 = uint16_t;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const bf16* p, int64_t i) {
  uint32_t u = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void store(float* p, int64_t i, float f) { p[i] = f; }
inline void store(bf16* p, int64_t i, float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    p[i] = static_cast<bf16>((u >> 16) | 0x40);  // a quiet NaN
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  p[i] = static_cast<bf16>(u >> 16);
}

inline float round_bf16(float f) {
  bf16 h;
  store(&h, 0, f);
  return load(&h, 0);
}

void check_float_or_bf16(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16, what,
              " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
}

template <typename T>
inline float inverse_rms(const T* x, int64_t D, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t d = 0; d < D; ++d) {
    const float v = load(x, d);
    ss += v * v;
  }
  return 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
}

// ---- RMSNorm ------------------------------------------------------------------------------------------------
// rows (R, D) -> y = x * rsqrt(mean(x^2) + eps) * scale, scale (D,) or (heads, D) for rows of heads; with a
// residual r, y = r + round(y) (the torch path rounds the norm's output before adding it).

template <typename T>
void rms_rows(const T* x, const float* scale, int64_t scale_rows, const T* residual, T* y, int64_t rows,
              int64_t D, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * D;
      const float inv = inverse_rms(xr, D, eps);
      const float* sc = scale + (r % scale_rows) * D;
      T* yr = y + r * D;
      if (residual == nullptr) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) store(yr, d, load(xr, d) * inv * sc[d]);
      } else {
        const T* rr = residual + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) store(yr, d, load(rr, d) + round_bf16(load(xr, d) * inv * sc[d]));
      }
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor scale, double eps, c10::optional<torch::Tensor> residual) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous(), "scale must be contiguous float32");
  const int64_t D = x.size(-1);
  TORCH_CHECK(scale.size(-1) == D, "scale's last dimension must be x's");
  const int64_t scale_rows = scale.numel() / D;
  TORCH_CHECK(scale_rows == 1 || (x.dim() >= 2 && x.size(-2) == scale_rows), "scale must be (D,) or (heads, D)");
  auto y = torch::empty_like(x);
  const int64_t rows = x.numel() / D;
  const torch::Tensor* r = residual.has_value() ? &residual.value() : nullptr;
  if (r != nullptr) {
    TORCH_CHECK(r->sizes() == x.sizes() && r->scalar_type() == x.scalar_type() && r->is_contiguous(),
                "residual must match x");
  }
  if (x.scalar_type() == torch::kBFloat16) {
    rms_rows<bf16>(reinterpret_cast<const bf16*>(x.data_ptr()), scale.data_ptr<float>(), scale_rows,
                   r ? reinterpret_cast<const bf16*>(r->data_ptr()) : nullptr,
                   reinterpret_cast<bf16*>(y.data_ptr()), rows, D, static_cast<float>(eps));
  } else {
    rms_rows<float>(x.data_ptr<float>(), scale.data_ptr<float>(), scale_rows, r ? r->data_ptr<float>() : nullptr,
                    y.data_ptr<float>(), rows, D, static_cast<float>(eps));
  }
  return y;
}

// ---- q/k norm and rotary --------------------------------------------------------------------------------
// qkv (T, W): the first `heads` heads of D values of each row (the q heads, then the k heads) normalised
// each with its own scale (heads, D), rounded to the model's dtype (as the torch path stores it), then
// rotated: y = x * cos + roll(x, D/2) * sin with cos/sin (T, D) float32 (sin already negated in its first
// half). Returns (T, heads, D).

template <typename T>
void qk_rows(const T* x, int64_t row_stride, const float* scale, const float* cos, const float* sin, T* y,
             int64_t tokens, int64_t heads, int64_t D, float eps) {
  const int64_t half = D / 2;
  at::parallel_for(0, tokens * heads, 8, [&](int64_t i0, int64_t i1) {
    std::vector<float> n(D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads, h = i % heads;
      const T* xr = x + t * row_stride + h * D;
      const float inv = inverse_rms(xr, D, eps);
      const float* sc = scale + h * D;
      for (int64_t d = 0; d < D; ++d) {
        float v = load(xr, d) * inv * sc[d];
        n[d] = std::is_same<T, bf16>::value ? round_bf16(v) : v;
      }
      const float* c = cos + t * D;
      const float* s = sin + t * D;
      T* yr = y + i * D;
      for (int64_t d = 0; d < D; ++d) {
        const float rolled = d < half ? n[d + half] : n[d - half];
        store(yr, d, n[d] * c[d] + rolled * s[d]);
      }
    }
  });
}

torch::Tensor qk_norm_rope(torch::Tensor qkv, int64_t heads, torch::Tensor scale, torch::Tensor cos,
                           torch::Tensor sin, double eps) {
  check_float_or_bf16(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2, "qkv must be (tokens, width)");
  const int64_t T = qkv.size(0), W = qkv.size(1);
  TORCH_CHECK(heads > 0 && scale.dim() == 2 && scale.size(0) == heads, "scale must be (heads, D)");
  const int64_t D = scale.size(1);
  TORCH_CHECK(D % 2 == 0 && heads * D <= W, "heads of an even size D must fit in a row of qkv");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat && scale.is_contiguous(), "scale must be contiguous float32");
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat && t->is_contiguous() && t->numel() == T * D,
                "cos and sin must be contiguous float32 (tokens, D)");
  }
  auto y = torch::empty({T, heads, D}, qkv.options());
  if (qkv.scalar_type() == torch::kBFloat16) {
    qk_rows<bf16>(reinterpret_cast<const bf16*>(qkv.data_ptr()), W, scale.data_ptr<float>(), cos.data_ptr<float>(),
                  sin.data_ptr<float>(), reinterpret_cast<bf16*>(y.data_ptr()), T, heads, D, static_cast<float>(eps));
  } else {
    qk_rows<float>(qkv.data_ptr<float>(), W, scale.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                   y.data_ptr<float>(), T, heads, D, static_cast<float>(eps));
  }
  return y;
}

// ---- int8 projections at decode sizes (AVX512-VNNI) --------------------------------------------------------
// y (M, N) = x (M, K) @ (w (N, K) * scales (N,))^T with w per-channel int8, for M <= 8 rows. The activations
// are quantised per block of 32 values (symmetric int8, one float scale a block, as llama.cpp's Q8 blocks),
// so each 64-byte line of weights is one `vpdpbusd` (16 rows x 4 values): few instructions per byte, so the
// pass over the weights runs at the memory's pace (torch's int8 kernel converts every weight to float and
// streamed at half of it). Weights are packed once (`pack_int8_vnni`): groups of 16 rows, 4 consecutive
// values of each row in turn, stored as w + 128 (unsigned, what the instruction's first operand takes); the
// 128 comes back out through each activation block's sum.

constexpr int64_t kBlock = 32;

torch::Tensor pack_int8_vnni(torch::Tensor w) {
  TORCH_CHECK(w.scalar_type() == torch::kChar && w.dim() == 2 && w.is_contiguous(), "w must be contiguous int8 (N, K)");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0 && K % kBlock == 0, "N must be a multiple of 16 and K of 32");
  auto out = torch::empty({N * K}, torch::kByte);
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
  return out;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>

constexpr bool kHasVnni = true;

// S streams: the thread's groups split into S runs walked in lockstep, so that S separate streams of weights
// are in flight: one stream per core read at about half the memory's pace here (16 GB/s for a 168 MB head
// with 2 threads), four at 40 GB/s. Four for one or two rows, two for three or four, one beyond (registers).
template <typename T, int M, int S>
void vnni_rows(const uint8_t* w, const int8_t* xq, const float* xs, const int32_t* xsum, const float* scales, T* y,
               int64_t N, int64_t K, int64_t g0, int64_t g1) {
  const int64_t blocks = K / kBlock;
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
      for (int64_t j = 0; j < kBlock / 4; ++j) {
        __m512i xb[M];
        for (int m = 0; m < M; ++m) {
          int32_t quad;
          std::memcpy(&quad, xq + m * K + b * kBlock + j * 4, 4);
          xb[m] = _mm512_set1_epi32(quad);
        }
        for (int st = 0; st < live; ++st) {
          const __m512i wl = _mm512_loadu_si512(w + (gs[st] * (K / 4) + b * (kBlock / 4) + j) * 64);
          for (int m = 0; m < M; ++m) dot[st][m] = _mm512_dpbusd_epi32(dot[st][m], wl, xb[m]);
        }
      }
      for (int m = 0; m < M; ++m) {
        const __m512i corr = _mm512_set1_epi32(128 * xsum[m * blocks + b]);
        const __m512 sx = _mm512_set1_ps(xs[m * blocks + b]);
        for (int st = 0; st < live; ++st)
          acc[st][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[st][m], corr)), sx, acc[st][m]);
      }
    }
    for (int st = 0; st < live; ++st) {
      const __m512 sc = _mm512_loadu_ps(scales + gs[st] * 16);
      for (int m = 0; m < M; ++m) {
        alignas(64) float out[16];
        _mm512_store_ps(out, _mm512_mul_ps(acc[st][m], sc));
        for (int r = 0; r < 16; ++r) store(y + m * N, gs[st] * 16 + r, out[r]);
      }
    }
  }
}

// The row count as a template argument, with the streams the registers allow for it.
template <typename T>
void vnni_dispatch(int64_t M, const uint8_t* w, const int8_t* xq, const float* xs, const int32_t* xsum,
                   const float* scales, T* y, int64_t N, int64_t K, int64_t g0, int64_t g1) {
  switch (M) {
    case 1: vnni_rows<T, 1, 4>(w, xq, xs, xsum, scales, y, N, K, g0, g1); break;
    case 2: vnni_rows<T, 2, 4>(w, xq, xs, xsum, scales, y, N, K, g0, g1); break;
    case 3: vnni_rows<T, 3, 2>(w, xq, xs, xsum, scales, y, N, K, g0, g1); break;
    case 4: vnni_rows<T, 4, 2>(w, xq, xs, xsum, scales, y, N, K, g0, g1); break;
    case 5: vnni_rows<T, 5, 1>(w, xq, xs, xsum, scales, y, N, K, g0, g1); break;
    case 6: vnni_rows<T, 6, 1>(w, xq, xs, xsum, scales, y, N, K, g0, g1); break;
    case 7: vnni_rows<T, 7, 1>(w, xq, xs, xsum, scales, y, N, K, g0, g1); break;
    default: vnni_rows<T, 8, 1>(w, xq, xs, xsum, scales, y, N, K, g0, g1); break;
  }
}

torch::Tensor int8_vnni_matmul(torch::Tensor x, torch::Tensor packed, torch::Tensor scales) {
  check_float_or_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= 8, "x must be (M, K) with M in 1..8");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.is_contiguous() && packed.numel() % K == 0,
              "packed must come from pack_int8_vnni");
  const int64_t N = packed.numel() / K;
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.numel() == N,
              "scales must be contiguous float32 (N,)");
  const int64_t blocks = K / kBlock;
  std::vector<int8_t> xq(M * K);
  std::vector<float> xs(M * blocks);
  std::vector<int32_t> xsum(M * blocks);
  const bool x16 = x.scalar_type() == torch::kBFloat16;
  const bf16* x_bf16 = x16 ? reinterpret_cast<const bf16*>(x.data_ptr()) : nullptr;
  const float* x_f32 = x16 ? nullptr : x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      float v[kBlock], top = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) {
        const int64_t k = m * K + b * kBlock + i;
        v[i] = x16 ? load(x_bf16, k) : x_f32[k];
        top = std::max(top, std::fabs(v[i]));
      }
      const float scale = top / 127.f, inv = top > 0.f ? 127.f / top : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < kBlock; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(v[i] * inv));
        xq[m * K + b * kBlock + i] = static_cast<int8_t>(q);
        sum += q;
      }
      xs[m * blocks + b] = scale;
      xsum[m * blocks + b] = sum;
    }
  }
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  at::parallel_for(0, N / 16, 8, [&](int64_t g0, int64_t g1) {
    if (x16) {
      vnni_dispatch(M, wp, xq.data(), xs.data(), xsum.data(), sp, reinterpret_cast<bf16*>(y.data_ptr()), N, K, g0, g1);
    } else {
      vnni_dispatch(M, wp, xq.data(), xs.data(), xsum.data(), sp, y.data_ptr<float>(), N, K, g0, g1);
    }
  });
  return y;
}
#else
constexpr bool kHasVnni = false;

torch::Tensor int8_vnni_matmul(torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "built without AVX512-VNNI: int8_vnni_matmul is unavailable (see has_vnni)");
}
#endif

bool has_vnni() { return kHasVnni; }

// ---- decode attention ---------------------------------------------------------------------------------------
// One query per request: q (B, H, D); keys and values read in place from the pool, k_buf/v_buf (S, Hkv, D), at
// the slots indices[indptr[b]:indptr[b+1]] of request b. Query head h reads kv head h / (H / Hkv). Each
// (request, kv head) is split into chunks of keys so that two threads share even one request; every chunk keeps
// its own maximum, sum and weighted values (float32), merged at the end. No copy of the keys is made.

template <typename T, typename KV>
void decode_attention_impl(const T* q, const KV* kb, const KV* vb, const int32_t* idx, const int32_t* indptr,
                           T* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t S, float scaling,
                           float softcap) {
  const int64_t G = H / Hkv;
  const int64_t threads = at::get_num_threads();
  const int64_t pairs = B * Hkv;
  int64_t chunks = std::max<int64_t>(1, (2 * threads + pairs - 1) / pairs);
  const int64_t items = pairs * chunks;
  std::vector<float> m(items * G), l(items * G), acc(items * G * D);
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(G * D), row(D), p;
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t pair = it / chunks, c = it % chunks, b = pair / Hkv, kh = pair % Hkv;
      const int64_t first = indptr[b], n = indptr[b + 1] - first;
      const int64_t per = (n + chunks - 1) / chunks;
      const int64_t j0 = std::min(n, c * per), j1 = std::min(n, j0 + per), len = j1 - j0;
      const float pre = softcap > 0.f ? 1.f : scaling;  // without soft-capping the scaling rides on q
      for (int64_t g = 0; g < G; ++g) {
        const T* qr = q + (b * H + kh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load(qr, d) * pre;
      }
      p.assign(G * len, 0.f);  // scores, then weights: p[g * len + j]
      for (int64_t j = 0; j < len; ++j) {
        const int64_t slot = idx[first + j0 + j];
        TORCH_CHECK(slot >= 0 && slot < S, "key slot ", slot, " outside the pool of ", S);
        const KV* kr = kb + (slot * Hkv + kh) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) row[d] = load(kr, d);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
          p[g * len + j] = softcap > 0.f ? std::tanh(s * scaling / softcap) * softcap : s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* pg = p.data() + g * len;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < len; ++j) mx = std::max(mx, pg[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < len; ++j) {
          pg[j] = std::exp(pg[j] - mx);
          sum += pg[j];
        }
        m[it * G + g] = mx;
        l[it * G + g] = sum;
      }
      float* a = acc.data() + it * G * D;
      std::fill(a, a + G * D, 0.f);
      for (int64_t j = 0; j < len; ++j) {
        const KV* vr = vb + (idx[first + j0 + j] * Hkv + kh) * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) row[d] = load(vr, d);
        for (int64_t g = 0; g < G; ++g) {
          const float w = p[g * len + j];
          float* ag = a + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += w * row[d];
        }
      }
    }
  });
  at::parallel_for(0, B * H, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> o(D);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / H, h = r % H, kh = h / G, g = h % G;
      const int64_t base = (b * Hkv + kh) * chunks;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) {
        if (l[(base + c) * G + g] > 0.f) top = std::max(top, m[(base + c) * G + g]);
      }
      std::fill(o.begin(), o.end(), 0.f);
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float lc = l[(base + c) * G + g];
        if (!(lc > 0.f)) continue;  // an empty chunk
        const float w = std::exp(m[(base + c) * G + g] - top);
        total += lc * w;
        const float* a = acc.data() + ((base + c) * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
      }
      const float inv = total > 0.f ? 1.f / total : 0.f;  // a request without keys gets zeros
      T* orow = out + r * D;
      for (int64_t d = 0; d < D; ++d) store(orow, d, o[d] * inv);
    }
  });
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf, torch::Tensor indices,
                               torch::Tensor indptr, double scaling, double softcap) {
  check_float_or_bf16(q, "q");
  check_float_or_bf16(k_buf, "k_buf");
  check_float_or_bf16(v_buf, "v_buf");
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.sizes() == k_buf.sizes(),
              "q must be (B, H, D), k_buf and v_buf (S, Hkv, D) alike");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type(), "k_buf and v_buf must share a dtype");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), S = k_buf.size(0), Hkv = k_buf.size(1);
  TORCH_CHECK(k_buf.size(2) == D && H % Hkv == 0, "head sizes disagree");
  TORCH_CHECK(indices.scalar_type() == torch::kInt && indices.is_contiguous() && indptr.scalar_type() == torch::kInt &&
                  indptr.is_contiguous() && indptr.numel() == B + 1,
              "indices and indptr must be contiguous int32, indptr (B + 1,)");
  const int32_t* ip = indptr.data_ptr<int32_t>();
  TORCH_CHECK(ip[0] == 0 && ip[B] <= indices.numel(), "indptr does not fit indices");
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(ip[b + 1] >= ip[b], "indptr must not decrease");
  auto out = torch::empty_like(q);
  const float sc = static_cast<float>(scaling), cap = static_cast<float>(softcap);
  const int32_t* ix = indices.data_ptr<int32_t>();
  const bool q16 = q.scalar_type() == torch::kBFloat16, kv16 = k_buf.scalar_type() == torch::kBFloat16;
  const void* kp = k_buf.data_ptr();
  const void* vp = v_buf.data_ptr();
  if (q16 && kv16) {
    decode_attention_impl<bf16, bf16>(reinterpret_cast<const bf16*>(q.data_ptr()), static_cast<const bf16*>(kp),
                                      static_cast<const bf16*>(vp), ix, ip, reinterpret_cast<bf16*>(out.data_ptr()),
                                      B, H, Hkv, D, S, sc, cap);
  } else if (!q16 && !kv16) {
    decode_attention_impl<float, float>(q.data_ptr<float>(), static_cast<const float*>(kp),
                                        static_cast<const float*>(vp), ix, ip, out.data_ptr<float>(), B, H, Hkv, D,
                                        S, sc, cap);
  } else {
    TORCH_CHECK(false, "q and the KV buffers must share a dtype");
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of rows, optionally added to a residual");
  m.def("qk_norm_rope", &qk_norm_rope, "per-head RMSNorm then rotary embedding");
  m.def("pack_int8_vnni", &pack_int8_vnni, "int8 (N, K) weights in int8_vnni_matmul's layout");
  m.def("int8_vnni_matmul", &int8_vnni_matmul, "x @ (w * scales)^T, activations in int8 blocks of 32");
  m.def("has_vnni", &has_vnni, "whether int8_vnni_matmul was built (AVX512-VNNI)");
  m.def("decode_attention", &decode_attention, "one query per request over keys read in place");
}
