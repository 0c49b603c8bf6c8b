"""Full→SWA location translation policies (docs/translation-rules.md).

All four return the same int32 SWA locations; they differ in how often the gather runs and in what can go
stale. Counting is plain integers in `TranslationStats`; key-change events go to the `EventReporter`, which
classifies nothing itself: the decision rules live in `telemetry.events.classify_lookup`, and this module only
gathers the facts for them.

- `memo`: one entry keyed by `(data_ptr, numel)` of the location tensor. Its guard: the very tensor that
  filled it is still alive (a weak reference: a new tensor at a freed tensor's address is not the same key),
  its contents are unchanged (a snapshot: catches writes no version counter sees), the versions of the
  tensor and the mapping, the mapping tensor itself and its generation.
- `layerwise`: one entry keyed by the sliding-layer position; refilled at the first sliding layer; the same
  guard but for the weak reference (its key is not an address).
- `per_forward`, `off`: no entry; every call gathers (`per_forward` is called once per forward by the backend).

Every policy checks at the end of each forward that the mapping still equals what the allocator's hooked
mutations wrote (`MappingRecord.audit`: the rows the forward translated, and a stripe of the rest in turn):
a write by any other path is reported once as `stale_loc`, "mapping changed outside every hooked mutation",
in the forward where it was found.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from runtime.faults import REGISTER_SITES
from runtime.int_tensors import bounds
from runtime.mem_cache.mapping_record import Finding, MappingRecord, tensor_version
from telemetry.events import KeyChangeEvent, LookupFacts, caller_stack, classify_lookup
from telemetry.stats import TranslationStats

ONE_OFF_SITE = "window_indices"


UNSEEN_WRITE = "a write no version counter sees (numpy, a raw kernel, a graph replay's copy)"


@dataclass(slots=True)
class _Entry:
    key: tuple
    view: tuple  # (data_ptr, storage_offset) of the exact view the entry was filled from
    guard: tuple  # (loc version, mapping version, mapping generation)
    value: torch.Tensor
    forward_id: int
    mode: str
    site: str
    snapshot: torch.Tensor  # the location tensor's contents at fill time
    mapping: torch.Tensor  # the mapping tensor the value was gathered from
    filler: weakref.ref | None  # the tensor that filled it (memo); None when the key is not an address
    owner: weakref.ref | None  # what owns its memory: the filler's base tensor if it is a view, else the filler
    source: weakref.ref  # the tensor that filled it, whatever the policy: to say what kind of write moved it


class MappingSource(Protocol):
    """What a translator reads: the allocator's current mapping, its generation, last mutation site and the
    record of what the hooked mutations wrote."""

    full_to_swa_index_mapping: torch.Tensor
    mapping_generation: int
    last_mutation: str | None
    record: MappingRecord


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
        self._last_site = "other"  # the latest translate site, to attribute a mapping change found later
        # Copies of the location tensors this forward translated (each distinct tensor once): the mapping rows
        # the end-of-forward audit must compare. Copies, not the tensors: holding a temporary would keep its
        # address from being handed out again, and address reuse is one of the bugs the guard reports.
        self._translated: dict[tuple[int, int, int], torch.Tensor] = {}  # (address, length, version) -> copy
        self.last_forward = (0, "none")  # the latest forward begun (id, mode): what a load-back follows
        # Hooked mutations whose invalidation did not reach this translator (the skip-alloc-invalidation fault):
        # site -> rows written since the last invalidation or fill, so that the guard names the writer.
        self._silent_writes: dict[str, int] = {}

    def begin_forward(self, forward_id: int, mode: str) -> None:
        self.forward_id, self.mode = forward_id, mode
        self.last_forward = (forward_id, mode)

    def end_forward(self) -> None:
        """The forward is over: any mapping write outside the hooked mutations is reported now."""
        if self.reporter is not None and self.forward_id:
            copies = list(self._translated.values())
            rows = (copies[0] if len(copies) == 1 else torch.cat(copies)) if copies else None
            self.check_mapping_ownership(rows=rows)
        self._translated.clear()
        self.forward_id, self.mode = 0, "none"

    def note_translated(self, loc: torch.Tensor) -> None:
        """Remember `loc`'s rows for the end-of-forward audit (once per distinct tensor and contents)."""
        if self.reporter is None or not self.forward_id:
            return
        key = (loc.data_ptr(), loc.numel(), tensor_version(loc))
        if key not in self._translated:
            self._translated[key] = self._rows_of(loc)

    def _rows_of(self, loc: torch.Tensor) -> torch.Tensor:
        """A copy of `loc` as the mapping rows the audit compares (-1, padding, is the sentinel row: index_select
        takes no negative index)."""
        return loc.reshape(-1).remainder(self.source.full_to_swa_index_mapping.numel())

    def check_mapping_ownership(self, site: str | None = None, entry: "_Entry | None" = None,
                                rows: torch.Tensor | None = None, stripe: bool = True) -> bool:
        """Audit the mapping (`MappingRecord.audit`: `rows` and a stripe by content); report (once) a difference
        from what the hooked mutations wrote. True if there was one."""
        src = self.source
        finding = src.record.audit(src.full_to_swa_index_mapping, self.forward_id, rows, stripe)
        if finding is None:
            return False
        self._report("stale_loc", site or self._last_site, entry, (), self.unhooked_cause(finding))
        return True

    def audit_before_register(self, site: str) -> None:
        """A load-back (`site`) is about to adopt a rebuilt mapping: an unhooked write in the current one, made
        since the last audit, would be adopted with it and never counted. So the whole mapping is compared with
        the record first and a difference reported, with the latest forward and the load-back that found it."""
        if self.reporter is None:
            return
        src = self.source
        forward_id, mode = self.last_forward
        finding = src.record.audit_whole(src.full_to_swa_index_mapping, forward_id)
        if finding is None:
            return
        where = f"after forward {finding.clean_through} ended" if finding.clean_through else "since start-up"
        during = "during" if self.forward_id else "after"
        cause = (f"mapping changed outside every hooked mutation: {finding.change}; written {where}, found by the "
                 f"load-back at {site} {during} forward {forward_id} ({mode}) before adopting its rebuilt mapping; "
                 f"last hooked mutation: {src.last_mutation or 'none'}")
        self.reporter.report(KeyChangeEvent(
            policy=self.policy, site=site, classification="stale_loc", forward_id=forward_id, mode=mode,
            prev_site=None, prev_forward_id=None, prev_mode=None, cause=cause, key=(), prev_key=None,
            stack=caller_stack(skip=1)))

    def unhooked_cause(self, finding: Finding) -> str:
        where = f"after forward {finding.clean_through} ended" if finding.clean_through else "since start-up"
        return (f"mapping changed outside every hooked mutation: {finding.change}; written {where}, by forward "
                f"{self.forward_id} ({self.mode}); last hooked mutation: {self.source.last_mutation or 'none'}")

    def translate(self, loc: torch.Tensor, site: str, layer_pos: int = 0) -> torch.Tensor:
        if site != ONE_OFF_SITE:
            self._last_site = site  # so that a mapping change found at the end of the forward names it
        return self.gather(loc)

    def invalidate(self, site: str) -> None:
        self.stats.invalidation(site)
        self._silent_writes.clear()

    def note_silent_write(self, site: str, rows: int) -> None:
        """A hooked mapping mutation at `site` wrote `rows` rows but its invalidation was skipped."""
        self._silent_writes[site] = self._silent_writes.get(site, 0) + rows

    def gather(self, loc: torch.Tensor, checked: bool = False) -> torch.Tensor:
        """One gather through the mapping; int32 out. The only place translations are executed."""
        self.note_translated(loc)
        if not checked:
            self.check(loc)
        self.stats.translations()
        return self.source.full_to_swa_index_mapping[loc].to(torch.int32)

    def check(self, loc: torch.Tensor) -> None:
        """Clear errors for a location tensor the mapping cannot translate (before anything is touched)."""
        if loc.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"location tensor must be int32 or int64, got {loc.dtype}")
        mapping = self.source.full_to_swa_index_mapping
        if loc.is_cpu and loc.numel():  # range check is free on CPU, a sync on GPU
            lo, hi = bounds(loc)
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
        super().invalidate(site)
        if self._entry is not None:
            self._entry = None
            self._invalidated_since_fill = True

    def _guard(self, loc: torch.Tensor) -> tuple:
        src = self.source
        return (tensor_version(loc), tensor_version(src.full_to_swa_index_mapping), src.mapping_generation)

    def _holds(self, entry: _Entry, loc: torch.Tensor, guard: tuple) -> bool:
        """The entry still describes `loc`: versions, the mapping tensor, the memory the filling tensor viewed
        still owned by the same live tensor (so no other tensor took its address; another view of that live
        buffer is the same memory), and the same contents (catches writes no version counter sees)."""
        return (
            entry.guard == guard
            and entry.mapping is self.source.full_to_swa_index_mapping
            and (entry.owner is None or entry.owner() is not None)
            and torch.equal(loc, entry.snapshot)
        )

    def _cause(self, entry: _Entry, loc: torch.Tensor, guard: tuple) -> str:
        """Say what moved between fill and now: the buffer (and how), the mapping (and through which path)."""
        parts = []
        if entry.owner is not None and entry.owner() is None:
            parts.append("address reuse: the tensor that filled the entry was freed and another tensor of the "
                         "same length now sits at its address")
        elif not torch.equal(loc, entry.snapshot):
            parts.append(self._rewrite_cause(entry, loc, guard))
        elif entry.guard[0] != guard[0]:
            parts.append("loc buffer rewritten in place")
        src = self.source
        if entry.mapping is not src.full_to_swa_index_mapping or entry.guard[1:] != guard[1:]:
            finding = None
            if src.record.unhooked_change(src.full_to_swa_index_mapping) is not None:
                finding = src.record.audit(src.full_to_swa_index_mapping, self.forward_id, stripe=False)
            if finding is not None:
                parts.append(self.unhooked_cause(finding))
            elif self._silent_writes:  # name the mutation that wrote, not merely the latest one
                parts += [_silent_write_text(site, rows) for site, rows in self._silent_writes.items()]
            else:
                parts.append(f"mapping changed at {src.last_mutation or 'unknown site'}")
        return "; ".join(parts) or "unknown"

    @staticmethod
    def _rewrite_cause(entry: _Entry, loc: torch.Tensor, guard: tuple) -> str:
        """The location tensor's contents differ from the fill's: say what kind of write, only when it is known
        (the version counter of the very memory that filled the entry, and one that is tracked)."""
        source = entry.source()
        if source is None or not _same_counter(source, loc):
            return "another location tensor, with other contents, took the entry's key (the kind of write is unknown)"
        if guard[0] == -1:
            return "loc buffer rewritten in place (it tracks no version: the kind of write is unknown)"
        if entry.guard[0] != guard[0]:
            return "loc buffer rewritten in place"
        return f"loc buffer rewritten in place by {UNSEEN_WRITE}"

    def _fill(self, loc: torch.Tensor, key: tuple, view: tuple, guard: tuple, site: str,
              filler: weakref.ref | None) -> torch.Tensor:
        value = self.gather(loc, checked=True)
        owner = None
        if filler is not None:  # a view keeps its base alive: the base owns the memory the key points at
            base = loc._base
            owner = weakref.ref(loc if base is None else base)
        self._entry = _Entry(key, view, guard, value, self.forward_id, self.mode, site, loc.clone(),
                             self.source.full_to_swa_index_mapping, filler, owner, weakref.ref(loc))
        self._invalidated_since_fill = False
        self._silent_writes.clear()  # the value was gathered from the mapping as it is now
        return value

    def _lookup(self, loc: torch.Tensor, site: str, key: tuple, view: tuple, filler: weakref.ref | None) -> torch.Tensor:
        forward_id, mode = self.forward_id, self.mode
        self._last_site = site
        entry = self._entry
        guard = self._guard(loc)
        # Fast path: the plain hit of rule 8 (same key, view, guard and forward, the very same tensor).
        if (
            entry is not None
            and entry.key == key
            and entry.forward_id == forward_id
            and entry.view == view
            and entry.guard == guard
            and entry.mapping is self.source.full_to_swa_index_mapping
            and (entry.filler is None or entry.filler() is loc)
            and torch.equal(loc, entry.snapshot)
        ):  # the rows are the snapshot's, noted for the audit when this forward filled the entry
            return self._hit(loc, entry, site, mode)
        self.note_translated(loc)
        self.check(loc)
        same_key = entry is not None and entry.key == key
        facts = LookupFacts(
            has_entry=entry is not None,
            invalidated_since_fill=self._invalidated_since_fill,
            capturing=mode == "graph_capture",
            entry_before_capture_run=entry is not None and entry.forward_id != forward_id,
            same_key=same_key,
            same_view=entry is not None and entry.view == view,
            guard_equal=same_key and self._holds(entry, loc, guard),
            entry_from_earlier_forward=entry is not None and entry.forward_id != forward_id,
        )
        verdict = classify_lookup(facts, self.guard_enabled)
        if verdict.classification is not None:
            cause = self._cause(entry, loc, guard) if verdict.classification == "stale_loc" else None
            self._report(verdict.classification, site, entry, key, cause)
        if verdict.hit:
            return self._hit(loc, entry, site, mode)
        self.stats.miss(mode, verdict.reason)
        return self._fill(loc, key, view, guard, site, filler)

    def _hit(self, loc: torch.Tensor, entry: _Entry, site: str, mode: str) -> torch.Tensor:
        """A hit, except on sampled hits whose fresh gather disagrees: stale_loc, and the fresh value wins."""
        if self._verify_every:
            self._hits_since_verify += 1
            if self._hits_since_verify >= self._verify_every:
                self._hits_since_verify = 0
                fresh = self.gather(loc)
                if not torch.equal(fresh, entry.value):
                    if not self.check_mapping_ownership(site, entry, rows=self._rows_of(loc), stripe=False):
                        self._report("stale_loc", site, entry, entry.key, self._mismatch_cause(entry, loc))
                    self.stats.miss(mode, "stale_guard")
                    # The repair is a fresh fill: the entry now belongs to this forward.
                    self._fill(loc, entry.key, entry.view, self._guard(loc), site,
                               None if entry.filler is None else weakref.ref(loc))
                    return self._entry.value
        self.stats.hit(mode)
        return entry.value


    def _mismatch_cause(self, entry: _Entry, loc: torch.Tensor) -> str:
        """A sampled verification found the cached value wrong while the guard held: the versions did not move,
        which says "unseen by version counters" only if they are tracked and are the filling tensor's."""
        source = entry.source()
        tracked = -1 not in self._guard(loc)[:2]
        if source is not None and _same_counter(source, loc) and tracked:
            return f"verification mismatch ({UNSEEN_WRITE})"
        return ("verification mismatch: the cached translation differs from a fresh gather (the kind of write is "
                "unknown)")


