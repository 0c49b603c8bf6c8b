"""dashboards.snapshot against a real Prometheus (loopback) scraping a fake runtime exporter, plus the
alert rules evaluated live by that Prometheus."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest

from dashboards import generate, snapshot

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((REPO / "dashboards" / "grafana" / "dashboards" / "swa-runtime.json").read_text())


def test_substitute_grafana_variables():
    expr = 'rate(x{job=~"$job", instance=~"${instance}"}[$__rate_interval]) + increase(y[$__range])'
    out = snapshot.substitute(expr, {"job": ".+", "instance": "a|b", "__rate_interval": "1m", "__range": "900s"})
    assert out == 'rate(x{job=~".+", instance=~"a|b"}[1m]) + increase(y[900s])'
    with pytest.raises(KeyError):
        snapshot.substitute("rate(x[$__interval])", {})


def test_legend_and_duration():
    assert snapshot.legend("p95 {{mode}}", {"mode": "graph_replay"}) == "p95 graph_replay"
    assert snapshot.legend("__auto", {"__name__": "m", "job": "j", "pool": "swa"}) == "pool=swa"
    assert snapshot.parse_duration("15m") == 900
    assert snapshot.parse_duration("2h") == 7200


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.promtool
def test_snapshot_renders_every_panel_with_data(live_prometheus, tmp_path, capsys):
    out = tmp_path / "dashboard.png"
    rc = snapshot.main(
        ["--prometheus", live_prometheus, "--out", str(out), "--range", "1m", "--rate-interval", "30s", "--require-data"]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    n_panels = sum(1 for p in generate.iter_panels(DASHBOARD) if p["type"] != "row")
    assert printed.count(" series") == n_panels
    assert "no data" not in printed and "errors" not in printed
    width, height = png_size(out)
    assert width >= 1000 and height >= 1000


@pytest.mark.promtool
def test_snapshot_values_match_the_exporter(live_prometheus):
    """The numbers behind the panels are right, not just present: 14 hits per miss -> 93.3%."""
    panels = snapshot.fetch(
        snapshot.Prometheus(live_prometheus), DASHBOARD, end=time.time(), range_s=60, rate_interval="30s"
    )
    by_title = {p.title: p for p in panels}
    ratio = [s for s in by_title["Hit ratio"].series if s.labels.get("policy") == "memo"]
    assert len(ratio) == 1
    last = [v for v in ratio[0].values if not math.isnan(v)][-1]
    assert last == pytest.approx(14 / 15, rel=1e-6)
    kv = {s.labels["pool"]: s.values[-1] for s in by_title["KV usage: full vs SWA"].series}
    assert kv["swa"] == pytest.approx(1024 / 4096)
    table = by_title["Top key-change sites over the range"]
    assert table.kind == "table" and len(table.series) == 10
    assert {"site", "classification"} <= set(table.series[0].labels)
    assert not any(p.errors for p in panels)


@pytest.mark.promtool
def test_snapshot_fails_loudly_on_a_broken_query(live_prometheus, tmp_path):
    broken = json.loads(json.dumps(DASHBOARD))
    first = next(p for p in broken["panels"] if p["type"] == "timeseries")
    first["targets"][0]["expr"] = "sum(rate(swa_runtime_loc_cache_hits_total[$__rate_interval]"  # unbalanced
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(broken))
    rc = snapshot.main(["--prometheus", live_prometheus, "--out", str(tmp_path / "x.png"), "--dashboard", str(path)])
    assert rc == 1


@pytest.mark.promtool
def test_alerts_evaluated_live(live_prometheus, query):
    """A stale_loc series born at 1 fires SWARuntimeStaleLoc in a real Prometheus; the zero-valued
    cross_forward and capture_pollution series leave SWARuntimeMissingInvalidation quiet."""
    deadline = time.monotonic() + 20
    firing = []
    while time.monotonic() < deadline and not firing:
        firing = query(live_prometheus, 'ALERTS{alertname="SWARuntimeStaleLoc", alertstate="firing"}')
        time.sleep(0.5)
    assert len(firing) == 1
    assert firing[0]["metric"]["site"] == "kv_write" and firing[0]["metric"]["severity"] == "critical"
    assert query(live_prometheus, 'ALERTS{alertname="SWARuntimeMissingInvalidation"}') == []
    assert query(live_prometheus, 'ALERTS{alertname="SWARuntimeLocKeyCollision"}') == []
