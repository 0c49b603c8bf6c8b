"""What Prometheus actually scrapes: names, label sets from start-up, exact values after a scripted run."""

import itertools
import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from telemetry import names
from telemetry.collector import make_registry, process_registry
from telemetry.stats import FORWARD_SECONDS_BUCKETS, LATENCY_BUCKETS, FrontEndStats


def scrape(registry) -> dict[str, dict[tuple, float]]:
    """Sample name -> {sorted label items: value}, parsed from the text exposition."""
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def types(registry) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(generate_latest(registry).decode())}


def series(label_names: tuple[str, ...], *value_sets) -> set[tuple]:
    return {tuple(sorted(zip(label_names, values))) for values in itertools.product(*value_sets)}


# Every labelled counter of docs/metrics.md with the full cross product of its label values.
LABELLED_COUNTERS = {
    names.LOC_CACHE_HITS: series(("policy", "path"), names.POLICIES, names.PATH_LABELS),
    names.LOC_CACHE_MISSES: series(
        ("policy", "path", "reason"), names.POLICIES, names.PATH_LABELS, names.MISS_REASON_LABELS
    ),
    names.LOC_CACHE_INVALIDATIONS: series(("policy", "site"), names.POLICIES, names.INVALIDATION_SITE_LABELS),
    names.LOC_KEY_CHANGE_EVENTS: series(
        ("policy", "site", "classification"), names.POLICIES, names.TRANSLATE_SITE_LABELS, names.CLASSIFICATION_LABELS
    ),
    names.LOC_TRANSLATIONS: series(("policy",), names.POLICIES),
    names.FORWARD_TOTAL: series(("mode",), names.FORWARD_MODE_LABELS),
    names.REQUESTS_TOTAL: series(("status",), names.REQUEST_STATUS_LABELS),
    names.RETRACTIONS: series(("kind",), names.RETRACTION_KIND_LABELS),
    names.HICACHE_BYTES: series(("direction",), names.HICACHE_DIRECTION_LABELS),
    names.PREFIX_CACHE_EVICTED_TOKENS: series(("pool",), names.KV_POOLS),  # written by the cache only: no other
    names.LOG_EVENTS_SUPPRESSED: series(("event",), names.LOG_EVENT_LABELS),
    names.SPEC_DRAFT_TOKENS: series(("algorithm",), names.SPEC_ALGORITHMS),  # a closed set: no other
    names.SPEC_ACCEPTED_TOKENS: series(("algorithm",), names.SPEC_ALGORITHMS),
}
PLAIN_COUNTERS = (
    names.SWA_EVICTED_TOKENS,
    names.HICACHE_OFFLOADS,
    names.HICACHE_LOADBACKS,
    names.PROMPT_TOKENS,
    names.GENERATION_TOKENS,
    names.PREFIX_CACHE_QUERIES,
    names.PREFIX_CACHE_HITS,
)
# Gauges read at scrape time, by label set (no `other`).
GAUGES = {
    names.KV_TOKENS: series(("pool", "state"), names.KV_POOLS, names.KV_STATES),
    names.PREFIX_CACHE_TOKENS: series(("pool",), names.KV_POOLS),
    names.PREFIX_CACHE_NODES: series(("state",), names.PREFIX_NODE_STATES),
    names.NUM_RUNNING_REQS: {()},
    names.NUM_QUEUE_REQS: {()},
}
LATENCY_HISTOGRAMS = (names.TIME_TO_FIRST_TOKEN, names.INTER_TOKEN_LATENCY, names.E2E_REQUEST_LATENCY)


