// Decode attention: one query per request over keys read in place from the KV pool.
//
// q (B, H, D); k_buf/v_buf (S, Hkv, D); request b's keys are the slots indices[indptr[b]:indptr[b+1]]. Query head h
// reads kv head h / (H / Hkv). Each (request, kv head) is split into chunks of keys so that two threads share
// even one request; every chunk keeps its own maximum, sum and weighted values (float32), merged at the end. No
// copy of the keys is made. Where the CPU has AVX-512 and the heads fit (D a multiple of 16, 1, 2, 4 or 8 query
// heads per kv head: every Gemma 3), a chunk is explicit vector code: the scores of all query heads of a kv head
// from one pass over each key, the exponentials sixteen at a time, the values added into float32 sums; else
// plain loops.

#include "attention.h"
#include "vecmath.h"

#include <algorithm>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace swa {

namespace {

struct Chunk {  // one (request, kv head, chunk of its keys)
  const int32_t* slots;
  int64_t len, kh;
};

struct Shape {
  int64_t H, Hkv, G, D, S;
  float scaling, softcap;
};

inline void check_slot(int64_t slot, int64_t S) {
  TORCH_CHECK(slot >= 0 && slot < S, "key slot ", slot, " outside the pool of ", S);
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
  for (int64_t i = 0; exact && i < G * D; ++i) {
    store(qh, i, qf[i]);
    exact = load(qh, i) == qf[i];
  }
#else
  constexpr bool exact = false;
#endif
  for (int64_t j = 0; j < len; ++j) {
    const int64_t slot = c.slots[j];
    check_slot(slot, s.S);
    const KV* kr = kb + (slot * s.Hkv + c.kh) * D;
    __m512 dot[G];
    for (int g = 0; g < G; ++g) dot[g] = _mm512_setzero_ps();
    if (exact) {
#if defined(__AVX512BF16__)
      for (int64_t d = 0; d < D; d += 32) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kr + d);
        for (int g = 0; g < G; ++g)
          dot[g] = _mm512_dpbf16_ps(dot[g], (__m512bh)_mm512_load_si512(qh + g * D + d), k);
      }
#endif
    } else {
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 k = load16(kr + d);
        for (int g = 0; g < G; ++g) dot[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * D + d), k, dot[g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const float score = _mm512_reduce_add_ps(dot[g]);
      p[g * len + j] = s.softcap > 0.f ? std::tanh(score * s.scaling / s.softcap) * s.softcap : score;
    }
  }
  for (int g = 0; g < G; ++g) {
    float* pg = p + g * len;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < len; ++j) top = std::max(top, pg[j]);
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
#endif
  return chunk_plain<KV>;
}

template <typename T>
void attend(const T* q, const T* kb, const T* vb, const int32_t* idx, const int32_t* indptr, T* out, int64_t B,
            const Shape& s) {
  const int64_t G = s.G, D = s.D, H = s.H, Hkv = s.Hkv;
  const int64_t threads = at::get_num_threads();
  const int64_t pairs = B * Hkv;
  const int64_t chunks = std::max<int64_t>(1, (2 * threads + pairs - 1) / pairs);
  const int64_t items = pairs * chunks;
  const auto routine = chunk_routine<T>(s);
  std::vector<float> m(items * G), l(items * G), acc(items * G * D);
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(G * D), p;
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t pair = it / chunks, ci = it % chunks, b = pair / Hkv, kh = pair % Hkv;
      const int64_t first = indptr[b], n = indptr[b + 1] - first;
      const int64_t per = (n + chunks - 1) / chunks;
      const int64_t j0 = std::min(n, ci * per), j1 = std::min(n, j0 + per);
      const float pre = s.softcap > 0.f ? 1.f : s.scaling;  // without soft-capping the scaling rides on q
      for (int64_t g = 0; g < G; ++g) {
        const T* qr = q + (b * H + kh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load(qr, d) * pre;
      }
      p.resize(G * std::max<int64_t>(j1 - j0, 1));
      routine(qf.data(), kb, vb, Chunk{idx + first + j0, j1 - j0, kh}, s, p.data(), m.data() + it * G,
              l.data() + it * G, acc.data() + it * G * D);
    }
  });
  auto merge = [&](int64_t r0, int64_t r1) {
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
  };
  if (B * H <= 64) {
    merge(0, B * H);  // a few rows: cheaper than waking the pool
  } else {
    at::parallel_for(0, B * H, 1, merge);
  }
}

