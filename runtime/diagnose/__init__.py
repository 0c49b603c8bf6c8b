"""`swa-runtime diagnose`: drive a deterministic workload through every forward mode, translation policy and
memory path, hold every output against a reference computed without the build's memory code, and say which
translation-cache events happened, where each stale entry came from, and what to fix.

Per policy the workload runs in one engine per setup (`workload.SETUPS`: page size 1 and 4, prefix cache on
and off, host tier on and off, speculative decoding in four, a wide setup for graph padding and large eager
batches), in these phases:

- `scheduler`: the engine's own loop. Prompts longer than the window, chunked prefill (eager extend), graph
  capture (at start-up), decode by graph replay and eagerly, speculative verify forwards (replayed and eager)
  and rollbacks, window eviction, and pools small enough that decode must retract requests (to the host tier
  and back, or recomputed without one).
- `prefix_cache`: multi-turn chats whose later turns hit cached prefixes; older ones are evicted, tombstoned,
  sent to the host tier and loaded back, while running requests hold their prefixes locked.
- `reserved_decode`: decode slots reserved several steps ahead (multi-step scheduling), so consecutive
  forwards run with no allocator mutation between them. In the scheduler phase every forward is preceded by
  an allocation whose invalidation hook also clears the cache, which hides a missing forward-entry
  invalidation; here only the forward entry stands between one forward's entry and the next.
- `draft_steps`: several model steps inside one forward (one forward id, one invalidation), each writing
  through an equal-length view of one reserved location buffer, as a speculative draft runner does.
- `midforward_remap`: a layer-wise host-cache load-back whose mapping update lands after the first sliding
  layer: the batch's in-window tokens move to new SWA slots, once through an in-place allocator edit
  (`set_full_to_swa_mapping`) and once by registering a rebuilt mapping (`register_mapping`). The engine's
  own load-back happens between forwards (and allocates first), where forward-entry and allocation
  invalidations would hide a missing mapping invalidation.
- `reserved_verify`: verify forwards back to back over slots reserved ahead (only the forward entry
  invalidates between them): a verify graph filled exactly, padded twice over the same buffers, and eager.
- `wide_decode`: decode batches padded into a larger graph, and eager batches of twice the largest graph size.

Ground truth is the dense reference (`reference.py`): every request recomputed over its whole token history
in one forward with plain attention, no pool, cache or graph involved, so a bug that corrupts every policy
alike (the uncached `off` run included) still shows. An output it contradicts in a phase where no bug-class
event was counted is an "undetected corruption" row: the detectors' own miss. The model runner counts every
branch a forward can take (`BRANCHES`) and the memory code every path it takes (runtime/mem_cache/paths.py);
the report fails unless each policy's runs took every one. The exit status is 1 when any non-benign event,
output mismatch or failed check occurred.
"""

from __future__ import annotations

import torch

from runtime.config import POLICIES
from runtime.diagnose.coverage import missing_paths
from runtime.diagnose.reference import DenseReference, reference_mismatches
from runtime.diagnose.report import PolicyReport, Report, Row, render
from runtime.diagnose.workload import BENIGN, PHASES, SETUPS, Mismatch, RunResult, Setup, Workload, run_workload
from runtime.executor.model_runner import BRANCHES
from runtime.mem_cache import paths
from runtime.mem_cache.translation import ONE_OFF_SITE
from runtime.models.loader import load_model
from runtime.models.tokenizer import load_tokenizer

__all__ = ["PHASES", "REQUIRED_COVERAGE", "SETUPS", "Report", "render", "run_diagnose"]


REQUIRED_COVERAGE = (*BRANCHES, "hicache_offloads", "hicache_loadbacks", "swa_evicted_tokens", "midforward_remaps",
                     "prefix_cache_hits", "prefix_cache_evictions", "prefix_cache_tombstones",
                     "prefix_cache_loadbacks")
REFERENCE = "the dense reference"


def _checks(runs: list[RunResult], mismatches: list[Mismatch]) -> list[str]:
    """One policy's failed checks over its runs (one per setup)."""
    coverage: dict[str, int] = {}
    for run in runs:  # every runner branch the runner declares (they are all in the coverage) and workload feature
        for name, n in run.coverage.items():
            coverage[name] = coverage.get(name, 0) + n
    needed = dict.fromkeys([*coverage, *REQUIRED_COVERAGE])
    failures = [f"the workload did not exercise {name}" for name in needed if not coverage.get(name)]
    failures += [f"the workload did not take memory path {name}" for name in missing_paths(runs, paths.MEMORY_PATHS)]
    events: dict[tuple[str, str], int] = {}
    for run in runs:
        for key, n in run.key_change_counts.items():
            events[key] = events.get(key, 0) + n
    for (site, classification), n in sorted(events.items()):
        if classification != BENIGN:
            failures.append(f"{n} {classification} event(s) at {site}")
    if any(ONE_OFF_SITE in (e.site, e.prev_site) for run in runs for e in run.first_events.values()):
        failures.append(f"the one-off `{ONE_OFF_SITE}` translation went through the cache "
                        "(docs/translation-rules.md rule 1)")
    for m in mismatches:
        if m.undetected:
            failures.append("undetected corruption (no bug-class event): "
                            f"outputs differ from {REFERENCE}: {m.describe()}")
        else:
            failures.append(f"outputs differ from {REFERENCE}: {m.describe()}")
    return failures


def _rows(policy: str, runs: list[RunResult]) -> list[Row]:
    """One row per (site, classification) over the policy's runs: counts summed, the first occurrence from
    the first setup that had one."""
    rows: dict[tuple[str, str], Row] = {}
    for run in runs:
        for key, n in run.key_change_counts.items():
            if key in rows:
                rows[key].count += n
                continue
            first = run.first_events.get(key)
            rows[key] = Row(policy, *key, n, first, run.phase_of(first.forward_id) if first else None,
                            setup=run.setup)
    return [rows[k] for k in sorted(rows, key=lambda k: (k[1] == BENIGN, k))]


# ---- entry point ----------------------------------------------------------------------------------------------
def run_diagnose(model: str = "tiny", policies=POLICIES, inject=(), guard: bool = True, verify: float = 0.0,
                 seed: int = 0, attention_backend: str = "torch", threads: int | None = 1,
                 setups: tuple[Setup, ...] = SETUPS) -> Report:
    """Run the workload under each policy and setup with the faults `inject`, hold every run against the
    dense reference and collect the events. `threads=1` (default) keeps small models fast and runs
    bit-reproducible."""
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        _, net = load_model(model, progress=False)
        tokenizer = load_tokenizer(model)
        if not net.config.sliding_layer_ids:
            raise ValueError(f"model {model!r} has no sliding-window layers: nothing to diagnose")
        work = Workload(window=net.config.sliding_window, vocab=net.config.vocab_size, seed=seed)
        dense = DenseReference(net)
        faulty = dict(inject=tuple(inject), loc_cache_guard=guard, loc_cache_verify=verify)
        reports, rows = [], []
        for policy in policies:
            runs = []
            for setup in setups:
                cfg = work.engine_config(model, policy, setup, attention_backend=attention_backend, **faulty)
                runs.append(run_workload(cfg, work, net, tokenizer, setup))
            mismatches = [m for run in runs for m in reference_mismatches(dense, run)]
            reports.append(PolicyReport(policy, runs, REFERENCE, mismatches, _checks(runs, mismatches)))
            rows += _rows(policy, runs)
        return Report(model, tuple(inject), guard, verify, reports, rows)
    finally:
        torch.set_num_threads(previous_threads)
