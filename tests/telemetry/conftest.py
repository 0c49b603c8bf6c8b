"""Fixtures for telemetry tests: fresh stats and registry per test, structlog and contextvars reset."""

import logging

import pytest
import structlog
from structlog.contextvars import clear_contextvars

from telemetry.collector import make_registry
from telemetry.logging import CONTEXT_PROCESSORS, clear_forward
from telemetry.stats import EngineStats


@pytest.fixture(autouse=True)
def _reset_structlog():
    structlog.reset_defaults()
    clear_contextvars()
    clear_forward()
    yield
    structlog.reset_defaults()
    clear_contextvars()
    clear_forward()


class FixedGauges:
    """A gauge source whose readings a test sets, as an engine's pools and queues would change."""

    def __init__(self):
        self.kv: dict[tuple[str, str], int] = {}
        self.queue = (0, 0)

    def kv_tokens(self):
        return self.kv

    def queue_sizes(self):
        return self.queue


@pytest.fixture
def gauges():
    return FixedGauges()


@pytest.fixture
def stats(gauges):
    return EngineStats("memo", model="tiny-random", backend="torch", version="0.1.0-test", gauges=gauges)


@pytest.fixture
def registry(stats):
    return make_registry(stats)


class CaptureProcessor:
    """Records each event dict as the renderer would see it (after the context processors), then drops it."""

    def __init__(self):
        self.records: list[dict] = []

    def __call__(self, logger, method_name, event_dict):
        self.records.append(dict(event_dict))
        raise structlog.DropEvent


@pytest.fixture
def capture_logs_at():
    """Return `configure(level) -> CaptureProcessor`: structlog set to capture records at that level."""

    def configure(level: int = logging.DEBUG) -> CaptureProcessor:
        capture = CaptureProcessor()
        structlog.configure(
            processors=[*CONTEXT_PROCESSORS, structlog.processors.add_log_level, capture],
            wrapper_class=structlog.make_filtering_bound_logger(level),
            cache_logger_on_first_use=False,
        )
        return capture

    return configure
