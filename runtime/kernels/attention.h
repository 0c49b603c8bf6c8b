// Decode attention over keys read in place from the KV pool, and the KV write before it (attention.cpp).

#pragma once

#include <string>

#include "common.h"

namespace swa {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& indices, const at::Tensor& indptr, double scaling, double softcap);

// The new tokens of an extend (T, H, D), request b's rows q_indptr[b]..q_indptr[b+1], each at q_positions[t], over
// request b's keys indices[indptr[b]:indptr[b+1]] at positions key_start[b], key_start[b] + 1, ...: a query sees
// the keys at and before its position, and with a window W > 0 only the last W of them. Every key it cannot
// see is skipped, not masked.
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& indices, const at::Tensor& indptr, const at::Tensor& key_start,
                            const at::Tensor& q_indptr, const at::Tensor& q_positions, int64_t window, double scaling,
                            double softcap);

// The tiles extend attention runs its prompts' query rows on: "amx" (AMX-BF16), "bfloat16" (AVX512-BF16), "float32"
// (AVX2), or "none" (a token at a time). By default the fastest this CPU has; `set_extend_tiles` picks one (tests and
// benchmarks compare them; "auto" goes back to the fastest) and returns the previous name.
std::string extend_tiles();
std::string set_extend_tiles(const std::string& name);
// Whether extend attention's tiles run on AMX here (the torch route on AMX yields to them then).
bool amx_attention_on();

// k_buf[loc[t]] = k[t] and v_buf[loc[t]] = v[t] for each token t (loc int64 or int32): k, v (T, Hkv, D) rows of
// any stride.
// decode_attention on rows in memory, unchecked but for the key slots (the decode stack's own buffers): q (B, H, D)
// with q_stride values from one request's heads to the next's, out (B, H, D), the pools (S, Hkv, D).
template <typename T>
void decode_attention_rows(const T* q, int64_t q_stride, const T* k_buf, const T* v_buf, const int32_t* indices,
                           const int32_t* indptr, T* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t S,
                           float scaling, float softcap);

void write_kv(at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& loc, const at::Tensor& k, const at::Tensor& v);

}  // namespace swa
