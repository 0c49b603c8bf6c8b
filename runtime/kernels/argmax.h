// The greedy token of each row of logits (argmax.cpp).

#pragma once

#include <vector>

#include "common.h"

namespace swa {

// logits (B, V) float32 -> {top (B,) float32, index (B,) int64}: each row's largest value and the first index
// holding it, as torch's `max(-1)` gives them; a row with a NaN gets NaN (max propagates it; its index is
// unspecified), so the caller can refuse non-finite rows from `top` alone.
std::vector<at::Tensor> row_argmax(const at::Tensor& logits);

}  // namespace swa
