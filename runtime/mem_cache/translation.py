"""Full→SWA location translation policies (docs/translation-rules.md).

All four return the same int32 SWA locations; they differ in how often the gather runs and in what can go
stale. Counting is plain integers in `TranslationStats`; key-change events go to the `EventReporter`, which
classifies nothing itself: the decision rules live in `telemetry.events.classify_lookup`, and this module only
gathers the facts for them.

- `memo`: one entry keyed by `(data_ptr, numel)` of the location tensor, guarded by the tensor's and the
  mapping's version counters and the mapping generation.
- `layerwise`: one entry keyed by the sliding-layer position; refilled at the first sliding layer.
- `per_forward`, `off`: no entry; every call gathers (`per_forward` is called once per forward by the backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from telemetry.events import KeyChangeEvent, LookupFacts, caller_stack, classify_lookup
from telemetry.stats import TranslationStats

ONE_OFF_SITE = "window_indices"


@dataclass(slots=True)
class _Entry:
    key: tuple
    view: tuple  # (data_ptr, storage_offset) of the exact view the entry was filled from
    guard: tuple  # (loc version, mapping version, mapping generation)
    value: torch.Tensor
    forward_id: int
    mode: str
    site: str


def _version(t: torch.Tensor) -> int:
    """The tensor's version counter; -1 for tensors created under inference_mode (they track none, so the
    guard cannot see their rewrites: sampled verification must)."""
    try:
        return t._version
    except RuntimeError:
        return -1


class MappingSource(Protocol):
    """What a translator reads: the allocator's current mapping, its generation and last mutation site."""

    full_to_swa_index_mapping: torch.Tensor
    mapping_generation: int
    last_mutation: str | None


class Translator:
    """Base: the gather itself, input checks and counting. Subclasses add caching."""

    policy = "off"

    def __init__(self, source: MappingSource, stats: TranslationStats, reporter=None):
        self.source = source
        self.stats = stats
        self.reporter = reporter
        # The forward in progress, as the pool was told (`begin_forward`); 0 / "none" between forwards.
        self.forward_id = 0
        self.mode = "none"

    def begin_forward(self, forward_id: int, mode: str) -> None:
        self.forward_id, self.mode = forward_id, mode

    def end_forward(self) -> None:
        self.forward_id, self.mode = 0, "none"

    def translate(self, loc: torch.Tensor, site: str, layer_pos: int = 0) -> torch.Tensor:
        return self.gather(loc)

    def invalidate(self, site: str) -> None:
        self.stats.invalidation(site)

    def gather(self, loc: torch.Tensor, checked: bool = False) -> torch.Tensor:
        """One gather through the mapping; int32 out. The only place translations are executed."""
        if not checked:
            self.check(loc)
        self.stats.translations()
        return self.source.full_to_swa_index_mapping[loc].to(torch.int32)

    def check(self, loc: torch.Tensor) -> None:
        """Clear errors for a location tensor the mapping cannot translate (before anything is touched)."""
        if loc.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"location tensor must be int32 or int64, got {loc.dtype}")
        mapping = self.source.full_to_swa_index_mapping
        if loc.device.type == "cpu" and loc.numel():  # range check is free on CPU, a sync on GPU
            lo, hi = int(loc.min()), int(loc.max())
            if lo < -1 or hi >= mapping.numel() - 1:
                raise IndexError(f"full-pool location out of range: min {lo}, max {hi}, valid -1..{mapping.numel() - 2}")

    def _report(self, classification: str, site: str, entry: _Entry | None, key: tuple, cause: str | None) -> None:
        if self.reporter is None:
            return
        self.reporter.report(
            KeyChangeEvent(
                policy=self.policy,
                site=site,
                classification=classification,
                forward_id=self.forward_id,
                mode=self.mode,
                prev_site=entry.site if entry else None,
                prev_forward_id=entry.forward_id if entry else None,
                prev_mode=entry.mode if entry else None,
                cause=cause,
                key=key,
                prev_key=entry.key if entry else None,
                stack=caller_stack(skip=3) if classification != "benign_fresh_tensor" else "",
            )
        )


class OffTranslator(Translator):
    policy = "off"


class PerForwardTranslator(Translator):
    policy = "per_forward"


