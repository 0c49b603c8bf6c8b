"""Telemetry for swa-runtime: metric names, lookup classification, plain-int counters, the scrape-time
collector and structured logging. A leaf package: stdlib, prometheus_client and structlog only."""
