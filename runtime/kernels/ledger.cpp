// The KV sanitizer's write check, for the outcome of almost every forward: everything in order.
//
// The sanitizer holds the slots of a forward's first full-pool and first SWA write against the ownership ledger.
// As torch (or numpy) operations that took 70-85 us of a batch-1 decode step: they run first in the forward,
// when the caches hold the last step's weights, and each operation's code and tables come back from memory.
// Here it is one call; anything but "in order" is left to the torch checks, which claim, report and raise.

#include "ledger.h"

namespace swa {

namespace {

bool plain_int64(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous();
}

bool plain_slots(const at::Tensor& t, int64_t n) {
  return t.device().is_cpu() && (t.scalar_type() == at::kLong || t.scalar_type() == at::kInt) && t.dim() == 1 &&
         t.size(0) == n;
}

}  // namespace

bool writes_owned(const at::Tensor& full_owner, const at::Tensor& full_pos, const at::Tensor& loc,
                  const at::Tensor& rows, const at::Tensor& pos, const c10::optional<at::Tensor>& swa_owner,
                  const c10::optional<at::Tensor>& swa_loc, bool full) {
  const int64_t T = rows.numel();
  if (!plain_int64(full_owner) || !plain_int64(full_pos) || !plain_int64(rows) || !plain_int64(pos) ||
      pos.numel() != T || !plain_slots(loc, T) || full_pos.numel() != full_owner.numel())
    return false;
  const bool swa = swa_loc.has_value() && swa_loc->defined();
  if (swa && (!swa_owner.has_value() || !plain_int64(*swa_owner) || !plain_slots(*swa_loc, T))) return false;
  const int64_t* owner = full_owner.data_ptr<int64_t>();
  const int64_t* at_pos = full_pos.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t slots = full_owner.numel(), swa_slots = swa ? swa_owner->numel() : 0;
  const int64_t* swa_owners = swa ? swa_owner->data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < T; ++i) {
    const int64_t s = slot_at(loc, i);
    const bool pad = row[i] == 0;
    if (full) {
      if (s < 0 || s >= slots) return false;
      if (pad ? s != 0 : (owner[s] != row[i] || at_pos[s] != p[i])) return false;
    }
    if (swa) {
      const int64_t w = slot_at(*swa_loc, i);
      if (w < 0 || w >= swa_slots) return false;
      if (pad ? w != 0 : (w == 0 || swa_owners[w] != s)) return false;
    }
  }
  return true;
}

}  // namespace swa
