// The KV sanitizer's write check in one pass (ledger.cpp).

#pragma once

#include "common.h"

namespace swa {

// Whether every new token's write is in order against the ownership ledger, as the sanitizer's torch checks
// (runtime/mem_cache/sanitizer.py, `_check_full_write` and `_check_swa_write`) would find it, with nothing for
// them to claim: `full` checks loc (T,) against full_owner/full_pos (row rows[i] at position pos[i]; a padded
// token, row 0, writes slot 0 only); swa_loc, when given, against swa_owner (its full slot loc[i]; padding: 0).
// False for anything else, including an index out of range or an unexpected dtype: the torch checks then decide.
bool writes_owned(const at::Tensor& full_owner, const at::Tensor& full_pos, const at::Tensor& loc,
                  const at::Tensor& rows, const at::Tensor& pos, const c10::optional<at::Tensor>& swa_owner,
                  const c10::optional<at::Tensor>& swa_loc, bool full);

}  // namespace swa
