"""Render the swa-runtime Grafana dashboards to JSON, or check them: the main one (dashboards/dashboard.py)
and the fleet one (dashboards/fleet.py).

    python -m dashboards.generate            # write dashboards/grafana/dashboards/swa-runtime{,-fleet}.json
    python -m dashboards.generate --check    # exit 1 if a committed JSON is stale or names an
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

from dashboards import fleet, promql  # noqa: E402
from dashboards.dashboard import build  # noqa: E402

BUILDERS = {"swa-runtime": build, "swa-runtime-fleet": fleet.build}
OUTPUTS = {name: Path(__file__).parent / "grafana" / "dashboards" / f"{name}.json" for name in BUILDERS}
OUTPUT, FLEET_OUTPUT = OUTPUTS["swa-runtime"], OUTPUTS["swa-runtime-fleet"]


def render(name: str = "swa-runtime") -> str:
    return json.dumps(BUILDERS[name](), indent=2) + "\n"


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


def check(path: Path, name: str = "swa-runtime") -> list[str]:
    """Problems with the committed dashboard `name` at `path`: staleness and contract violations."""
    if not path.exists():
        return [f"{path} does not exist; run python -m dashboards.generate"]
    committed = path.read_text()
    problems: list[str] = []
    try:
        problems += contract_problems(json.loads(committed))
    except json.JSONDecodeError as exc:
        problems.append(f"{path} is not valid JSON: {exc}")
    expected = render(name)
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
    parser.add_argument("--dashboard", choices=sorted(BUILDERS), default=None,
                        help="only this dashboard (default: all; with --output: swa-runtime)")
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default: grafana/dashboards/NAME.json)")
    args = parser.parse_args(argv)
    if args.output is not None:
        targets = [(args.dashboard or "swa-runtime", args.output)]
    else:
        targets = [(name, OUTPUTS[name]) for name in ([args.dashboard] if args.dashboard else BUILDERS)]
    if args.check:
        problems = [p for name, path in targets for p in check(path, name)]
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        if not problems:
            print(f"ok: {', '.join(str(path) for _, path in targets)} up to date and naming only contract metrics")
        return 1 if problems else 0
    problems = [p for name, _ in targets for p in contract_problems(BUILDERS[name]())]
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    for name, path in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(name))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
