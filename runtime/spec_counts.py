"""Speculative decoding's acceptance, as the benches report it: draft tokens proposed and accepted, verify
forwards (per request) and the tokens they emitted, summed over algorithms. Read from an engine's own
counters (`telemetry.stats.SpecStats`, offline) or from a server's `/metrics` text (the same counters,
exported); a measurement is the difference of two readings, before and after.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from telemetry import names

# the exported series each count sums (every algorithm's label)
METRIC_SERIES = {"drafted": names.SPEC_DRAFT_TOKENS, "accepted": names.SPEC_ACCEPTED_TOKENS,
                 "verifies": names.SPEC_ACCEPTANCE_LENGTH + "_count",
                 "emitted": names.SPEC_ACCEPTANCE_LENGTH + "_sum"}


@dataclass(frozen=True)
class SpecCounts:
    drafted: float = 0.0  # draft tokens proposed
    accepted: float = 0.0  # of them, accepted by the target model
    verifies: float = 0.0  # (request, verify forward) pairs
    emitted: float = 0.0  # tokens those verifies emitted: accepted draft tokens plus the target's own

    @classmethod
    def from_stats(cls, spec) -> SpecCounts:
        """From an engine's `stats.spec` (a `telemetry.stats.SpecStats`)."""
        lengths = [h.snapshot() for h in spec.acceptance_length.values()]
        return cls(sum(spec.draft_tokens.values()), sum(spec.accepted_tokens.values()),
                   sum(s.count for s in lengths), sum(s.sum for s in lengths))

    @classmethod
    def from_metrics(cls, text: str) -> SpecCounts:
        """From Prometheus text exposition (a server's `/metrics`)."""
        by_name = {series: count for count, series in METRIC_SERIES.items()}
        totals = dict.fromkeys(METRIC_SERIES, 0.0)
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            series, _, value = line.rpartition(" ")
            count = by_name.get(series.partition("{")[0])
            if count is not None:
                totals[count] += float(value)
        return cls(**totals)

    @classmethod
    def from_dict(cls, counts: dict) -> SpecCounts:
        """From `as_dict()` (its derived ratios ignored)."""
        return cls(*(counts[f.name] for f in fields(cls)))

    def __sub__(self, before: SpecCounts) -> SpecCounts:
        return SpecCounts(*(a - b for a, b in zip(asdict(self).values(), asdict(before).values())))

    @property
    def rate(self) -> float | None:
        """Accepted / drafted (None without drafts)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def per_verify(self) -> float | None:
        """Mean tokens a request got from one verify forward (1 = nothing accepted; None without verifies)."""
        return self.emitted / self.verifies if self.verifies else None

    def as_dict(self) -> dict:
        return asdict(self) | {"rate": self.rate, "per_verify": self.per_verify}

    def summary(self) -> str:
        """One phrase for a report line."""
        if not self.drafted:
            return "no draft tokens proposed"
        return (f"{self.rate:.1%} of {self.drafted:.0f} draft tokens accepted, {self.per_verify:.2f} tokens per "
                "verify")
