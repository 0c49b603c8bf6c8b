"""The translation-cache lookup classifier and the key-change event record (docs/translation-rules.md).

The classifier is a pure function of what the memo cache observed, so the rules can be tested (and
re-stated) without torch or an engine. It runs on every lookup: verdicts are precomputed immutable objects,
so classifying allocates nothing.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class LookupFacts:
    """What the runtime's memo cache observed for one lookup."""

    has_entry: bool
    invalidated_since_fill: bool  # an invalidation emptied the cache since the last fill
    capturing: bool  # a graph capture run is in progress
    entry_before_capture_run: bool  # entry was filled before the current capture run began
    same_key: bool
    same_view: bool  # same data pointer and same storage as the view the entry was filled from
    guard_equal: bool  # loc version, mapping version and mapping generation unchanged
    entry_from_earlier_forward: bool


@dataclass(frozen=True, slots=True)
class LookupVerdict:
    """How one lookup is counted and what the cache returns."""

    hit: bool  # counted as a hit
    reason: str | None  # miss reason (names.MISS_REASONS) when not hit
    classification: str | None  # names.CLASSIFICATIONS, or None when nothing noteworthy happened
    use_cached: bool  # return the cached value (on a hit, and on a stale hit with the guard off)


HIT = LookupVerdict(hit=True, reason=None, classification=None, use_cached=True)
MISS_COLD = LookupVerdict(hit=False, reason="cold", classification=None, use_cached=False)
MISS_INVALIDATED = LookupVerdict(hit=False, reason="invalidated", classification=None, use_cached=False)
CAPTURE_POLLUTION = LookupVerdict(
    hit=False, reason="capture", classification="capture_pollution", use_cached=False
)
VIEW_OFFSET = LookupVerdict(hit=False, reason="key_changed", classification="view_offset", use_cached=False)
STALE_LOC = LookupVerdict(hit=False, reason="stale_guard", classification="stale_loc", use_cached=False)
# The unguarded design returned the stale value and counted it as a hit; the event still records it.
STALE_LOC_UNGUARDED = LookupVerdict(hit=True, reason=None, classification="stale_loc", use_cached=True)
CROSS_FORWARD_HIT = LookupVerdict(hit=True, reason=None, classification="cross_forward", use_cached=True)
CROSS_FORWARD_MISS = LookupVerdict(
    hit=False, reason="key_changed", classification="cross_forward", use_cached=False
)
BENIGN_FRESH_TENSOR = LookupVerdict(
    hit=False, reason="key_changed", classification="benign_fresh_tensor", use_cached=False
)


def classify_lookup(facts: LookupFacts, guard: bool = True) -> LookupVerdict:
    """Apply rules 2-8 of docs/translation-rules.md in order (rule 1, the one-off bypass, never reaches a
    lookup).

    `guard=False` reproduces the original unguarded memo: a same-key entry whose guard changed is still
    returned (and counted as a hit), but classified `stale_loc` so the event is not lost.
    """
    if not facts.has_entry:
        return MISS_INVALIDATED if facts.invalidated_since_fill else MISS_COLD  # rule 2
    if facts.capturing and facts.entry_before_capture_run:
        return CAPTURE_POLLUTION  # rule 3
    if facts.same_key:
        if not facts.same_view:
            return VIEW_OFFSET  # rule 4
        if not facts.guard_equal:
            return STALE_LOC if guard else STALE_LOC_UNGUARDED  # rule 5, before rule 6
        return CROSS_FORWARD_HIT if facts.entry_from_earlier_forward else HIT  # rules 6 and 8
    return CROSS_FORWARD_MISS if facts.entry_from_earlier_forward else BENIGN_FRESH_TENSOR  # rules 6 and 7


@dataclass(frozen=True, slots=True)
class KeyChangeEvent:
    """One classified key change, with where the stale or replaced entry came from.

    `forward_id` and `mode` may be None when the caller leaves them to the logging context
    (`telemetry.logging.bind_forward`).
    """

    policy: str
    site: str  # translate call site (names.TRANSLATE_SITES)
    classification: str  # names.CLASSIFICATIONS
    forward_id: int | None
    mode: str | None
    prev_site: str | None  # the site that filled the entry
    prev_forward_id: int | None
    prev_mode: str | None
    cause: str | None  # the mutation or invalidation that made the entry stale, where known
    key: tuple
    prev_key: tuple | None
    stack: str  # caller_stack() summary
    # KV sanitizer events only (names.SANITIZER_CLASSIFICATIONS): the first wrong slot of the access, its pool,
    # who should own it and who does, and the code path that last allocated, freed or moved it.
    slot: int | None = None
    pool: str | None = None
    expected_owner: str | None = None
    actual_owner: str | None = None
    last_path: str | None = None

    def as_dict(self) -> dict:
        """The event as a flat dict (structured log keys); the sanitizer's fields only where set."""
        fields = asdict(self)
        for name in SANITIZER_FIELDS:
            if fields[name] is None:
                del fields[name]
        return fields


SANITIZER_FIELDS = ("slot", "pool", "expected_owner", "actual_owner", "last_path")


_LIBRARY_MARKERS = (f"{os.sep}torch{os.sep}", f"{os.sep}contextlib.py")


def _is_library_frame(path: str) -> bool:
    return any(marker in path for marker in _LIBRARY_MARKERS)


def caller_stack(skip: int = 0, limit: int = 10) -> str:
    """Summarise the caller's frames as `dir/file.py:line function`, innermost last.

    `skip=0` starts at the function that calls `caller_stack`; each extra `skip` drops one more inner frame
    (e.g. the cache's own helpers). Walks frame objects without reading source files, so it is cheap, but it
    is still only for when an event is emitted, never for hits. Library frames (torch's module call
    machinery, contextlib) are passed over so that the summary reaches the engine code that called in.
    """
    frame = sys._getframe(skip + 1)
    parts = []
    while frame is not None and len(parts) < limit:
        code = frame.f_code
        path = code.co_filename
        if _is_library_frame(path):
            frame = frame.f_back
            continue
        short = os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))
        parts.append(f"{short}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    parts.reverse()
    return " > ".join(parts)