def test_exposed_label_sets_are_the_contract_sets_plus_other():
    for contract, exposed in [
        (names.PATHS, names.PATH_LABELS),
        (names.MISS_REASONS, names.MISS_REASON_LABELS),
        (names.CLASSIFICATIONS, names.CLASSIFICATION_LABELS),
        (names.INVALIDATION_SITES, names.INVALIDATION_SITE_LABELS),
        (names.TRANSLATE_SITES, names.TRANSLATE_SITE_LABELS),
        (names.FORWARD_MODES, names.FORWARD_MODE_LABELS),
        (names.REQUEST_STATUSES, names.REQUEST_STATUS_LABELS),
        (names.RETRACTION_KINDS, names.RETRACTION_KIND_LABELS),
        (names.HICACHE_DIRECTIONS, names.HICACHE_DIRECTION_LABELS),
        (names.LOG_EVENT_NAMES, names.LOG_EVENT_LABELS),
    ]:
        assert set(exposed) == set(contract) | {names.OTHER}


def test_every_series_exists_at_zero_before_any_event(registry):
    samples = scrape(registry)
    for name, expected in LABELLED_COUNTERS.items():
        assert set(samples[name]) == expected, name
        assert set(samples[name].values()) == {0.0}, name
    for name in PLAIN_COUNTERS:
        assert samples[name] == {(): 0.0}, name
    for name, expected in GAUGES.items():
        assert samples[name] == dict.fromkeys(expected, 0.0), name
    assert samples[names.BUILD_INFO] == {
        (("backend", "torch"), ("dtype", "unknown"), ("model", "tiny-random"), ("policy", "memo"),
         ("quantization", "unknown"), ("version", "0.1.0-test")): 1.0
    }
    forward_les = [str(b) for b in FORWARD_SECONDS_BUCKETS] + ["+Inf"]
    assert set(samples[names.FORWARD_SECONDS + "_bucket"]) == {
        (("le", le), ("mode", mode)) for le in forward_les for mode in names.FORWARD_MODE_LABELS
    }
    assert set(samples[names.FORWARD_SECONDS + "_bucket"].values()) == {0.0}
    for mode in names.FORWARD_MODE_LABELS:
        assert samples[names.FORWARD_SECONDS + "_count"][(("mode", mode),)] == 0.0
        assert samples[names.FORWARD_SECONDS + "_sum"][(("mode", mode),)] == 0.0
    latency_les = {(("le", str(b)),) for b in LATENCY_BUCKETS} | {(("le", "+Inf"),)}
    for name in LATENCY_HISTOGRAMS:
        assert set(samples[name + "_bucket"]) == latency_les
        assert samples[name + "_count"] == {(): 0.0}
        assert samples[name + "_sum"] == {(): 0.0}


def test_metric_types_and_no_foreign_metrics(registry):
    t = types(registry)
    # The parser names a counter family without `_total`; the samples keep it (checked above).
    for name in [*LABELLED_COUNTERS, *PLAIN_COUNTERS]:
        assert t[name.removesuffix("_total")] == "counter", name
    for name in (*GAUGES, names.BUILD_INFO):
        assert t[name] == "gauge", name
    for name in (names.FORWARD_SECONDS, *LATENCY_HISTOGRAMS, names.SPEC_ACCEPTANCE_LENGTH):
        assert t[name] == "histogram", name
    assert len(t) == len(LABELLED_COUNTERS) + len(PLAIN_COUNTERS) + len(GAUGES) + 1 + 2 + len(LATENCY_HISTOGRAMS)
    assert all(n.startswith(names.PREFIX) for n in t)


def test_process_collectors_only_when_asked(stats):
    assert "python_info" not in types(make_registry(stats))
    assert "python_info" in types(make_registry(stats, process_collectors=True))


