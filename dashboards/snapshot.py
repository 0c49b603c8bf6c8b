"""Render every panel of the generated dashboard into one PNG, straight from Prometheus.

    python -m dashboards.snapshot --prometheus http://127.0.0.1:9090 --out docs/dashboard.png [--range 15m]

No Grafana is needed: each panel target is sent to Prometheus' HTTP API with the Grafana variables
substituted ($__rate_interval -> --rate-interval, $__range -> --range, $job/$instance -> regexes),
range queries for time series, instant queries for stat and table panels. `--require-data` makes the
run fail when any target returns no series, which is how a live test proves every query works.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboards.generate import OUTPUT as DASHBOARD_JSON, iter_panels  # noqa: E402

_DURATION = re.compile(r"^(\d+)([smhd])$")
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_UNIT_LABELS = {"percentunit": "%", "ops": "per second", "reqps": "requests/s", "s": "seconds", "short": "", "none": ""}


def parse_duration(text: str) -> int:
    """'15m' -> 900 (seconds). Prometheus-style, one unit."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"bad duration {text!r} (use e.g. 30s, 15m, 1h)")
    return int(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Replace Grafana variables ($name and ${name}); an unknown variable is an error."""

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in variables:
            raise KeyError(f"no value for Grafana variable ${name} in {expr!r}")
        return variables[name]

    return _VARIABLE.sub(replace, expr)


def legend(fmt: str, labels: dict[str, str]) -> str:
    if not fmt or fmt == "__auto":
        shown = {k: v for k, v in labels.items() if k not in ("__name__", "job")}
        return ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) or labels.get("__name__", "value")
    return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), fmt)


@dataclass
class Series:
    name: str
    labels: dict[str, str]
    times: list[float]
    values: list[float]


@dataclass
class PanelData:
    title: str
    kind: str
    unit: str
    series: list[Series] = field(default_factory=list)
    empty_targets: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class Prometheus:
    """The two read endpoints of the Prometheus HTTP API we need."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _get(self, path: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=self.timeout) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise RuntimeError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        return self._get("/api/v1/query_range", {"query": expr, "start": start, "end": end, "step": step})

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        return self._get("/api/v1/query", {"query": expr, "time": at})


def fetch(
    prom: Prometheus, dashboard: dict[str, Any], *, end: float, range_s: int, rate_interval: str,
    job: str = ".+", instance: str = ".+", router_job: str = ".+",
) -> list[PanelData]:
    """Query every target of every non-row panel; errors are recorded per panel, not raised."""
    variables = {"__rate_interval": rate_interval, "__range": f"{range_s}s", "job": job, "instance": instance,
                 "router_job": router_job}
    step = max(1.0, range_s / 120)
    panels = []
    for panel in iter_panels(dashboard):
        if panel.get("type") == "row":
            continue
        data = PanelData(panel["title"], panel["type"], panel.get("fieldConfig", {}).get("defaults", {}).get("unit", ""))
        for t in panel.get("targets", []):
            try:
                expr = substitute(t["expr"], variables)
                if t.get("instant"):
                    result = [{"metric": r["metric"], "values": [r["value"]]} for r in prom.query(expr, end)]
                else:
                    result = prom.query_range(expr, end - range_s, end, step)
            except Exception as exc:  # report and go on: one broken query must not hide the others
                data.errors.append(f"{t.get('refId')}: {exc}")
                continue
            if not result:
                data.empty_targets.append(t.get("refId", "?"))
            for r in result:
                points = [(float(ts), float(v)) for ts, v in r["values"]]
                data.series.append(
                    Series(legend(t.get("legendFormat", ""), r["metric"]), r["metric"], [p[0] for p in points], [p[1] for p in points])
                )
        panels.append(data)
    return panels


def _scale(unit: str) -> tuple[float, str]:
    if unit == "percentunit":
        return 100.0, "%"
    if unit.startswith("suffix:"):
        return 1.0, unit.split(":", 1)[1].strip()
    return 1.0, _UNIT_LABELS.get(unit, unit)


def _draw(ax: Any, panel: PanelData, end: float) -> None:
    scale, unit_label = _scale(panel.unit)
    ax.set_title(panel.title, fontsize=10, loc="left")
    if panel.errors or not panel.series:
        message = "\n".join(panel.errors) or "no data"
        ax.text(0.5, 0.5, message, ha="center", va="center", fontsize=8, color="firebrick", wrap=True, transform=ax.transAxes)
        ax.set_axis_off()
        return
    if panel.kind in ("table", "stat"):
        rows = [[_clip(s.name, 64), _fmt(s.values[-1] * scale, unit_label)] for s in panel.series[:12]]
        ax.set_axis_off()
        if panel.kind == "stat" and len(rows) <= 3:
            text = "\n".join(f"{name}\n{value}" for name, value in rows)
            ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=13, transform=ax.transAxes)
        else:
            tbl = ax.table(
                cellText=rows, colLabels=["series", "value"], colWidths=[0.8, 0.2], loc="upper center", cellLoc="left"
            )
            tbl.auto_set_font_size(False)
            tbl.set_fontsize(7)
        return
    for s in panel.series:
        minutes = [(t - end) / 60 for t in s.times]
        ax.plot(minutes, [v * scale for v in s.values], label=s.name, linewidth=1.2)
    ax.set_xlabel("minutes before snapshot", fontsize=8)
    ax.set_ylabel(unit_label, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="upper left", ncol=2 if len(panel.series) > 4 else 1)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _fmt(value: float, unit: str) -> str:
    if math.isnan(value):
        return "NaN"
    return f"{value:.3g} {unit}".strip()


def render(panels: list[PanelData], out: Path, *, title: str, end: float, columns: int = 3) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(1, math.ceil(len(panels) / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.4 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        _draw(ax, panel, end)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_axis_off()
    fig.suptitle(f"{title} — {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(end))}", fontsize=14)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", required=True, help="base URL, e.g. http://127.0.0.1:9090")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--range", dest="range_s", type=parse_duration, default=parse_duration("15m"))
    parser.add_argument("--rate-interval", default="1m", help="value of $__rate_interval (default 1m)")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD_JSON)
    parser.add_argument("--job", default=".+", help="regex for $job")
    parser.add_argument("--instance", default=".+", help="regex for $instance")
    parser.add_argument("--require-data", action="store_true", help="fail if any target returns no series")
    args = parser.parse_args(argv)

    dashboard = json.loads(args.dashboard.read_text())
    end = time.time()
    panels = fetch(
        Prometheus(args.prometheus), dashboard, end=end, range_s=args.range_s,
        rate_interval=args.rate_interval, job=args.job, instance=args.instance,
    )
    render(panels, args.out, title=dashboard.get("title", "dashboard"), end=end)
    failed = False
    for panel in panels:
        status = f"{len(panel.series)} series"
        if panel.errors:
            status += f", errors: {'; '.join(panel.errors)}"
            failed = True
        if panel.empty_targets:
            status += f", no data for {','.join(panel.empty_targets)}"
            failed = failed or args.require_data
        print(f"{panel.title}: {status}")
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
