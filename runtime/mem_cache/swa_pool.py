"""The hybrid KV pool: routes each layer to the full or the SWA pool and owns the location translation.

Sliding layers are addressed with full-pool locations like every other layer; the pool translates them to
SWA slots through the policy chosen at start-up (`--loc-cache`). Mapping mutations in the allocator reach
the translator through an invalidation hook, so the cache is cleared at the mutation site itself.

The model runner tells the pool which forward runs (`begin_forward`), and the forward-entry invalidation
happens there: nothing here reads a global forward context.
"""

from __future__ import annotations

import torch

from runtime.faults import Faults
from runtime.mem_cache.hybrid import HybridAllocator
from runtime.mem_cache.kv_pool import KVPool
from runtime.mem_cache.sanitizer import KVSanitizer, NullSanitizer
from runtime.mem_cache.translation import Translator


class HybridKVPool:
    def __init__(self, allocator: HybridAllocator, layer_is_swa: list[bool], num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, translator: Translator, device: str | torch.device = "cpu",
                 faults: Faults = Faults(), sanitizer: NullSanitizer = NullSanitizer()):
        """`sanitizer`: the KV ownership checks (a `KVSanitizer` over `allocator.ledger`), off by default."""
        self.allocator = allocator
        self.layer_is_swa = list(layer_is_swa)
        full_layers = [i for i, s in enumerate(layer_is_swa) if not s]
        swa_layers = [i for i, s in enumerate(layer_is_swa) if s]
        ps = allocator.page_size
        self.full_pool = KVPool(allocator.full.size, ps, len(full_layers), num_kv_heads, head_dim, dtype, device)
        self.swa_pool = KVPool(allocator.swa.size, ps, len(swa_layers), num_kv_heads, head_dim, dtype, device)
        # layer id -> (pool, index inside that pool, is_swa)
        self._route: list[tuple[KVPool, int, bool]] = [None] * len(layer_is_swa)  # type: ignore[list-item]
        for local, layer in enumerate(full_layers):
            self._route[layer] = (self.full_pool, local, False)
        for local, layer in enumerate(swa_layers):
            self._route[layer] = (self.swa_pool, local, True)
        self.translator = translator
        self.faults = faults
        self.sanitizer = sanitizer
        allocator.add_invalidate_hook(self._on_mapping_mutation)

    # ---- the forward in progress -------------------------------------------------------------------------
    def begin_forward(self, forward_id: int, mode: str, replay: bool = False) -> None:
        """A forward (or a graph warm-up/capture run) starts: no cached translation may survive into it, so
        the cache is invalidated here, before any layer runs, whichever branch (a replay over static buffers,
        `replay`, or eager) runs it."""
        site = "graph_capture" if mode == "graph_capture" else "forward_entry"
        if not self.faults.skips_invalidation(site, replay):
            self.translator.invalidate(site)
        self.translator.begin_forward(forward_id, mode)
        self.sanitizer.begin_forward(forward_id, mode)

    def end_forward(self) -> None:
        self.translator.end_forward()
        self.sanitizer.end_forward()

    # ---- routing -----------------------------------------------------------------------------------------
    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool, local, _ = self._route[layer_id]
        return pool.get_kv(local)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                      swa_loc: torch.Tensor | None = None) -> torch.Tensor:
        """Write k/v of the tokens at full-pool locations `loc`; returns the slots of the layer's pool written. A
        sliding layer translates `loc` unless the backend already did (`swa_loc`, the per_forward policy). With
        k and v None nothing is written: the translation and the sanitizer's write check run as for a write, and
        the caller writes the slots returned itself, in the same forward (the fused decode stack)."""
        pool, local, is_swa = self._route[layer_id]
        if is_swa:
            if swa_loc is None:
                swa_loc = self.translator.translate(loc, "kv_write", local)
            loc_written = swa_loc
        else:
            loc_written = loc
        self.sanitizer.check_write(loc, swa_loc if is_swa else None)
        if k is not None:
            pool.set_kv(local, loc_written, k, v)
        return loc_written

    # ---- translation -------------------------------------------------------------------------------------
    def translate_loc_from_full_to_swa(self, loc: torch.Tensor, site: str = "kv_write", layer_pos: int = 0) -> torch.Tensor:
        return self.translator.translate(loc, site, layer_pos)

    def invalidate_loc_cache(self, site: str = "manual") -> None:
        self.translator.invalidate(site)

    def register_mapping(self, mapping: torch.Tensor, site: str = "register_mapping") -> None:
        """Adopt a rebuilt mapping (a load-back at `site`), after auditing the current one: no laundering."""
        self.translator.audit_before_register(site)
        self.allocator.register_mapping(mapping, site=site)

    def _on_mapping_mutation(self, site: str) -> None:
        if not self.faults.skips_invalidation(site):
            self.translator.invalidate(site)
        else:  # the fault switch: the write happened, its invalidation did not; the guard names the writer
            self.translator.note_silent_write(site, self.allocator.last_mutation_rows)

    # ---- sizes -------------------------------------------------------------------------------------------
    def bytes_per_token(self) -> tuple[int, int]:
        """(full-pool bytes, SWA-pool bytes) of K/V per token slot."""
        return self.full_pool.bytes_per_token(), self.swa_pool.bytes_per_token()


def build_hybrid_kv_pool(*, full_size: int, swa_size: int, page_size: int, layer_is_swa: list[bool],
                         num_kv_heads: int, head_dim: int, dtype: torch.dtype, policy: str, stats, reporter,
                         device: str | torch.device = "cpu", faults: Faults = Faults(), kv_sanitizer: str = "off",
                         **translator_options) -> HybridKVPool:
    """Allocator, translator and pool wired together. `stats` is the engine's TranslationStats; `faults` the
    `--inject` switches (the memo's own come in `translator_options`); `kv_sanitizer` off, sampled or strict
    (off without a reporter: its events could not be counted)."""
    from runtime.mem_cache.translation import make_translator

    sanitize = kv_sanitizer != "off" and reporter is not None
    allocator = HybridAllocator(full_size, swa_size, page_size, device, ownership=sanitize)
    translator = make_translator(policy, allocator, stats, reporter, **translator_options)
    sanitizer = KVSanitizer(allocator.ledger, reporter, policy, kv_sanitizer) if sanitize else NullSanitizer()
    return HybridKVPool(allocator, layer_is_swa, num_kv_heads, head_dim, dtype, translator, device, faults,
                        sanitizer)