def _silent_write_text(site: str, rows: int) -> str:
    if site in REGISTER_SITES:
        return f"{site} registered a rebuilt mapping without invalidating"
    return f"{site} wrote {rows} row{'s' if rows != 1 else ''} without invalidating"


def _same_counter(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share one version counter (the same tensor, or views of one base)."""
    return (a if a._base is None else a._base) is (b if b._base is None else b._base)


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
        filler = entry.filler if (entry := self._entry) is not None and entry.filler() is loc else weakref.ref(loc)
        return self._lookup(loc, site, key, (ptr, offset), filler)


class LayerwiseTranslator(_CachingTranslator):
    """Keyed by sliding-layer position: refilled at position 0, reused after. Its key says nothing about the
    tensor it is asked about, so the guard's contents snapshot is what ties a later layer's tensor to it."""

    policy = "layerwise"

    def translate(self, loc: torch.Tensor, site: str, layer_pos: int = 0) -> torch.Tensor:
        if site == ONE_OFF_SITE:
            return self.gather(loc)
        if layer_pos == 0:
            entry = self._entry
            reason = "invalidated" if self._invalidated_since_fill else ("cold" if entry is None else "key_changed")
            self.check(loc)
            self.stats.miss(self.mode, reason)
            self._last_site = site
            return self._fill(loc, ("layer", 0), ("layer", 0), self._guard(loc), site, None)
        return self._lookup(loc, site, ("layer", 0), ("layer", 0), None)


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