// One query row per (token, kv head), its keys the range it sees: at and before its position, within the window
// on sliding layers. The same chunk routine as decode, whole (no split: the rows are already many).
template <typename T>
void attend_extend(const T* q, const T* kb, const T* vb, const int32_t* idx, const int32_t* kptr, const int32_t* kstart,
                   const int32_t* qptr, const int32_t* qpos, int64_t B, int64_t window, T* out, const Shape& s) {
  const int64_t G = s.G, D = s.D, H = s.H, Hkv = s.Hkv, tokens = qptr[B];
  std::vector<int32_t> request(tokens);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = qptr[b]; t < qptr[b + 1]; ++t) request[t] = static_cast<int32_t>(b);
  const auto routine = chunk_routine<T>(s);
  const float pre = s.softcap > 0.f ? 1.f : s.scaling;
  at::parallel_for(0, tokens * Hkv, 4, [&](int64_t i0, int64_t i1) {
    std::vector<float> qf(G * D), acc(G * D), mx(G), l(G), p;
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t t = it / Hkv, kh = it % Hkv, b = request[t];
      const int64_t n = kptr[b + 1] - kptr[b], last = qpos[t] - kstart[b];  // the query's own key
      const int64_t hi = std::min(n, last + 1), lo = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
      T* o = out + (t * H + kh * G) * D;
      if (hi <= lo) {  // nothing visible (a malformed list): zeros, as decode gives a request without keys
        for (int64_t i = 0; i < G * D; ++i) store(o, i, 0.f);
        continue;
      }
      for (int64_t g = 0; g < G; ++g) {
        const T* qr = q + (t * H + kh * G + g) * D;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load(qr, d) * pre;
      }
      p.resize(G * (hi - lo));
      routine(qf.data(), kb, vb, Chunk{idx + kptr[b] + lo, hi - lo, kh}, s, p.data(), mx.data(), l.data(), acc.data());
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) store(o, g * D + d, acc[g * D + d] * inv);
      }
    }
  });
}

void check_pools(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf) {
  check_float_or_bf16(q, "q");
  check_float_or_bf16(k_buf, "k_buf");
  check_float_or_bf16(v_buf, "v_buf");
  TORCH_CHECK(q.dim() == 3 && k_buf.dim() == 3 && v_buf.sizes() == k_buf.sizes(),
              "q must be (B, H, D), k_buf and v_buf (S, Hkv, D) alike");
  TORCH_CHECK(k_buf.scalar_type() == v_buf.scalar_type(), "k_buf and v_buf must share a dtype");
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type(), "q and the KV buffers must share a dtype");
  TORCH_CHECK(k_buf.size(2) == q.size(2) && q.size(1) % k_buf.size(1) == 0, "head sizes disagree");
}