class _CachingTranslator(Translator):
    """Shared state of memo and layerwise: one entry, the guard, verification sampling, invalidation."""

    def __init__(self, source, stats, reporter=None, *, guard: bool = True, verify_rate: float = 0.0):
        super().__init__(source, stats, reporter)
        self.guard_enabled = guard
        if not 0.0 <= verify_rate <= 1.0:
            raise ValueError(f"verify rate must be within [0, 1], got {verify_rate}")
        self._verify_every = round(1 / verify_rate) if verify_rate > 0 else 0
        self._hits_since_verify = 0
        self._entry: _Entry | None = None
        self._invalidated_since_fill = False

    def invalidate(self, site: str) -> None:
        self.stats.invalidation(site)
        if self._entry is not None:
            self._entry = None
            self._invalidated_since_fill = True

    def _guard(self, loc: torch.Tensor) -> tuple:
        src = self.source
        return (_version(loc), src.full_to_swa_index_mapping._version, src.mapping_generation)

    def _cause(self, entry: _Entry, guard: tuple) -> str:
        """Say what moved between fill and now: the buffer, the mapping (and its last mutation site)."""
        parts = []
        if entry.guard[0] != guard[0]:
            parts.append("loc buffer rewritten in place")
        if entry.guard[1] != guard[1] or entry.guard[2] != guard[2]:
            parts.append(f"mapping changed at {self.source.last_mutation or 'unknown site'}")
        return "; ".join(parts) or "unknown"

    def _fill(self, loc: torch.Tensor, key: tuple, view: tuple, guard: tuple, site: str) -> torch.Tensor:
        value = self.gather(loc, checked=True)
        self._entry = _Entry(key, view, guard, value, self.forward_id, self.mode, site)
        self._invalidated_since_fill = False
        return value

    def _lookup(self, loc: torch.Tensor, site: str, key: tuple, view: tuple) -> torch.Tensor:
        forward_id, mode = self.forward_id, self.mode
        entry = self._entry
        guard = self._guard(loc)
        # Fast path: the plain hit of rule 8 (same key, view, guard and forward).
        if (
            entry is not None
            and entry.key == key
            and entry.forward_id == forward_id
            and entry.view == view
            and entry.guard == guard
        ):
            return self._hit(loc, entry, site, mode)
        self.check(loc)
        facts = LookupFacts(
            has_entry=entry is not None,
            invalidated_since_fill=self._invalidated_since_fill,
            capturing=mode == "graph_capture",
            entry_before_capture_run=entry is not None and entry.forward_id != forward_id,
            same_key=entry is not None and entry.key == key,
            same_view=entry is not None and entry.view == view,
            guard_equal=entry is not None and entry.guard == guard,
            entry_from_earlier_forward=entry is not None and entry.forward_id != forward_id,
        )
        verdict = classify_lookup(facts, self.guard_enabled)
        if verdict.classification is not None:
            cause = self._cause(entry, guard) if verdict.classification == "stale_loc" else None
            self._report(verdict.classification, site, entry, key, cause)
        if verdict.hit:
            return self._hit(loc, entry, site, mode)
        self.stats.miss(mode, verdict.reason)
        return self._fill(loc, key, view, guard, site)

    def _count_hit(self, entry: _Entry, mode: str) -> torch.Tensor:
        self.stats.hit(mode)
        return entry.value

    def _hit(self, loc: torch.Tensor, entry: _Entry, site: str, mode: str) -> torch.Tensor:
        """A hit, except on sampled hits whose fresh gather disagrees: stale_loc, and the fresh value wins."""
        if self._verify_every:
            self._hits_since_verify += 1
            if self._hits_since_verify >= self._verify_every:
                self._hits_since_verify = 0
                fresh = self.gather(loc)
                if not torch.equal(fresh, entry.value):
                    self._report("stale_loc", site, entry, entry.key, "verification mismatch (write the version guard cannot see)")
                    self.stats.miss(mode, "stale_guard")
                    # The repair is a fresh fill: the entry now belongs to this forward.
                    self._entry = _Entry(entry.key, entry.view, self._guard(loc), fresh, self.forward_id, self.mode, site)
                    return fresh
        return self._count_hit(entry, mode)


class MemoTranslator(_CachingTranslator):
    """Keyed by `(data_ptr, numel)`. `key_mode="storage"` keys on the storage base pointer instead (the
    storage-pointer-key fault switch); `one_off_bypass=False` sends the window buffer's fresh indices through
    the cache (the window-buffer-pollution fault switch)."""

    policy = "memo"

    def __init__(self, source, stats, reporter=None, *, guard=True, verify_rate=0.0,
                 key_mode: str = "view", one_off_bypass: bool = True):
        super().__init__(source, stats, reporter, guard=guard, verify_rate=verify_rate)
        if key_mode not in ("view", "storage"):
            raise ValueError(f"key_mode must be 'view' or 'storage', got {key_mode!r}")
        self.key_mode = key_mode
        self.one_off_bypass = one_off_bypass

    def translate(self, loc: torch.Tensor, site: str, layer_pos: int = 0) -> torch.Tensor:
        if site == ONE_OFF_SITE and self.one_off_bypass:
            return self.gather(loc)  # rule 1: one gather, no lookup, the forward's entry untouched
        ptr, offset = loc.data_ptr(), loc.storage_offset()
        if self.key_mode == "view":
            key = (ptr, loc.numel())
        else:
            key = (ptr - offset * loc.element_size(), loc.numel())
        return self._lookup(loc, site, key, (ptr, offset))


class LayerwiseTranslator(_CachingTranslator):
    """Keyed by sliding-layer position: refilled at position 0, reused after. It cannot see which tensor it is
    asked about; the guard compares version counters only."""

    policy = "layerwise"

    def translate(self, loc: torch.Tensor, site: str, layer_pos: int = 0) -> torch.Tensor:
        if site == ONE_OFF_SITE:
            return self.gather(loc)
        if layer_pos == 0:
            entry = self._entry
            reason = "invalidated" if self._invalidated_since_fill else ("cold" if entry is None else "key_changed")
            self.check(loc)
            self.stats.miss(self.mode, reason)
            return self._fill(loc, ("layer", 0), ("layer", 0), self._guard(loc), site)
        return self._lookup(loc, site, ("layer", 0), ("layer", 0))


TRANSLATORS = {
    "memo": MemoTranslator,
    "layerwise": LayerwiseTranslator,
    "per_forward": PerForwardTranslator,
    "off": OffTranslator,
}


def make_translator(policy: str, source: MappingSource, stats: TranslationStats, reporter=None, **options) -> Translator:
    if policy not in TRANSLATORS:
        raise ValueError(f"unknown loc-cache policy {policy!r}; choose one of {', '.join(TRANSLATORS)}")
    cls = TRANSLATORS[policy]
    if cls in (OffTranslator, PerForwardTranslator):
        options = {}
    return cls(source, stats, reporter, **options)
