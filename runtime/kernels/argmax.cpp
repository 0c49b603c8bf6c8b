// Greedy sampling's pass over the logits: a row's maximum and the first index of it. torch's `max(-1)` with indices
// runs one value at a time on one thread (~130 us for Gemma's 262144 logits, 1.5% of a batch-1 decode step on a
// 2-core EPYC); here sixteen lanes at a time, each row split into chunks the threads share.

#include "argmax.h"

#include <limits>

#include "vecmath.h"

namespace swa {

namespace {

constexpr int64_t kMinChunk = 16384;  // values; fewer are not worth a thread

struct Best {
  float value;
  int64_t index;
  bool nan;
};

// The first maximum of x[i0, i1): each lane keeps its first strict maximum, the lanes then give the largest value
// at the smallest index.
Best scan(const float* x, int64_t i0, int64_t i1) {
  Best best{-std::numeric_limits<float>::infinity(), i0, false};
  int64_t i = i0;
#if defined(__AVX512F__)
  if (i1 - i0 >= 16) {
    __m512 top = _mm512_loadu_ps(x + i0);
    __m512i at = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(i0)),
                                  _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
    __m512i here = at;
    const __m512i step = _mm512_set1_epi32(16);
    for (i = i0 + 16; i + 16 <= i1; i += 16) {
      here = _mm512_add_epi32(here, step);
      const __m512 v = _mm512_loadu_ps(x + i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 more = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
      top = _mm512_mask_mov_ps(top, more, v);
      at = _mm512_mask_mov_epi32(at, more, here);
    }
    alignas(64) float tops[16];
    alignas(64) int32_t ats[16];
    _mm512_store_ps(tops, top);
    _mm512_store_si512(reinterpret_cast<__m512i*>(ats), at);
    best = {tops[0], ats[0], nan != 0};
    for (int lane = 1; lane < 16; ++lane) {
      const bool earlier_tie = tops[lane] == best.value && ats[lane] < best.index;
      if (tops[lane] > best.value || earlier_tie) best = {tops[lane], ats[lane], best.nan};
    }
  }
#endif
  for (; i < i1; ++i) {
    if (std::isnan(x[i])) best.nan = true;
    if (x[i] > best.value) best = {x[i], i, best.nan};
  }
  return best;
}

}  // namespace

std::vector<at::Tensor> row_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.is_contiguous() && logits.size(1) >= 1 && logits.size(1) < (int64_t{1} << 31),
              "logits must be contiguous (B, V) float32 on the CPU with 1 <= V < 2^31");
  const int64_t B = logits.size(0), V = logits.size(1);
  auto top = at::empty({B}, logits.options());
  auto index = at::empty({B}, logits.options().dtype(at::kLong));
  if (B == 0) return {top, index};
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = std::max<int64_t>(1, std::min((threads + B - 1) / B, V / kMinChunk));
  const int64_t per = (V + chunks - 1) / chunks;
  std::vector<Best> found(B * chunks);
  const float* x = logits.data_ptr<float>();
  at::parallel_for(0, B * chunks, 1, [&](int64_t a, int64_t b) {
    for (int64_t it = a; it < b; ++it) {
      const int64_t row = it / chunks, c = it % chunks;
      found[it] = scan(x + row * V, std::min(V, c * per), std::min(V, (c + 1) * per));
    }
  });
  for (int64_t row = 0; row < B; ++row) {
    Best best = found[row * chunks];
    for (int64_t c = 1; c < chunks; ++c) {  // in order: a tie keeps the earlier chunk's index
      const Best& other = found[row * chunks + c];
      if (other.index >= V) continue;  // an empty chunk
      if (other.value > best.value) best = {other.value, other.index, best.nan};
      best.nan |= other.nan;
    }
    top.data_ptr<float>()[row] = best.nan ? std::numeric_limits<float>::quiet_NaN() : best.value;
    index.data_ptr<int64_t>()[row] = best.index;
  }
  return {top, index};
}

}  // namespace swa
