"""Observability stack of swa-runtime: Grafana dashboard generator, snapshot renderer, Prometheus rules.

Nothing in `runtime/` or `telemetry/` imports this package; it reads the metric-name contract from
`telemetry.names`.
"""
