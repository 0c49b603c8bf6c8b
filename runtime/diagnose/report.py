"""The diagnose report: rows per policy x site x classification, suggested fixes, rendering.

The rows, their totals and the table are shared with `diagnose --from-log` (from_log.py), which builds the
same rows from a structured log instead of a workload run.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.diagnose.workload import BENIGN, PHASES, Mismatch, RunResult
from runtime.mem_cache.translation import ONE_OFF_SITE
from telemetry.events import KeyChangeEvent


MUTATION_CODE = {
    "register_mapping": "HybridKVPool.register_mapping -> HybridAllocator.register_mapping",
    "set_mapping": "HybridAllocator.set_full_to_swa_mapping",
    "clear_swa_mapping": "HybridAllocator.clear_swa_mapping",
    "alloc": "HybridAllocator._map (alloc, alloc_extend, alloc_decode, alloc_window)",
    "free": "HybridAllocator.free",
    "free_swa": "HybridAllocator.free_swa",
    "clear": "HybridAllocator.clear",
}


# The KV sanitizer's classes (docs/kv-sanitizer.md): what went wrong, before the path that last moved the slot.
SANITIZER_FIX = {
    "foreign_slot_write": "a KV write went to a slot its token does not own (graph padding not reset to the sink, "
                          "a write location cached outside the translator): fix the code that built the location",
    "foreign_slot_read": "attention read a slot another request or position owns (a stale request-table row, a "
                         "mapping moved without the allocator): rewrite the row or move slots through the allocator",
    "freed_slot_read": "attention read a slot that was freed or tombstoned while still in a window: the release "
                       "came too early (window eviction, a partial-page free, an evicted locked node)",
}


def _mutation_site(cause: str | None) -> str | None:
    """The hooked mutation a stale_loc cause names: "<site> wrote N rows (registered a rebuilt mapping) without
    invalidating" (the writer is known) or "mapping changed at <site>" (the latest mutation)."""
    if not cause:
        return None
    for part in cause.split(";"):
        if part.strip().endswith("without invalidating"):
            return part.split()[0]
    marker = "mapping changed at "
    if marker in cause:
        return cause.split(marker, 1)[1].split(";")[0].strip()
    return None


def suggest_fix(e: KeyChangeEvent) -> str:
    """One line: which invalidation is missing, and where it belongs."""
    c = e.classification
    crossed = e.prev_forward_id is not None and e.prev_forward_id != e.forward_id
    if c == "stale_loc":
        if e.cause and "verification" in e.cause:
            return "a write no version counter sees (raw kernel, numpy) changed the buffer: invalidate right after it"
        if crossed:
            return (f"the entry crossed from forward {e.prev_forward_id} to {e.forward_id} while its buffer was "
                    "rewritten in place (a reused static buffer: rule 5 outranks rule 6): invalidate at forward "
                    "entry, before the graph/eager branch")
        site = _mutation_site(e.cause)
        if site is not None:
            return (f"the mapping mutation `{site}` ({MUTATION_CODE.get(site, site)}) changed the mapping "
                    "mid-forward without invalidate_loc_cache(): invalidate there")
        return "an in-place write to the location buffer reached the cache without invalidate_loc_cache(): add it there"
    if c in SANITIZER_FIX:
        return f"{SANITIZER_FIX[c]}; the slot was last allocated, freed or moved by {e.last_path or 'an unknown path'}"
    if c == "cross_forward":
        return (f"missing forward-entry invalidation: the entry from forward {e.prev_forward_id} ({e.prev_mode}) "
                f"reached forward {e.forward_id} ({e.mode}); invalidate before the graph/eager branch")
    if c == "capture_pollution":
        return "invalidate at the start of every graph warm-up/capture run, or the captured graph records no gather"
    if c == "view_offset":
        return "key the memo on the view's data_ptr(), not the storage base pointer"
    if ONE_OFF_SITE in (e.site, e.prev_site):
        return (f"the one-off `{ONE_OFF_SITE}` translation went through the cache and evicted the forward's entry: "
                "route it around the cache (docs/translation-rules.md rule 1)")
    if c == BENIGN:
        return "benign: a second tensor translated within one forward (one extra gather)"
    return f"an unknown classification ({c}): see docs/translation-rules.md of the build that logged it"