def test_exact_values_after_a_scripted_run(stats, registry, gauges):
    t = stats.translation
    for path in ("eager_decode", "eager_decode", "eager_decode", "graph_replay", "bogus_path", "bogus_path"):
        t.hit(path)
    t.miss("eager_extend", "cold")
    t.miss("eager_decode", "stale_guard")
    t.miss("eager_decode", "stale_guard")
    t.miss("graph_capture", "made_up_reason")
    t.invalidation("forward_entry")
    t.invalidation("forward_entry")
    t.invalidation("register_mapping")
    t.invalidation("somewhere_new")
    t.key_change("kv_write", "stale_loc")
    t.key_change("attn_metadata", "benign_fresh_tensor")
    t.key_change("new_site", "cross_forward")
    t.translations()
    t.translations(4)
    stats.record_forward("eager_extend", 0.02)
    stats.record_forward("eager_decode", 0.001)
    stats.record_forward("eager_decode", 0.003)
    stats.record_forward("warmup", 0.5)
    stats.record_request("finished")
    stats.record_request("finished")
    stats.record_request("rejected")
    stats.add_prompt_tokens(17)
    stats.add_generation_tokens(5)
    stats.add_evicted_tokens(512)
    stats.add_hicache_offloads()
    stats.add_hicache_loadbacks(2)
    stats.record_retraction("offload")
    stats.record_retraction("recompute")
    stats.record_retraction("recompute")
    stats.record_retraction("swapped_to_disk")
    stats.log_suppressed(names.LOC_KEY_CHANGE_EVENT)
    stats.add_hicache_bytes("offload", 4096)
    stats.add_hicache_bytes("loadback", 1024)
    stats.add_hicache_bytes("to_disk", 8)
    pc = stats.prefix_cache
    pc.record_lookup(40, 32)
    pc.record_lookup(10, 0)
    pc.evicted_tokens["full"] += 24
    pc.evicted_tokens["swa"] += 7
    pc.cached_tokens["full"], pc.cached_tokens["swa"] = 96, 14
    pc.nodes["device"], pc.nodes["tombstoned"], pc.nodes["host"] = 2, 3, 5
    gauges.kv = {("full", "used"): 30, ("swa", "available"): 7, ("mystery", "used"): 99}
    gauges.queue = (3, 8)

    s = scrape(registry)

    def value(name, **labels):
        return s[name][tuple(sorted(labels.items()))]

    hits = names.LOC_CACHE_HITS
    assert value(hits, policy="memo", path="eager_decode") == 3
    assert value(hits, policy="memo", path="graph_replay") == 1
    assert value(hits, policy="memo", path="other") == 2
    assert sum(s[hits].values()) == 6  # nothing else moved, idle policies included
    misses = names.LOC_CACHE_MISSES
    assert value(misses, policy="memo", path="eager_extend", reason="cold") == 1
    assert value(misses, policy="memo", path="eager_decode", reason="stale_guard") == 2
    assert value(misses, policy="memo", path="graph_capture", reason="other") == 1
    assert sum(s[misses].values()) == 4
    inv = names.LOC_CACHE_INVALIDATIONS
    assert value(inv, policy="memo", site="forward_entry") == 2
    assert value(inv, policy="memo", site="register_mapping") == 1
    assert value(inv, policy="memo", site="other") == 1
    assert sum(s[inv].values()) == 4
    ev = names.LOC_KEY_CHANGE_EVENTS
    assert value(ev, policy="memo", site="kv_write", classification="stale_loc") == 1
    assert value(ev, policy="memo", site="attn_metadata", classification="benign_fresh_tensor") == 1
    assert value(ev, policy="memo", site="other", classification="cross_forward") == 1
    assert sum(s[ev].values()) == 3
    assert s[names.LOC_TRANSLATIONS] == {
        (("policy", "memo"),): 5.0,
        (("policy", "layerwise"),): 0.0,
        (("policy", "per_forward"),): 0.0,
        (("policy", "off"),): 0.0,
    }
    # Folding never creates a series: the label sets are exactly those of start-up.
    for name, expected in LABELLED_COUNTERS.items():
        assert set(s[name]) == expected, name

    assert s[names.FORWARD_TOTAL] == {
        (("mode", "eager_extend"),): 1.0,
        (("mode", "eager_decode"),): 2.0,
        (("mode", "graph_capture"),): 0.0,
        (("mode", "graph_replay"),): 0.0,
        (("mode", "target_verify"),): 0.0,
        (("mode", "other"),): 1.0,
    }
    assert value(names.FORWARD_SECONDS + "_count", mode="eager_decode") == 2
    assert value(names.FORWARD_SECONDS + "_sum", mode="eager_decode") == pytest.approx(0.004)
    # 0.001 sits exactly on a bound (le is inclusive); 0.003 lands in the 0.005 bucket.
    les = ("0.0005", "0.001", "0.0025", "0.005", "30.0", "+Inf")
    decode_buckets = {le: value(names.FORWARD_SECONDS + "_bucket", mode="eager_decode", le=le) for le in les}
    assert decode_buckets == {"0.0005": 0, "0.001": 1, "0.0025": 1, "0.005": 2, "30.0": 2, "+Inf": 2}

    assert s[names.REQUESTS_TOTAL] == {
        (("status", "finished"),): 2.0,
        (("status", "aborted"),): 0.0,
        (("status", "rejected"),): 1.0,
        (("status", "refused"),): 0.0,
        (("status", "error"),): 0.0,
        (("status", "other"),): 0.0,
    }
    assert s[names.PROMPT_TOKENS] == {(): 17.0}
    assert s[names.GENERATION_TOKENS] == {(): 5.0}
    assert s[names.SWA_EVICTED_TOKENS] == {(): 512.0}
    assert s[names.HICACHE_OFFLOADS] == {(): 1.0}
    assert s[names.HICACHE_LOADBACKS] == {(): 2.0}
    assert s[names.RETRACTIONS] == {(("kind", "offload"),): 1.0, (("kind", "recompute"),): 2.0,
                                    (("kind", "other"),): 1.0}
    assert s[names.HICACHE_BYTES] == {(("direction", "offload"),): 4096.0, (("direction", "loadback"),): 1024.0,
                                      (("direction", "other"),): 8.0}
    assert s[names.PREFIX_CACHE_QUERIES] == {(): 50.0}
    assert s[names.PREFIX_CACHE_HITS] == {(): 32.0}
    assert s[names.PREFIX_CACHE_EVICTED_TOKENS] == {(("pool", "full"),): 24.0, (("pool", "swa"),): 7.0}
    assert s[names.PREFIX_CACHE_TOKENS] == {(("pool", "full"),): 96.0, (("pool", "swa"),): 14.0}
    assert s[names.PREFIX_CACHE_NODES] == {(("state", "device"),): 2.0, (("state", "tombstoned"),): 3.0,
                                           (("state", "host"),): 5.0}
    assert value(names.LOG_EVENTS_SUPPRESSED, event="loc_key_change") == 1
    assert value(names.LOG_EVENTS_SUPPRESSED, event="other") == 0
    # Unknown pools from the callback are ignored; missing pairs read 0.
    assert s[names.KV_TOKENS] == {
        (("pool", "full"), ("state", "used")): 30.0,
        (("pool", "full"), ("state", "available")): 0.0,
        (("pool", "full"), ("state", "total")): 0.0,
        (("pool", "swa"), ("state", "used")): 0.0,
        (("pool", "swa"), ("state", "available")): 7.0,
        (("pool", "swa"), ("state", "total")): 0.0,
    }
    assert s[names.NUM_RUNNING_REQS] == {(): 3.0}
    assert s[names.NUM_QUEUE_REQS] == {(): 8.0}
    # The prometheus_client helper reads the same numbers from the registry.
    assert registry.get_sample_value(hits, {"policy": "memo", "path": "eager_decode"}) == 3


