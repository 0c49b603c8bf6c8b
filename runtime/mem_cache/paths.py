"""Memory paths: every way the engine allocates, moves, caches, pads or frees KV slots, by name.

Each component below counts the paths it takes in a plain dict of ints (`path_counts`, keys fixed at start-up:
an undeclared name raises KeyError where it is counted). `swa-runtime diagnose` fails unless its workload took
every path declared here, so a new path must be declared and cannot go unexercised. docs/diagnose.md lists
them with what takes each.
"""

from __future__ import annotations

PAGED_ALLOCATOR_PATHS = (
    "alloc_partial_page",  # continue a request's partly filled last page (page size > 1)
)
HYBRID_ALLOCATOR_PATHS = (
    "alloc_window",  # full slots for every position, SWA slots for the window only (host-tier restore)
    "free_swa_page_kept",  # a SWA page kept because another of its tokens is still in a window (page size > 1)
    "set_mapping",  # the mapping edited in place (a slot move)
    "register_mapping",  # a rebuilt mapping adopted (host-tier load-back)
)
PREFIX_CACHE_PATHS = (
    "prefix_hit",  # a request starts from a cached prefix it holds locked
    "prefix_split",  # a device node split where a match or an insert ends inside it
    "prefix_split_host",  # a host-tier node split (its host copy split in two)
    "insert_new_node",  # a finished request's tokens become new nodes
    "insert_shared",  # tokens the tree holds already: the request's copies are freed
    "insert_replace_tombstoned",  # the tree's copy had lost its SWA side in the window: the request's replaces it
    "insert_replace_host",  # the tree's copy is on the host tier: the request's device copy replaces it
    "evict_to_host",  # an unlocked leaf copied to the host tier, its device slots freed
    "evict_drop",  # an unlocked leaf dropped (nothing would need it from the host tier, or no room there)
    "host_drop",  # host-tier nodes dropped to make room for a newer one
    "swa_pressure_tombstone",  # SWA pressure frees an inner node's SWA side
    "swa_pressure_evict",  # SWA pressure evicts a leaf entirely
    "swa_pressure_locked",  # SWA pressure meets nodes that running requests hold locked (skipped)
    "restore_from_host",  # a match walks into host-tier nodes and loads them back
)
SCHEDULER_PATHS = (
    "prefill_chunked",  # a prompt prefilled over several forwards
    "window_release",  # SWA slots of tokens that left every window given back while the request runs
    "retract_offload",  # a running request's KV moved to the host tier under pressure
    "retract_recompute",  # a running request's KV dropped (no host tier or no room): recomputed later
    "loadback",  # a retracted request's KV loaded back into new slots
    "finish_cache_prefix",  # a finished request's KV handed to the prefix cache
    "finish_free",  # a finished request's KV freed (prefix cache off)
    "spec_verify",  # a decode step that verifies draft tokens (speculative decoding)
    "spec_rollback",  # the slots of rejected draft tokens freed
    "spec_rollback_page_kept",  # rejected draft tokens on a page the kept tokens still use: unmapped, page held
)
GRAPH_PATHS = (
    "graph_replay_exact",  # a decode batch replayed in a graph of its own size
    "graph_replay_padded",  # a decode batch replayed in a larger graph: the rest padded to the sink
    "decode_twice_graph_max",  # an eager decode batch of at least twice the largest graph size
)
VERIFY_PATHS = (
    "verify_replay_exact",  # a verify batch filling its (batch size, K) buffers: bs requests, K drafts each
    "verify_replay_padded",  # fewer requests or shorter drafts: the tail padded to the sink
)
MEMORY_PATHS = (*PAGED_ALLOCATOR_PATHS, *HYBRID_ALLOCATOR_PATHS, *PREFIX_CACHE_PATHS, *SCHEDULER_PATHS,
                *GRAPH_PATHS, *VERIFY_PATHS)