def _stack(stack: str, outer: int = 3, inner: int = 2) -> str:
    """The caller stack shortened to the engine path that led here (outermost frames: which runner branch)
    and the translate call site (innermost frames)."""
    parts = [p for p in stack.split(" > ") if p]
    if len(parts) > outer + inner:
        parts = parts[:outer] + ["..."] + parts[-inner:]
    return " > ".join(parts) or "-"


@dataclass
class Row:
    policy: str
    site: str
    classification: str
    count: int
    first: KeyChangeEvent | None
    phase: str | None  # workload phase of the first occurrence (None when read from a log)
    instance: str | None = None  # the replica the events came from (only when read from logs)
    setup: str | None = None  # the workload setup of the first occurrence (None when read from a log)

    @property
    def benign(self) -> bool:
        return self.classification == BENIGN  # anything else, `other` included (a newer build's class), is a bug

    def as_dict(self) -> dict:
        e, first = self.first, None
        if e is not None:
            first = {"forward_id": e.forward_id, "mode": e.mode, "setup": self.setup, "phase": self.phase,
                     "prev_site": e.prev_site,
                     "prev_forward_id": e.prev_forward_id, "prev_mode": e.prev_mode, "cause": e.cause,
                     "stack": e.stack}
        row = {"policy": self.policy, "site": self.site, "classification": self.classification,
               "count": self.count, "benign": self.benign, "first": first,
               "fix": suggest_fix(e) if e is not None else None}
        return row if self.instance is None else {"instance": self.instance, **row}


def row_totals(rows: list[Row]) -> dict:
    """Event counts over `rows`: non-benign, benign, and per classification."""
    by_class: dict[str, int] = {}
    for r in rows:
        by_class[r.classification] = by_class.get(r.classification, 0) + r.count
    return {"non_benign_events": sum(r.count for r in rows if not r.benign),
            "benign_events": sum(r.count for r in rows if r.benign),
            "by_classification": by_class}


def render_rows(rows: list[Row], show_instance: bool = False) -> list[str]:
    """The table: one line per row (instance first when asked), then origin, cause, stack and fix."""
    width = max([10] + [len(r.instance or "") + 2 for r in rows]) if show_instance else 0
    header = (f"{'instance':<{width}}" if show_instance else "") + (
        f"{'policy':<12}{'site':<16}{'classification':<21}{'kind':<8}{'count':>5}  {'first seen':<40}filled by")
    lines = [header, "-" * (len(header) + 30)]
    if not rows:
        lines.append("(no key-change events)")
    for r in rows:
        e = r.first
        where = r.phase if r.setup in (None, "base") else f"{r.setup}/{r.phase}"
        seen = f"fwd {e.forward_id} {e.mode}" + (f" ({where})" if r.phase else "") if e else "-"
        filled = f"{e.prev_site} @ fwd {e.prev_forward_id} {e.prev_mode}" if e and e.prev_site else "-"
        kind = "benign" if r.benign else "BUG"
        instance = f"{r.instance or '-':<{width}}" if show_instance else ""
        lines.append(f"{instance}{r.policy:<12}{r.site:<16}{r.classification:<21}{kind:<8}{r.count:>5}  "
                     f"{seen:<40}{filled}")
        if e is not None:
            indent = " " * (width + 12)
            if e.cause:
                lines.append(f"{indent}cause: {e.cause}")
            if e.stack:
                lines.append(f"{indent}stack: {_stack(e.stack)}")
            lines.append(f"{indent}fix:   {suggest_fix(e)}")
    return lines


def render_verdict(totals: dict, failures: list[str], exit_status: int) -> list[str]:
    """The closing lines: event totals, the exit status, and each failure."""
    lines = [f"non-benign events: {totals['non_benign_events']}, benign: {totals['benign_events']}, "
             f"failures: {len(failures)} -> exit {exit_status}"]
    return lines + [f"  FAIL {f}" for f in failures]


@dataclass
class PolicyReport:
    policy: str
    runs: list[RunResult]  # one per workload setup
    reference: str  # what the outputs were compared with
    mismatches: list[Mismatch]
    failures: list[str]

    @property
    def result(self) -> RunResult:
        """The run of the first (base) setup."""
        return self.runs[0]

    @property
    def stale_guard_misses(self) -> int:
        return sum(r.stale_guard_misses for r in self.runs)

    @property
    def undetected(self) -> list[Mismatch]:
        return [m for m in self.mismatches if m.undetected]


