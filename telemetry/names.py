"""Metric names and closed label sets: the contract that dashboards, alerts and tests read (docs/metrics.md).

Everything here is plain data so that `dashboards/` and tests can import it without pulling torch.
"""

PREFIX = "swa_runtime_"

# Translation cache
LOC_CACHE_HITS = PREFIX + "loc_cache_hits_total"
LOC_CACHE_MISSES = PREFIX + "loc_cache_misses_total"
LOC_CACHE_INVALIDATIONS = PREFIX + "loc_cache_invalidations_total"
LOC_KEY_CHANGE_EVENTS = PREFIX + "loc_key_change_events_total"
LOC_TRANSLATIONS = PREFIX + "loc_translations_total"

# Forwards
FORWARD_TOTAL = PREFIX + "forward_total"
FORWARD_SECONDS = PREFIX + "forward_seconds"

# KV pools
KV_TOKENS = PREFIX + "kv_tokens"
SWA_EVICTED_TOKENS = PREFIX + "swa_evicted_tokens_total"
HICACHE_OFFLOADS = PREFIX + "hicache_offloads_total"
HICACHE_LOADBACKS = PREFIX + "hicache_loadbacks_total"
RETRACTIONS = PREFIX + "retractions_total"
HICACHE_BYTES = PREFIX + "hicache_bytes_total"

# Prefix cache (radix tree of cached prompt prefixes over the pools and the host tier)
PREFIX_CACHE_QUERIES = PREFIX + "prefix_cache_queries_total"
PREFIX_CACHE_HITS = PREFIX + "prefix_cache_hits_total"
PREFIX_CACHE_TOKENS = PREFIX + "prefix_cache_tokens"
PREFIX_CACHE_NODES = PREFIX + "prefix_cache_nodes"
PREFIX_CACHE_EVICTED_TOKENS = PREFIX + "prefix_cache_evicted_tokens_total"

# Requests
REQUESTS_TOTAL = PREFIX + "requests_total"
PROMPT_TOKENS = PREFIX + "prompt_tokens_total"
GENERATION_TOKENS = PREFIX + "generation_tokens_total"
TIME_TO_FIRST_TOKEN = PREFIX + "time_to_first_token_seconds"
INTER_TOKEN_LATENCY = PREFIX + "inter_token_latency_seconds"
E2E_REQUEST_LATENCY = PREFIX + "e2e_request_latency_seconds"
NUM_RUNNING_REQS = PREFIX + "num_running_reqs"
NUM_QUEUE_REQS = PREFIX + "num_queue_reqs"

# Speculative decoding (draft-free: n-gram prompt lookup, suffix table)
SPEC_DRAFT_TOKENS = PREFIX + "spec_draft_tokens_total"
SPEC_ACCEPTED_TOKENS = PREFIX + "spec_accepted_tokens_total"
SPEC_ACCEPTANCE_LENGTH = PREFIX + "spec_acceptance_length"

# The front end (the serving process): the engine process's state and every HTTP answer. Kept in the front
# end, so these exist while the engine is down or restarting.
ENGINE_UP = PREFIX + "engine_up"
ENGINE_RESTARTS = PREFIX + "engine_restarts_total"
HTTP_RESPONSES = PREFIX + "http_responses_total"

# Logging and build
LOG_EVENTS_SUPPRESSED = PREFIX + "log_events_suppressed_total"
BUILD_INFO = PREFIX + "build_info"

# Closed label value sets. Unknown values fold into OTHER.
OTHER = "other"
POLICIES = ("memo", "layerwise", "per_forward", "off")
PATHS = ("eager_extend", "eager_decode", "graph_capture", "graph_replay", "target_verify", "none")
MISS_REASONS = ("cold", "invalidated", "key_changed", "stale_guard", "capture")
CLASSIFICATIONS = (
    "benign_fresh_tensor",
    "view_offset",
    "cross_forward",
    "stale_loc",
    "capture_pollution",
    "foreign_slot_write",
    "foreign_slot_read",
    "freed_slot_read",
)
# Classifications that mean a bug (alerts fire on these; benign ones are only counted).
NON_BENIGN_CLASSIFICATIONS = ("view_offset", "cross_forward", "stale_loc", "capture_pollution",
                              "foreign_slot_write", "foreign_slot_read", "freed_slot_read")
