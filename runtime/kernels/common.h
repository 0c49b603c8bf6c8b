// What every kernel file shares: bfloat16 loads and stores that round as torch does, argument checks, the
// inverse RMS of a row. Arithmetic is float32 throughout; bfloat16 values are rounded to nearest-even where the
// torch path rounds them, so results match it up to the order of float32 sums.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace swa {

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

// The value a torch path that stores in T would hold: rounded for bfloat16, as is for float32.
template <typename T>
inline float as_stored(float f) {
  return std::is_same<T, bf16>::value ? round_bf16(f) : f;
}

template <typename T>
inline const T* data_of(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}
template <typename T>
inline T* mutable_data_of(at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

inline void check_float_or_bf16(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what,
              " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
}

// A thread's scratch buffer of at least n values, kept and grown as needed (a decode step would otherwise allocate
// a few a layer). One buffer per (F, kSlot): decode_layer.cpp takes slots 0-5, decode_stack.cpp 10-15.
template <typename F, int kSlot>
F* scratch(int64_t n) {
  thread_local std::vector<F> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// Element i of a 1-D int64 or int32 CPU tensor (a list of slots), as int64.
inline int64_t slot_at(const at::Tensor& t, int64_t i) {
  return t.scalar_type() == at::kLong ? t.data_ptr<int64_t>()[i * t.stride(0)]
                                      : static_cast<int64_t>(t.data_ptr<int32_t>()[i * t.stride(0)]);
}

inline void check_scale(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, what,
              " must be contiguous float32 with ", n, " values");
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

// Calls f.template operator()<T>() with T the C++ type of a float32 or bfloat16 tensor.
template <typename F>
inline void with_float_type(at::ScalarType type, F&& f) {
  if (type == at::kBFloat16) {
    f(bf16{});
  } else {
    f(float{});
  }
}

}  // namespace swa