@dataclass
class Report:
    model: str
    inject: tuple[str, ...]
    guard: bool
    verify: float
    policies: list[PolicyReport]
    rows: list[Row]

    @property
    def failures(self) -> list[str]:
        return [f"{p.policy}: {f}" for p in self.policies for f in p.failures]

    @property
    def exit_status(self) -> int:
        return 1 if self.failures else 0

    def totals(self) -> dict:
        return {**row_totals(self.rows), "output_mismatches": sum(len(p.mismatches) for p in self.policies),
                "undetected_corruption": sum(len(p.undetected) for p in self.policies),
                "failures": len(self.failures)}

    def as_dict(self) -> dict:
        return {
            "model": self.model, "inject": list(self.inject), "loc_cache_guard": self.guard,
            "loc_cache_verify": self.verify, "phases": list(PHASES),
            "setups": [r.setup for r in self.policies[0].runs] if self.policies else [],
            "rows": [r.as_dict() for r in self.rows],
            "undetected_corruption": [{"policy": p.policy, **vars(m)} for p in self.policies for m in p.undetected],
            "runs": [{"policy": p.policy, "reference": p.reference, "outputs_equal": not p.mismatches,
                      "mismatches": [vars(m) for m in p.mismatches],
                      "coverage": {r.setup: r.coverage for r in p.runs},
                      "memory_paths": {r.setup: r.memory_paths for r in p.runs},
                      "stale_guard_misses": p.stale_guard_misses,
                      "suppressed_logs": sum(r.suppressed_logs for r in p.runs), "failures": p.failures}
                     for p in self.policies],
            "totals": self.totals(),
            "failures": self.failures,
            "exit_status": self.exit_status,
        }


def _workload_lines(runs: list[RunResult]) -> list[str]:
    """What one policy's runs exercised: per setup its phases, then runner branches and memory paths summed."""
    lines = ["workload per policy, setups: " + "; ".join(f"{r.setup} ({', '.join(r.outputs)})" for r in runs)]
    for title, field in (("branches and features", "coverage"), ("memory paths", "memory_paths")):
        total: dict[str, int] = {}
        for r in runs:
            for k, v in getattr(r, field).items():
                total[k] = total.get(k, 0) + v
        lines.append(f"  {title}: " + ", ".join(f"{k} {v}" for k, v in total.items()))
    return lines


def render(report: Report) -> str:
    """The table for people: one line per (policy, site, classification), then origin, cause, stack and fix."""
    lines = [f"swa-runtime diagnose: model {report.model}, inject {' '.join(report.inject) or '(none)'}, "
             f"guard {'on' if report.guard else 'off'}" + (f", verify {report.verify:g}" if report.verify else "")]
    if report.policies:
        lines += _workload_lines(report.policies[0].runs)
    lines.append("")
    lines += render_rows(report.rows)
    lines.append("")
    undetected = [(p.policy, m) for p in report.policies for m in p.undetected]
    if undetected:
        lines.append("undetected corruption: outputs the dense reference contradicts, no bug-class event in the phase")
        lines.append(f"{'policy':<12}{'setup':<11}{'phase':<18}{'tokens differ':>14}  max |dlogit|")
        for policy, m in undetected:
            lines.append(f"{policy:<12}{m.setup:<11}{m.phase:<18}{f'{m.tokens_differ}/{m.tokens_total}':>14}  "
                         f"{m.max_logit_diff:.3g}")
        lines.append("")
    for p in report.policies:
        n = p.stale_guard_misses
        recomputed = f" ({n} stale {'entry' if n == 1 else 'entries'} recomputed)" if n else ""
        lines.append(f"outputs {p.policy:<12}{'equal' if not p.mismatches else 'DIFFER'} vs {p.reference}{recomputed}")
        lines += [f"{'':<20}{m.describe()}" + (" (undetected)" if m.undetected else "") for m in p.mismatches]
    lines += ["", *render_verdict(report.totals(), report.failures, report.exit_status)]
    return "\n".join(lines)
