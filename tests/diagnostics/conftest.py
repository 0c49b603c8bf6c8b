"""Fixtures for the diagnostics tests: structlog reset around each test, and one cached diagnose run per
(faults, guard, verify, policies) for the whole session (each run builds two engines per policy)."""

import logging

import pytest
import structlog
from structlog.contextvars import clear_contextvars

from runtime.diagnose import run_diagnose


@pytest.fixture(autouse=True)
def _quiet_structlog():
    # Warnings of injected faults are expected here; keep them out of the test output unless a test captures.
    structlog.reset_defaults()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    clear_contextvars()
    yield
    structlog.reset_defaults()
    clear_contextvars()


_REPORTS: dict = {}


@pytest.fixture(scope="session")
def diagnose():
    """`diagnose(*faults, guard=True, verify=0.0, policies=(...))` -> Report, computed once per session."""

    def run(*faults, guard=True, verify=0.0, policies=("memo", "layerwise", "per_forward", "off")):
        key = (tuple(faults), guard, verify, tuple(policies))
        if key not in _REPORTS:
            _REPORTS[key] = run_diagnose(inject=faults, guard=guard, verify=verify, policies=policies)
        return _REPORTS[key]

    return run