# The KV sanitizer's classifications (an ownership ledger of every slot, docs/kv-sanitizer.md): a KV write into
# a slot its token does not own, an attention read of a slot owned by another request or position, a read of a
# freed or tombstoned slot.
SANITIZER_CLASSIFICATIONS = ("foreign_slot_write", "foreign_slot_read", "freed_slot_read")
# Where a cache gets invalidated: allocator/mapping mutations and engine lifecycle points.
INVALIDATION_SITES = (
    "alloc",
    "free",
    "free_swa",
    "clear",
    "set_mapping",
    "clear_swa_mapping",
    "register_mapping",
    "prefix_evict",
    "prefix_tombstone",
    "prefix_loadback",
    "spec_rollback",
    "forward_entry",
    "graph_capture",
    "manual",
    OTHER,
)
# Where an event is found: where a translation is asked for (kv_write, attn_metadata, window_indices), where
# attention reads keys (kv_read, the sanitizer's read check), and the load-backs whose audit of the mapping
# before adopting a rebuilt one finds an unhooked write (register_mapping, prefix_loadback).
TRANSLATE_SITES = ("kv_write", "attn_metadata", "window_indices", "kv_read", "register_mapping", "prefix_loadback",
                   OTHER)
FORWARD_MODES = ("eager_extend", "eager_decode", "graph_capture", "graph_replay", "target_verify")
KV_POOLS = ("full", "swa")
KV_STATES = ("used", "available", "total")
# finished; aborted (by the client, or cut by shutdown); rejected (invalid, at admission); refused (overload:
# the waiting queue was full, never admitted); error (the engine failed the request).
REQUEST_STATUSES = ("finished", "aborted", "rejected", "refused", "error")
# How a running request was taken off the device under pool pressure: its KV offloaded to the host tier, or
# dropped to be recomputed.
RETRACTION_KINDS = ("offload", "recompute")
# Host-tier traffic: device -> host (offload) and host -> device (loadback), by retraction or the prefix cache.
HICACHE_DIRECTIONS = ("offload", "loadback")
# Prefix-cache nodes: full and SWA KV on the device (`device`), full KV only (`tombstoned`: the SWA side was
# freed), or copied to the host tier (`host`). A gauge read from the tree: no `other`.
PREFIX_NODE_STATES = ("device", "tombstoned", "host")
# HTTP status codes the front end answers (`code` of HTTP_RESPONSES); others fold into `other`.
HTTP_CODES = ("200", "400", "401", "403", "404", "405", "408", "410", "413", "415", "422", "429", "500", "503",
              "504")
LOG_EVENT_NAMES = ("loc_key_change", "engine_step_failed", OTHER)
# How drafts are proposed (`--speculative-algorithm`, `none` exports nothing but the zero series).
SPEC_ALGORITHMS = ("ngram", "suffix")


def fold(value: str, allowed: tuple[str, ...]) -> str:
    """Return `value` if it is in the closed set `allowed`, else `other` (keeps label cardinality bounded)."""
    return value if value in allowed else OTHER


def with_other(values: tuple[str, ...]) -> tuple[str, ...]:
    """`values` plus `other` when missing: the label values a metric exposes from start-up.

    Every value `fold` can produce must already exist at 0, or a folded unknown value would be born at 1 and be
    invisible to `increase()`; so sets that lack `other` get it appended in the exposition.
    """
    return values if OTHER in values else (*values, OTHER)


# Exposed label value sets (contract set + `other`), in the order the collector emits them.
PATH_LABELS = with_other(PATHS)
MISS_REASON_LABELS = with_other(MISS_REASONS)
CLASSIFICATION_LABELS = with_other(CLASSIFICATIONS)
INVALIDATION_SITE_LABELS = with_other(INVALIDATION_SITES)
TRANSLATE_SITE_LABELS = with_other(TRANSLATE_SITES)
FORWARD_MODE_LABELS = with_other(FORWARD_MODES)
REQUEST_STATUS_LABELS = with_other(REQUEST_STATUSES)
RETRACTION_KIND_LABELS = with_other(RETRACTION_KINDS)
HICACHE_DIRECTION_LABELS = with_other(HICACHE_DIRECTIONS)
LOG_EVENT_LABELS = with_other(LOG_EVENT_NAMES)
HTTP_CODE_LABELS = with_other(HTTP_CODES)
# kv_tokens is a gauge read from the pools at scrape time: exactly KV_POOLS x KV_STATES, no `other`; so are
# the prefix cache's per-pool series (tokens held, tokens evicted: only the cache itself writes them) and its
# node states.

# Structured log event names (the `event` label of LOG_EVENTS_SUPPRESSED).
LOC_KEY_CHANGE_EVENT = "loc_key_change"
# At shutdown, one record per (site, classification) with the repeats the rate limiter held back since its
# last record, so that counts read back from a log (`diagnose --from-log`) equal the engine's.
LOC_KEY_CHANGE_SUPPRESSED_EVENT = "loc_key_change_suppressed"
ENGINE_STEP_FAILED_EVENT = "engine_step_failed"
