// The grids of dequantised GGUF weights, found block by block in one pass, and the LM head's coarse 4-bit copy
// (grids.h). In torch operations the search made ten to twenty passes over each weight, some over gathered copies:
// 3.3 s of a server's start-up on a 2-core Xeon for Gemma 3 270M, most of it the 168M-value LM head. Here each block
// of 32 is read once and its candidate steps tried while it is in L1; the arithmetic is the torch version's (float32
// divisions, rounding to nearest even), so the grids found are the same (tests/models/test_grids.py).

#include "grids.h"

#include <c10/util/Half.h>

#include <atomic>
#include <cmath>

namespace swa {

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kGrain = 2048;  // blocks a task

void check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous() && w.size(1) % kBlock == 0,
              "the weight must be contiguous float32 (N, K) with K a multiple of 32");
}

// Whether every value / step is within `tol` of a whole number; t[i] = v[i] / step. Without branches, so that the
// compiler puts the block in vectors.
inline bool on_grid(const float* v, float step, float tol, float* t) {
  int off = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    t[i] = v[i] / step;
    off |= !(std::fabs(t[i] - std::nearbyint(t[i])) <= tol);
  }
  return off == 0;
}

// Whether a block's values are all finite: a NaN or an infinity is on no grid.
inline bool finite(const float* v) {
  for (int64_t i = 0; i < kBlock; ++i)
    if (!std::isfinite(v[i])) return false;
  return true;
}

// A weight w (N, K), checked, and the tensors of its int4 grid: q int32 (N, K), step and low (N, K / 32).
struct Int4Tensors {
  at::Tensor q, steps, lows;
  const float* src;
  int32_t* qp;
  float *sp, *lp;
  int64_t groups;
  explicit Int4Tensors(const at::Tensor& w) {
    check_weight(w);
    q = at::empty(w.sizes(), w.options().dtype(at::kInt));
    steps = at::empty({w.size(0), w.size(1) / kBlock}, w.options());
    lows = at::empty_like(steps);
    src = w.data_ptr<float>();
    qp = q.data_ptr<int32_t>();
    sp = steps.data_ptr<float>();
    lp = lows.data_ptr<float>();
    groups = w.numel() / kBlock;
  }
  std::tuple<at::Tensor, at::Tensor, at::Tensor> tuple() const { return std::make_tuple(q, steps, lows); }
};

}  // namespace

std::optional<std::tuple<at::Tensor, at::Tensor>> int8_block_grid(const at::Tensor& w,
                                                                  const std::vector<int64_t>& units,
                                                                  double tolerance) {
  check_weight(w);
  for (const int64_t k : units) TORCH_CHECK(k >= 1 && k <= 127, "units must lie in 1..127");
  const int64_t N = w.size(0), K = w.size(1), blocks = N * K / kBlock;
  auto q = at::empty({N, K}, w.options().dtype(at::kChar));
  auto steps = at::empty({N, K / kBlock}, w.options());
  const float* src = w.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = steps.data_ptr<float>();
  const float tol = static_cast<float>(tolerance);
  std::atomic<bool> failed{false};
  at::parallel_for(0, blocks, kGrain, [&](int64_t b0, int64_t b1) {
    float t[kBlock];
    for (int64_t b = b0; b < b1 && !failed.load(std::memory_order_relaxed); ++b) {
      const float* v = src + b * kBlock;
      if (!finite(v)) {
        failed = true;
        return;
      }
      float top = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) top = std::max(top, std::fabs(v[i]));
      float step = 0.f;
      if (top > 0.f) {
        for (const int64_t k : units) {
          const float trial = top / static_cast<float>(k);
          if (static_cast<float>(c10::Half(trial)) == trial && on_grid(v, trial, tol, t)) {
            step = trial;
            break;
          }
        }
        if (step == 0.f) {
          failed = true;
          return;
        }
      }
      sp[b] = step;
      for (int64_t i = 0; i < kBlock; ++i)
        qp[b * kBlock + i] = step > 0.f ? static_cast<int8_t>(std::clamp(std::nearbyint(t[i]), -127.f, 127.f)) : 0;
    }
  });
  if (failed) return std::nullopt;
  return std::make_tuple(q, steps);
}

std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> int4_grid(const at::Tensor& w, double tolerance) {
  Int4Tensors out(w);
  const float tol = static_cast<float>(tolerance);
  std::atomic<bool> failed{false};
  at::parallel_for(0, out.groups, kGrain, [&](int64_t g0, int64_t g1) {
    float offsets[kBlock], t[kBlock];
    for (int64_t g = g0; g < g1 && !failed.load(std::memory_order_relaxed); ++g) {
      const float* v = out.src + g * kBlock;
      if (!finite(v)) {
        failed = true;
        return;
      }
      float low = v[0];
      for (int64_t i = 1; i < kBlock; ++i) low = std::min(low, v[i]);
      float span = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) {
        offsets[i] = v[i] - low;
        span = std::max(span, offsets[i]);
      }
      float step = 0.f;
      if (span > 0.f) {
        for (int k = 15; k >= 1 && step == 0.f; --k) {
          const float trial = span / static_cast<float>(k);
          if (on_grid(offsets, trial, tol, t)) step = trial;
        }
        if (step == 0.f) {
          failed = true;
          return;
        }
      }
      out.sp[g] = step;
      out.lp[g] = low;
      for (int64_t i = 0; i < kBlock; ++i)
        out.qp[g * kBlock + i] = step > 0.f ? static_cast<int32_t>(std::nearbyint(t[i])) : 0;
    }
  });
  if (failed) return std::nullopt;
  return out.tuple();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> coarse_int4(const at::Tensor& w) {
  Int4Tensors out(w);
  at::parallel_for(0, out.groups, kGrain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const float* v = out.src + g * kBlock;
      float low = v[0], high = v[0];
      for (int64_t i = 1; i < kBlock; ++i) {
        low = std::min(low, v[i]);
        high = std::max(high, v[i]);
      }
      const float step = (high - low) / 15.f, divisor = step > 0.f ? step : 1.f;
      out.sp[g] = step;
      out.lp[g] = low;
      for (int64_t i = 0; i < kBlock; ++i)
        out.qp[g * kBlock + i] = static_cast<int32_t>(std::clamp(std::nearbyint((v[i] - low) / divisor), 0.f, 15.f));
    }
  });
  return out.tuple();
}

}  // namespace swa