def test_latency_histogram_is_cumulative(stats, registry):
    observations = [0.001, 0.003, 0.003, 0.25, 7.0, 500.0]
    for v in observations:
        stats.ttft.observe(v)
    s = scrape(registry)
    name = names.TIME_TO_FIRST_TOKEN
    buckets = [(float(dict(k)["le"]), v) for k, v in s[name + "_bucket"].items()]
    buckets.sort()
    assert [b for b, _ in buckets] == [*LATENCY_BUCKETS, math.inf]
    counts = [n for _, n in buckets]
    assert counts == sorted(counts)  # cumulative
    expected = {b: sum(1 for v in observations if v <= b) for b in (*LATENCY_BUCKETS, math.inf)}
    assert dict(buckets) == expected
    assert expected[0.001] == 1 and expected[0.005] == 3 and expected[160.0] == 5 and expected[math.inf] == 6
    assert s[name + "_count"] == {(): 6.0}
    assert s[name + "_sum"][()] == pytest.approx(sum(observations))
    # The other latency histograms did not move.
    assert s[names.INTER_TOKEN_LATENCY + "_count"] == {(): 0.0}
    assert s[names.E2E_REQUEST_LATENCY + "_count"] == {(): 0.0}


def test_speculative_decoding_counts_per_algorithm(stats, registry):
    stats.spec.record_verify("ngram", drafted=4, accepted=3)
    stats.spec.record_verify("ngram", drafted=4, accepted=0)
    stats.spec.record_verify("suffix", drafted=2, accepted=2)
    stats.spec.record_verify("none", drafted=5, accepted=5)  # no series of its own: not counted
    samples = scrape(registry)
    assert samples[names.SPEC_DRAFT_TOKENS] == {(("algorithm", "ngram"),): 8.0, (("algorithm", "suffix"),): 2.0}
    assert samples[names.SPEC_ACCEPTED_TOKENS] == {(("algorithm", "ngram"),): 3.0, (("algorithm", "suffix"),): 2.0}
    h = names.SPEC_ACCEPTANCE_LENGTH
    assert samples[h + "_count"] == {(("algorithm", "ngram"),): 2.0, (("algorithm", "suffix"),): 1.0}
    assert samples[h + "_sum"] == {(("algorithm", "ngram"),): 5.0, (("algorithm", "suffix"),): 3.0}  # 4 + 1, 3
    assert samples[h + "_bucket"][(("algorithm", "ngram"), ("le", "1.0"))] == 1.0
    assert samples[h + "_bucket"][(("algorithm", "ngram"), ("le", "3.0"))] == 1.0
    assert samples[h + "_bucket"][(("algorithm", "ngram"), ("le", "4.0"))] == 2.0


