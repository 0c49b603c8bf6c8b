"""Render the swa-runtime Grafana dashboard (dashboards/dashboard.py) to JSON, or check it.

    python -m dashboards.generate            # write dashboards/grafana/dashboards/swa-runtime.json
    python -m dashboards.generate --check    # exit 1 if the committed JSON is stale or names an
                                             # unknown metric, recording rule or label value

Metric names come from `telemetry.names`, so a rename there shows up as a diff here; `--check` also
parses every query of the committed JSON, so a hand edit that names a metric the runtime does not
export fails even when the code is right. Stdlib only (plus names.py).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any, Iterator

if __package__ in (None, ""):  # run as a script: make `telemetry` and `dashboards` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboards import promql  # noqa: E402
from dashboards.dashboard import build  # noqa: E402

OUTPUT = Path(__file__).parent / "grafana" / "dashboards" / "swa-runtime.json"


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def iter_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target, variable query and annotation of a dashboard."""
    for panel in iter_panels(dashboard):
        for t in panel.get("targets", []):
            yield f"panel {panel.get('title')!r} target {t.get('refId')}", t.get("expr", "")
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query", "")
        if var.get("type") == "query":
            yield f"variable {var.get('name')!r}", query or ""
    for ann in dashboard.get("annotations", {}).get("list", []):
        if ann.get("expr"):
            yield f"annotation {ann.get('name')!r}", ann["expr"]


def contract_problems(dashboard: dict[str, Any]) -> list[str]:
    known = promql.contract_series() | promql.recording_rule_names()
    return [f"{where}: {problem}" for where, expr in iter_queries(dashboard) for problem in promql.check_expr(expr, known)]


def check(path: Path) -> list[str]:
    """Problems with the committed dashboard at `path`: staleness and contract violations."""
    if not path.exists():
        return [f"{path} does not exist; run python -m dashboards.generate"]
    committed = path.read_text()
    problems: list[str] = []
    try:
        problems += contract_problems(json.loads(committed))
    except json.JSONDecodeError as exc:
        problems.append(f"{path} is not valid JSON: {exc}")
    expected = render()
    problems += [f"generated dashboard: {p}" for p in contract_problems(json.loads(expected))]
    if committed != expected:
        diff = difflib.unified_diff(
            committed.splitlines(), expected.splitlines(), "committed", "generated", n=1, lineterm=""
        )
        shown = "\n".join(list(diff)[:40])
        problems.append(f"{path} differs from what generate.py produces; run python -m dashboards.generate\n{shown}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify instead of writing")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="dashboard JSON path (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.output)
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        if not problems:
            print(f"ok: {args.output} is up to date and names only contract metrics")
        return 1 if problems else 0
    problems = contract_problems(build())
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(render())
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
