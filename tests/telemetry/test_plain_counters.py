"""Plain-int counters and histograms: folding, fixed key sets, bucket boundaries."""

import math

import pytest

from telemetry import names
from telemetry.stats import EngineStats, PlainHistogram, TranslationStats


def test_unknown_labels_fold_to_other_without_adding_keys():
    t = TranslationStats("layerwise")
    sizes = [len(d) for d in (t.hit_counts, t.miss_counts, t.invalidation_counts, t.key_change_counts)]
    t.hit("nope")
    t.miss("eager_decode", "nope")
    t.miss("nope", "cold")
    t.invalidation("nope")
    t.key_change("kv_write", "nope")
    assert [len(d) for d in (t.hit_counts, t.miss_counts, t.invalidation_counts, t.key_change_counts)] == sizes
    assert t.hit_counts["other"] == 1
    assert t.miss_counts["eager_decode", "other"] == 1
    assert t.miss_counts["other", "cold"] == 1
    assert t.invalidation_counts["other"] == 1
    assert t.key_change_counts["kv_write", "other"] == 1
    assert sum(t.miss_counts.values()) == 2


def test_unknown_policy_is_an_error():
    with pytest.raises(ValueError):
        TranslationStats("lru")


def test_engine_stats_folds_modes_statuses_and_events():
    s = EngineStats("off", version="x")
    s.record_forward("prefill", 0.1)
    s.record_request("timeout")
    s.log_suppressed("something_else")
    assert s.forward_counts == dict.fromkeys(names.FORWARD_MODES, 0) | {"other": 1}
    assert s.forward_seconds["other"].snapshot().count == 1
    assert s.request_counts["other"] == 1
    assert s.suppressed_counts == {"loc_key_change": 0, "engine_step_failed": 0, "other": 1}
    assert s.build_info.policy == "off" and s.translation.policy == "off"
    assert s.gauges.kv_tokens() == {} and s.gauges.queue_sizes() == (0, 0)


def test_histogram_buckets_are_le_and_cumulative():
    h = PlainHistogram([0.1, 1.0, 10.0])
    for v in (-1.0, 0.1, 0.10001, 1.0, 10.0, 11.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap.buckets == ((0.1, 2), (1.0, 4), (10.0, 5), (math.inf, 6))
    assert snap.count == 6
    assert snap.sum == pytest.approx(-1.0 + 0.1 + 0.10001 + 1.0 + 10.0 + 11.0)


def test_histogram_drops_an_explicit_inf_and_rejects_bad_buckets():
    assert PlainHistogram([1.0, math.inf]).bounds == (1.0,)
    for bad in ([], [1.0, 1.0], [2.0, 1.0]):
        with pytest.raises(ValueError):
            PlainHistogram(bad)


def test_every_label_set_has_other_and_the_contract_values():
    t = TranslationStats("memo")
    assert set(t.hit_counts) == set(names.PATHS) | {"other"}
    assert set(t.invalidation_counts) == set(names.INVALIDATION_SITES)
