"""Attention backend interface: metadata once per forward, then one call per layer.

`init_forward_metadata` runs once per forward, before the first layer: it lists each request's keys (all of
them for full layers, the window for sliding layers, already translated to SWA slots) and, under the
`per_forward` policy, translates the write location once. `forward` then writes the layer's new k/v into its
pool and attends. Graph capture/replay needs nothing more: the metadata is rebuilt from the static buffers
on every replay, so its addresses and the padded entries (slot 0, the sink) stay valid.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from runtime.attention.sliding_window import KVIndexList, build_kv_index_list, to_index_list, window_index_list
from runtime.executor.forward_batch import ForwardBatch
from runtime.int_tensors import int_tensor


@dataclass
class AttentionMetadata:
    qo_indptr: torch.Tensor  # (B+1,) int32 offsets of each request's new tokens in T
    qo_list: list[int]  # the same on the host
    q_positions: torch.Tensor  # (T,) int32
    full: KVIndexList  # keys of full-attention layers (full-pool slots)
    swa: KVIndexList | None  # keys of sliding layers (SWA-pool slots), None when the model has none
    swa_out_loc: torch.Tensor | None  # write location in SWA slots, only under the per_forward policy
    max_extend_len: int


class AttentionBackend(ABC):
    name = "base"

    def __init__(self, pool, req_to_token, sliding_window: int | None):
        self.pool = pool  # HybridKVPool
        self.req_to_token = req_to_token  # ReqToTokenPool
        self.sliding_window = sliding_window
        self.batch: ForwardBatch | None = None
        self.meta: AttentionMetadata | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = self.req_to_token.req_to_token
        full_slots, starts, lens = build_kv_index_list(table, batch.req_rows, batch.prefix_lens, batch.seq_lens, None)
        swa = None
        if self.sliding_window is not None:
            swa = window_index_list(self.pool, table, batch.req_rows, batch.prefix_lens, batch.seq_lens,
                                    self.sliding_window)
        swa_out_loc = None
        if self.pool.translator.policy == "per_forward":
            swa_out_loc = self.pool.translate_loc_from_full_to_swa(batch.out_cache_loc, "attn_metadata")
        extend = batch.extend_lens
        qo = [0]
        for n in extend:
            qo.append(qo[-1] + n)
        device = batch.input_ids.device
        self.meta = AttentionMetadata(
            qo_indptr=int_tensor(qo, torch.int32, device),
            qo_list=qo,
            q_positions=batch.positions.to(torch.int32),
            full=to_index_list(full_slots, starts, lens),
            swa=swa,
            swa_out_loc=swa_out_loc,
            max_extend_len=max(extend) if extend else 0,
        )
        self.batch = batch
        self.pool.sanitizer.bind(batch, table)  # the tokens its write and read checks hold the slots against

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer) -> torch.Tensor:
        """q (T, H, D), k/v (T, Hkv, D) → (T, H, D). Writes k/v first: a token attends to itself."""
        k_buf, v_buf, _, keys = self._write(layer, k, v)
        return self.attend(q, k_buf, v_buf, keys, layer)

    def attends_in_place(self, dtype: torch.dtype) -> bool:
        """Whether this forward's attention, for rows of `dtype`, is what the fused decode stack
        (`runtime/models/fused_decode.py`) computes itself: one query a request over its keys read in place
        from the pool. Only the torch backend's decode says yes (`runtime/attention/torch_native.py`)."""
        return False

    def fused_decode_io(self, layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, KVIndexList]:
        """For the fused decode stack, which writes and attends itself: the layer's KV buffers, the slots its new
        k/v go to and the keys its queries read, after the translation and the sanitizer checks `forward` makes,
        in its order (`set_kv_buffer` without k and v translates and checks a write it leaves to the caller)."""
        return self._write(layer, None, None)

    def _write(self, layer, k: torch.Tensor | None, v: torch.Tensor | None):
        """k/v written (or only translated and checked, when None); (k_buf, v_buf, slots, keys) for the attention."""
        meta = self.meta
        sliding = layer.sliding_window is not None
        slots = self.pool.set_kv_buffer(layer.layer_id, self.batch.out_cache_loc, k, v,
                                        swa_loc=meta.swa_out_loc if sliding else None)
        k_buf, v_buf = self.pool.get_kv_buffer(layer.layer_id)
        keys = meta.swa if sliding else meta.full
        self.pool.sanitizer.check_read(keys, sliding)
        return k_buf, v_buf, slots, keys

    @abstractmethod
    def attend(self, q, k_buf, v_buf, keys: KVIndexList, layer) -> torch.Tensor:
        """Attention of the batch's queries over `keys` (causal, windowed on sliding layers)."""
