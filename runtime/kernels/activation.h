// The gated GELU of Gemma's MLP (activation.cpp).

#pragma once

#include "common.h"

namespace swa {

// out (rows, I) = GELU_tanh(gate) * up for gate_up (rows, 2I) = [gate | up], each rounded where torch's two
// operations round (the GELU's output, then the product).
template <typename T>
void gelu_and_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t I);

at::Tensor gelu_and_mul(const at::Tensor& gate_up);

}  // namespace swa