def test_front_end_series_exist_from_start_up_and_count_exactly():
    up = [True]
    front = FrontEndStats(engine_up=lambda: up[0])
    registry = process_registry(front)
    samples = scrape(registry)
    assert samples[names.ENGINE_UP] == {(): 1.0}
    assert samples[names.ENGINE_RESTARTS] == {(): 0.0}
    assert samples[names.HTTP_RESPONSES] == {(("code", c),): 0.0 for c in names.HTTP_CODE_LABELS}
    for code in (200, 200, 413, 503, 299):
        front.record_response(code)
    front.engine_restarts += 1
    up[0] = False
    samples = scrape(registry)
    assert samples[names.ENGINE_UP] == {(): 0.0}  # read at scrape time
    assert samples[names.ENGINE_RESTARTS] == {(): 1.0}
    responses = samples[names.HTTP_RESPONSES]
    assert (responses[(("code", "200"),)], responses[(("code", "413"),)], responses[(("code", "503"),)]) == (2, 1, 1)
    assert responses[(("code", "other"),)] == 1  # 299 folds into other
    assert sum(responses.values()) == 5
    t = types(registry)
    assert (t[names.ENGINE_UP], t[names.ENGINE_RESTARTS.removesuffix("_total")],
            t[names.HTTP_RESPONSES.removesuffix("_total")]) == ("gauge", "counter", "counter")
