"""`swa-runtime diagnose`: drive a deterministic workload through every forward mode and translation policy,
then say which translation-cache events happened, where each stale entry came from, and what to fix.

Per policy the workload runs in one engine, in four phases:

- `scheduler`: the engine's own loop. Prompts longer than the window, chunked prefill (eager extend), graph
  capture (at start-up), decode by graph replay (batches of 1-2) and eagerly (3-4), window eviction, and pools
  small enough that decode must retract requests to the host tier and load them back (checked in the stats).
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

Every run's tokens and sampled logits are compared with the ground truth: the uncached `off` policy of the
same build, whatever the run's guard, verify or fault settings. The model runner counts every branch a
forward can take (`BRANCHES`), and the report fails unless the workload ran each one. The report lists
policy x site x classification with the first occurrence's origin and a suggested fix; the exit status is 1 when any
non-benign event, output mismatch or failed check occurred.
"""

from __future__ import annotations

import torch

from runtime.config import POLICIES
from runtime.diagnose.report import BENIGN, PolicyReport, Report, Row, render
from runtime.diagnose.workload import PHASES, Mismatch, RunResult, Workload, compare, run_workload
from runtime.executor.model_runner import BRANCHES
from runtime.mem_cache.translation import ONE_OFF_SITE
from runtime.models.loader import load_model
from runtime.models.tokenizer import load_tokenizer

__all__ = ["PHASES", "REQUIRED_COVERAGE", "Report", "render", "run_diagnose"]


REQUIRED_COVERAGE = (*BRANCHES, "hicache_offloads", "hicache_loadbacks", "swa_evicted_tokens", "midforward_remaps",
                     "prefix_cache_hits", "prefix_cache_evictions", "prefix_cache_tombstones",
                     "prefix_cache_loadbacks")


def _checks(run: RunResult, mismatches: list[Mismatch], reference: str) -> list[str]:
    # every runner branch the runner declares (they are all in the coverage) and every workload feature
    needed = dict.fromkeys([*run.coverage, *REQUIRED_COVERAGE])
    failures = [f"the workload did not exercise {name}" for name in needed if not run.coverage.get(name)]
    for (site, classification), n in sorted(run.key_change_counts.items()):
        if classification != BENIGN:
            failures.append(f"{n} {classification} event(s) at {site}")
    if any(ONE_OFF_SITE in (e.site, e.prev_site) for e in run.first_events.values()):
        failures.append(f"the one-off `{ONE_OFF_SITE}` translation went through the cache "
                        "(docs/translation-rules.md rule 1)")
    failures += [f"outputs differ from {reference}: {m.describe()}" for m in mismatches]
    return failures


# ---- entry point ----------------------------------------------------------------------------------------------
def run_diagnose(model: str = "tiny", policies=POLICIES, inject=(), guard: bool = True, verify: float = 0.0,
                 seed: int = 0, attention_backend: str = "torch", threads: int | None = 1) -> Report:
    """Run the workload under each policy with the faults `inject`, compare each run with its clean reference
    and collect the events. `threads=1` (default) keeps small models fast and runs bit-reproducible."""
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        _, net = load_model(model, progress=False)
        tokenizer = load_tokenizer(model)
        if not net.config.sliding_layer_ids:
            raise ValueError(f"model {model!r} has no sliding-window layers: nothing to diagnose")
        work = Workload(window=net.config.sliding_window, vocab=net.config.vocab_size, seed=seed)
        results: dict[tuple, RunResult] = {}

        def run(policy: str, **changes) -> RunResult:
            key = (policy, tuple(sorted(changes.items())))
            if key not in results:
                cfg = work.engine_config(model, policy, attention_backend=attention_backend, **changes)
                results[key] = run_workload(cfg, work, net, tokenizer)
            return results[key]

        faulty = dict(inject=tuple(inject), loc_cache_guard=guard, loc_cache_verify=verify)
        # Ground truth for every run, whatever its guard, verify or fault settings: the uncached policy of
        # this same build (a bug that also corrupts under the guard must not compare equal to itself).
        ref, reference = run("off", inject=(), loc_cache_guard=True, loc_cache_verify=0.0), "the uncached `off` run"
        reports, rows = [], []
        for policy in policies:
            result = run(policy, **faulty)
            mismatches = compare(result, ref)
            reports.append(PolicyReport(policy, result, reference, mismatches, _checks(result, mismatches, reference)))
            keys = sorted(result.key_change_counts, key=lambda k: (k[1] == BENIGN, k))
            for key in keys:
                first = result.first_events.get(key)
                rows.append(Row(policy, *key, result.key_change_counts[key], first,
                                result.phase_of(first.forward_id) if first else None))
        return Report(model, tuple(inject), guard, verify, reports, rows)
    finally:
        torch.set_num_threads(previous_threads)
