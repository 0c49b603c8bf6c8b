"""Fault switches (`--inject NAME`): each reintroduces one historical bug of the translation cache.

Off by default. They exist so that the diagnostics can show, on demand, what each missing invalidation
looks like in the metrics and logs. One module owns them; the engine reads them once at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

FAULTS = {
    "skip-forward-invalidation": "invalidate only on the eager path, after the graph branch",
    "skip-capture-invalidation": "graph warm-up/capture runs do not invalidate",
    "skip-register-mapping-invalidation": "a mapping rebuilt after host load-back does not clear the cache",
    "storage-pointer-key": "key the memo on the storage base pointer instead of the view's pointer",
    "window-buffer-pollution": "the sliding-window buffer's fresh index tensor goes through the cache",
    "skip-alloc-invalidation": "allocator mutations of the mapping forget to invalidate",
}


# Mapping mutations of the hybrid allocator (register_mapping is the host tier's, with a switch of its own);
# the prefix cache's eviction and tombstones are frees under their own site names.
ALLOCATOR_SITES = frozenset({"alloc", "free", "free_swa", "clear", "set_mapping", "clear_swa_mapping",
                             "prefix_evict", "prefix_tombstone", "spec_rollback"})
# Rebuilt mappings registered after a host load-back: a request's (retraction) or the prefix cache's.
REGISTER_SITES = frozenset({"register_mapping", "prefix_loadback"})


@dataclass(frozen=True)
class Faults:
    names: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, names) -> "Faults":
        unknown = sorted(set(names) - set(FAULTS))
        if unknown:
            raise ValueError(f"unknown fault switch(es) {', '.join(unknown)}; known: {', '.join(FAULTS)}")
        return cls(frozenset(names))

    def __contains__(self, name: str) -> bool:
        if name not in FAULTS:
            raise KeyError(name)
        return name in self.names

    def skips_invalidation(self, site: str, replay: bool = False) -> bool:
        """Whether a switch removes the invalidation at `site` (for forward entry: of a forward that replays
        static buffers, `replay`, or runs eagerly)."""
        if site == "forward_entry":  # the entry invalidation happens on the eager path only
            return replay and "skip-forward-invalidation" in self
        if site == "graph_capture":
            return "skip-capture-invalidation" in self
        if site in REGISTER_SITES:
            return "skip-register-mapping-invalidation" in self
        return site in ALLOCATOR_SITES and "skip-alloc-invalidation" in self

    def translator_options(self) -> dict:
        return {
            "key_mode": "storage" if "storage-pointer-key" in self else "view",
            "one_off_bypass": "window-buffer-pollution" not in self,
        }
