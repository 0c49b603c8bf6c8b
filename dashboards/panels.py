"""Small builders for Grafana dashboard JSON (classic model): targets, panels, rows, grid layout.

Only what the swa-runtime dashboard uses. Every panel gets a unit and a description; the layout packs
panels left to right in a 24-column grid and starts a new line at each row header.
"""

from __future__ import annotations

from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
PANEL_HEIGHT = 8

Json = dict[str, Any]


def target(expr: str, legend: str = "__auto", *, instant: bool = False, table: bool = False) -> Json:
    """One Prometheus query of a panel (refIds are filled in by the panel)."""
    return {
        "datasource": DATASOURCE,
        "expr": expr,
        "legendFormat": legend,
        "range": not instant,
        "instant": instant,
        "format": "table" if table else "time_series",
    }


def _with_ref_ids(targets: list[Json]) -> list[Json]:
    return [{**t, "refId": chr(ord("A") + i)} for i, t in enumerate(targets)]


def _field_defaults(unit: str, *, min_: float | None, max_: float | None, thresholds: list[Json]) -> Json:
    defaults: Json = {
        "unit": unit,
        "color": {"mode": "palette-classic"},
        "thresholds": {"mode": "absolute", "steps": thresholds or [{"color": "green", "value": None}]},
    }
    if min_ is not None:
        defaults["min"] = min_
    if max_ is not None:
        defaults["max"] = max_
    return defaults


def timeseries(
    title: str,
    description: str,
    unit: str,
    targets: list[Json],
    *,
    width: int = 8,
    stack: bool = False,
    min_: float | None = None,
    max_: float | None = None,
    thresholds: list[Json] | None = None,
) -> Json:
    """A time-series panel; with `thresholds` the steps are drawn as dashed lines (alert levels)."""
    custom: Json = {
        "drawStyle": "line",
        "lineWidth": 1,
        "fillOpacity": 15 if stack else 0,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"mode": "normal" if stack else "none", "group": "A"},
        "thresholdsStyle": {"mode": "dashed" if thresholds else "off"},
    }
    defaults = _field_defaults(unit, min_=min_, max_=max_, thresholds=thresholds or [])
    defaults["custom"] = custom
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": _with_ref_ids(targets),
        "_width": width,
    }


def stat(
    title: str,
    description: str,
    unit: str,
    targets: list[Json],
    *,
    width: int = 8,
    thresholds: list[Json] | None = None,
    min_: float | None = None,
    max_: float | None = None,
) -> Json:
    """A single-value panel showing the last value of each series, coloured by `thresholds`."""
    defaults = _field_defaults(unit, min_=min_, max_=max_, thresholds=thresholds or [])
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "area",
            "textMode": "value_and_name",
            "orientation": "auto",
        },
        "targets": _with_ref_ids(targets),
        "_width": width,
    }


def table(title: str, description: str, unit: str, targets: list[Json], *, width: int = 8, hide: tuple[str, ...] = ()) -> Json:
    """A table of instant-query results; `hide` drops columns (Time, job, ...) from view."""
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"align": "auto"}}, "overrides": []},
        "options": {"showHeader": True, "sortBy": [{"displayName": "Value", "desc": True}]},
        "transformations": [
            {"id": "organize", "options": {"excludeByName": {name: True for name in hide}}},
        ],
        "targets": _with_ref_ids(targets),
        "_width": width,
    }


def row(title: str) -> Json:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def layout(items: list[Json]) -> list[Json]:
    """Assign ids and gridPos: rows take a full line, panels fill lines of 24 columns."""
    panels: list[Json] = []
    x = y = 0
    line_height = 0
    for panel_id, item in enumerate(items, start=1):
        panel = {k: v for k, v in item.items() if k != "_width"}
        if panel["type"] == "row":
            if x:
                y, x = y + line_height, 0
            panel["gridPos"] = {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}
            y += 1
            line_height = 0
        else:
            width = item.get("_width", 8)
            if x + width > GRID_WIDTH:
                y, x = y + line_height, 0
            panel["gridPos"] = {"h": PANEL_HEIGHT, "w": width, "x": x, "y": y}
            x += width
            line_height = PANEL_HEIGHT
        panel["id"] = panel_id
        panels.append(panel)
    return panels
