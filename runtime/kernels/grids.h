// Finding the grid a dequantised weight's values lie on, in one pass (grids.cpp): what `int8_block_grid` and
// `int4_grid` (runtime/layers/int8_blocks.py, int4.py) ask of every projection and of the LM head at load; and the
// head screen's coarse copy.

#pragma once

#include <optional>
#include <tuple>
#include <vector>

#include "common.h"

namespace swa {

// w (N, K) float32, K a multiple of 32: per block of 32 consecutive values of a row, the first of `units` k for
// which step = (the block's largest magnitude) / k is a float16 value and every value is a whole number of steps
// within `tolerance` of a step; (q int8 (N, K), step float32 (N, K / 32)) with w == q * step, or nothing if a block
// fits no k (an all-zero block: step 0, q 0).
std::optional<std::tuple<at::Tensor, at::Tensor>> int8_block_grid(const at::Tensor& w,
                                                                  const std::vector<int64_t>& units,
                                                                  double tolerance);

// w (N, K) float32, K a multiple of 32: per group of 32 consecutive values of a row, the finest of 15..1 steps from
// its minimum to its maximum on which every value lies within `tolerance` of a step; (q int32 (N, K) in 0..15,
// step (N, K / 32), low (N, K / 32)) with w == low + step * q, or nothing if a group fits none (a constant group:
// step 0, q 0).
std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> int4_grid(const at::Tensor& w, double tolerance);

// w (N, K) float32, K a multiple of 32: each group of 32 rounded to the nearest of 16 levels evenly spaced from its
// minimum to its maximum (lossy: the LM head screen's copy, runtime/layers/head_screen.py); (q int32 in 0..15,
// step, low) as `int4_grid` gives them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> coarse_int4(const at::Tensor& w);

}  // namespace swa
