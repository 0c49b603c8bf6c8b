#!/usr/bin/env bash
# Static checks of the observability stack (run by .ci/run; needs promtool from the `prometheus` package).
set -euo pipefail
cd "$(dirname "$0")/.."

promtool check config --lint=all dashboards/prometheus/prometheus.yml dashboards/prometheus/prometheus-local.yml
promtool check rules --lint=all --lint-fatal dashboards/prometheus/rules/*.yml
promtool test rules dashboards/prometheus/tests/*.yml
python -m dashboards.generate --check
