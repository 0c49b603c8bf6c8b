// Decode attention over keys read in place from the KV pool, and the KV write before it (attention.cpp).

#pragma once

#include "common.h"

namespace swa {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& indices, const at::Tensor& indptr, double scaling, double softcap);

// k_buf[loc[t]] = k[t] and v_buf[loc[t]] = v[t] for each token t (loc int64 or int32): k, v (T, Hkv, D) rows of
// any stride.
void write_kv(at::Tensor& k_buf, at::Tensor& v_buf, const at::Tensor& loc, const at::Tensor& k, const at::Tensor& v);

}  // namespace swa
