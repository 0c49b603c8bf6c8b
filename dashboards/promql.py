"""Check PromQL text against the metric contract (telemetry/names.py) and the recording rules.

Dashboards and alerts name metrics in free text, so a renamed metric would only show up as an empty
panel. These helpers pull the `swa_runtime_*` metric names, `swa_runtime:*` recording-rule names and
closed-set label values out of an expression so that `generate --check` and the tests can reject
anything the runtime does not export.
"""

from __future__ import annotations

import re
from pathlib import Path

from telemetry import names

RECORDING_RULES = Path(__file__).parent / "prometheus" / "rules" / "recording.yml"

# Histograms expose these series besides their base name (the base name itself is never a series).
HISTOGRAMS = (
    names.FORWARD_SECONDS,
    names.TIME_TO_FIRST_TOKEN,
    names.INTER_TOKEN_LATENCY,
    names.E2E_REQUEST_LATENCY,
    names.SPEC_ACCEPTANCE_LENGTH,
)
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# A name starts where no identifier character precedes it, so `foo_swa_runtime_x` is not matched.
_NAME = re.compile(r"(?<![A-Za-z0-9_:])(swa_runtime[_:][A-Za-z0-9_:]*)")
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_RECORD = re.compile(r"^\s*-?\s*record:\s*[\"']?([A-Za-z_:][A-Za-z0-9_:]*)", re.MULTILINE)
_PLAIN_ALTERNATIVES = re.compile(r"^[A-Za-z0-9_]+(\|[A-Za-z0-9_]+)*$")

# Closed label sets a query may filter on. `site` is shared by invalidation and translate sites.
LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "policy": names.POLICIES,
    "path": names.PATHS,
    "reason": names.MISS_REASONS,
    "classification": names.CLASSIFICATIONS,
    "site": names.INVALIDATION_SITES + names.TRANSLATE_SITES,
    "mode": names.FORWARD_MODES,
    "pool": names.KV_POOLS,
    "state": names.KV_STATES,
    "status": names.REQUEST_STATUSES,
    "event": names.LOG_EVENT_NAMES,
}


def contract_series() -> frozenset[str]:
    """Every series name the runtime exports according to names.py."""
    metrics = {
        value
        for key, value in vars(names).items()
        if key.isupper() and isinstance(value, str) and value.startswith(names.PREFIX) and value != names.PREFIX
    }
    series = metrics - set(HISTOGRAMS)
    series |= {h + suffix for h in HISTOGRAMS for suffix in HISTOGRAM_SUFFIXES}
    return frozenset(series)


def recording_rule_names(path: Path = RECORDING_RULES) -> frozenset[str]:
    """Names recorded by a rules file (read with a regex: this module stays stdlib-only)."""
    return frozenset(_RECORD.findall(path.read_text()))


def referenced_names(expr: str) -> list[str]:
    """`swa_runtime_*` metric and `swa_runtime:*` rule names named in a PromQL expression, in order."""
    return _NAME.findall(expr)


def unknown_names(expr: str, known: frozenset[str]) -> list[str]:
    return [name for name in referenced_names(expr) if name not in known]


def bad_label_values(expr: str) -> list[str]:
    """Matchers on a closed-set label whose value can never match (`classification="stale"`).

    Regex matchers are checked when they are a plain `a|b|c` alternation; values holding template
    variables (`$job`) or other regex syntax are left alone.
    """
    problems = []
    for label, op, value in _MATCHER.findall(expr):
        allowed = LABEL_VALUES.get(label)
        if allowed is None or "$" in value:
            continue
        if op in ("=~", "!~"):
            if not _PLAIN_ALTERNATIVES.match(value):
                continue
            candidates = value.split("|")
        else:
            candidates = [value]
        for candidate in candidates:
            if candidate not in allowed and candidate != names.OTHER:
                problems.append(f'{label}{op}"{value}" ({candidate!r} is not in {label} values)')
    return problems


def check_expr(expr: str, known: frozenset[str]) -> list[str]:
    """All contract problems of one expression, as readable messages."""
    problems = [f"unknown metric or rule {name!r}" for name in unknown_names(expr, known)]
    return problems + bad_label_values(expr)
