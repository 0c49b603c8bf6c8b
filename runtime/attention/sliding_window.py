"""Window indices: which cached keys each request's queries may see, on full and on sliding layers.

Built once per forward in metadata init. On sliding layers only the keys inside the window of the batch's
earliest query are listed, as full-pool slots freshly gathered from the request table, then translated to
SWA slots in one one-off translation (site `window_indices`): a fresh tensor that must not disturb the
cached translation of the forward's write location.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.int_tensors import int_tensor


@dataclass
class KVIndexList:
    """Per-request key lists, flattened: request b's keys are indices[indptr[b]:indptr[b+1]], at absolute
    positions start[b], start[b]+1, ... (int32 throughout, as the kernels take them)."""

    indptr: torch.Tensor  # (B+1,) int32
    indices: torch.Tensor  # (N,) int32 pool slots
    start: torch.Tensor  # (B,) int32 position of each request's first listed key
    indptr_list: list[int]  # the same on the host, for backends that loop per request
    start_list: list[int]


def seen_by(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(..., Tq, L) bool: whether each query, at positions q_pos (..., Tq), sees each key, at k_pos (..., L): at or
    before it and, where `window` is set (> 0), fewer than `window` positions back. The rule every backend's mask
    follows (the kernels and Triton's in their own loops)."""
    back = q_pos[..., :, None] - k_pos[..., None, :]
    visible = back >= 0
    if window:
        visible &= back < window
    return visible


def build_kv_index_list(req_to_token: torch.Tensor, req_rows: list[int], prefix_lens: list[int],
                        seq_lens: list[int], window: int | None) -> tuple[torch.Tensor, list[int], list[int]]:
    """Full-pool slots of the keys each request needs: all of them (window None) or those from the window of
    the request's earliest new query (position prefix_len) on. Returns (full slots int64, starts, lengths)."""
    starts = [0 if window is None else max(0, p - window + 1) for p in prefix_lens]
    lens = [s - st for s, st in zip(seq_lens, starts)]
    rows = [req_to_token[r, st:s] for r, st, s in zip(req_rows, starts, seq_lens)]
    return torch.cat(rows) if rows else req_to_token.new_zeros(0), starts, lens


def to_index_list(slots: torch.Tensor, starts: list[int], lens: list[int]) -> KVIndexList:
    device = slots.device
    indptr_list = [0]
    for n in lens:
        indptr_list.append(indptr_list[-1] + n)
    indptr = int_tensor(indptr_list, torch.int32, device)
    return KVIndexList(indptr, slots.to(torch.int32), int_tensor(starts, torch.int32, device),
                       indptr_list, list(starts))


def window_index_list(pool, req_to_token: torch.Tensor, req_rows, prefix_lens, seq_lens, window: int) -> KVIndexList:
    """Sliding-layer key list in SWA slots: the one-off translation of a freshly computed index tensor."""
    full_slots, starts, lens = build_kv_index_list(req_to_token, req_rows, prefix_lens, seq_lens, window)
    swa_slots = pool.translate_loc_from_full_to_swa(full_slots, "window_indices")
    return to_index_list(swa_slots, starts, lens)
