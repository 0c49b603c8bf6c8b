// Decode attention: one query per request over keys read in place from the KV pool, each (request, kv head)
// split into chunks of keys so that two threads share even one request, merged at the end; and the KV write.

#include "attention.h"
#include "attention_chunk.h"

namespace swa {

using namespace attention;

namespace {

// q_stride: values from one request's query heads to the next's (H * D where contiguous).
template <typename T>
void attend(const T* q, int64_t q_stride, const T* kb, const T* vb, const int32_t* idx, const int32_t* indptr, T* out,
            int64_t B, const Shape& s) {
  const int64_t G = s.G, D = s.D, H = s.H, Hkv = s.Hkv;
  const int64_t threads = at::get_num_threads();
  const int64_t pairs = B * Hkv;
  // A single (request, kv head): one chunk a thread (each chunk has a set-up); more: two a thread, for balance. At
  // one chunk a request each thread reads whole requests: their rows fetched into L2 (`Chunk::far`).
  const int64_t chunks = pairs == 1 ? threads : std::max<int64_t>(1, (2 * threads + pairs - 1) / pairs);
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
      scaled_rows(q + b * q_stride + kh * G * D, G * D, pre, qf.data());
      p.resize(G * std::max<int64_t>(j1 - j0, 1));
      const Chunk chunk{idx + first + j0, j1 - j0, kh, true, chunks == 1};
      routine(qf.data(), kb, vb, chunk, s, p.data(), m.data() + it * G, l.data() + it * G, acc.data() + it * G * D);
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

}  // namespace

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
    attend<T>(data_of<T>(q), H * D, data_of<T>(k_buf), data_of<T>(v_buf), indices.data_ptr<int32_t>(), ip,
              mutable_data_of<T>(out), B, s);
  });
  return out;
}

template <typename T>
void decode_attention_rows(const T* q, int64_t q_stride, const T* k_buf, const T* v_buf, const int32_t* indices,
                           const int32_t* indptr, T* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t S,
                           float scaling, float softcap) {
  attend<T>(q, q_stride, k_buf, v_buf, indices, indptr, out, B, Shape{H, Hkv, H / Hkv, D, S, scaling, softcap});
}

template void decode_attention_rows<float>(const float*, int64_t, const float*, const float*, const int32_t*,
                                           const int32_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                                           float);
template void decode_attention_rows<bf16>(const bf16*, int64_t, const bf16*, const bf16*, const int32_t*,
                                          const int32_t*, bf16*, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                                          float);

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