void check_int32(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous() && (n < 0 || t.numel() == n), what,
              " must be contiguous int32", n >= 0 ? " of the right length" : "");
}

}  // namespace

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& indices, const at::Tensor& indptr, const at::Tensor& key_start,
                            const at::Tensor& q_indptr, const at::Tensor& q_positions, int64_t window, double scaling,
                            double softcap) {
  check_pools(q, k_buf, v_buf);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), S = k_buf.size(0), Hkv = k_buf.size(1);
  const int64_t B = key_start.numel();
  check_int32(indices, -1, "indices");
  check_int32(indptr, B + 1, "indptr");
  check_int32(key_start, B, "key_start");
  check_int32(q_indptr, B + 1, "q_indptr");
  check_int32(q_positions, T, "q_positions");
  const int32_t *kp = indptr.data_ptr<int32_t>(), *qp = q_indptr.data_ptr<int32_t>();
  TORCH_CHECK(kp[0] == 0 && kp[B] <= indices.numel() && qp[0] == 0 && qp[B] == T, "indptr or q_indptr does not fit");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(kp[b + 1] >= kp[b] && qp[b + 1] >= qp[b], "indptr and q_indptr must not decrease");
  auto out = at::empty_like(q);
  const Shape s{H, Hkv, H / Hkv, D, S, static_cast<float>(scaling), static_cast<float>(softcap)};
  with_float_type(q.scalar_type(), [&](auto tag) {
    using F = decltype(tag);
    attend_extend<F>(data_of<F>(q), data_of<F>(k_buf), data_of<F>(v_buf), indices.data_ptr<int32_t>(), kp,
                     key_start.data_ptr<int32_t>(), qp, q_positions.data_ptr<int32_t>(), B, window,
                     mutable_data_of<F>(out), s);
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& indices, const at::Tensor& indptr, double scaling, double softcap) {
  check_pools(q, k_buf, v_buf);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), S = k_buf.size(0), Hkv = k_buf.size(1);
  TORCH_CHECK(indices.scalar_type() == at::kInt && indices.is_contiguous() && indptr.scalar_type() == at::kInt &&
                  indptr.is_contiguous() && indptr.numel() == B + 1,
              "indices and indptr must be contiguous int32, indptr (B + 1,)");
  const int32_t* ip = indptr.data_ptr<int32_t>();
  TORCH_CHECK(ip[0] == 0 && ip[B] <= indices.numel(), "indptr does not fit indices");
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(ip[b + 1] >= ip[b], "indptr must not decrease");
  auto out = at::empty_like(q);
  const Shape s{H, Hkv, H / Hkv, D, S, static_cast<float>(scaling), static_cast<float>(softcap)};
  with_float_type(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    attend<T>(data_of<T>(q), data_of<T>(k_buf), data_of<T>(v_buf), indices.data_ptr<int32_t>(), ip,
              mutable_data_of<T>(out), B, s);
  });
  return out;
}

}  // namespace swa

namespace swa {

void write_kv(at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& loc, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k_buf.dim() == 3 && k_buf.is_contiguous() && v_buf.is_contiguous() && v_buf.sizes() == k_buf.sizes(),
              "k_buf and v_buf must be contiguous (S, Hkv, D) alike");
  TORCH_CHECK((loc.scalar_type() == at::kLong || loc.scalar_type() == at::kInt) && loc.dim() == 1,
              "loc must be (T,) int64 or int32");
  const int64_t T = loc.size(0), S = k_buf.size(0), Hkv = k_buf.size(1), D = k_buf.size(2);
  for (const auto* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) == Hkv && t->size(2) == D && t->stride(2) == 1 &&
                    t->scalar_type() == k_buf.scalar_type(),
                "k and v must be (T, Hkv, D) rows of the buffers' dtype, each head's values contiguous");
  }
  const auto lc = loc.to(at::kLong).contiguous();
  const int64_t* slots = lc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < S, "slot ", slots[t], " outside the pool of ", S);
  const int64_t bytes = D * k_buf.element_size();
  for (auto [buf, src] : {std::pair<at::Tensor*, const at::Tensor*>{&k_buf, &k}, {&v_buf, &v}}) {
    auto* dst = static_cast<uint8_t*>(buf->data_ptr());
    const auto* from = static_cast<const uint8_t*>(src->data_ptr());
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < Hkv; ++h) {
        std::memcpy(dst + ((slots[t] * Hkv + h) * D) * buf->element_size(),
                    from + (t * src->stride(0) + h * src->stride(1)) * src->element_size(), bytes);
      }
    }
  }
}

}  // namespace swa
