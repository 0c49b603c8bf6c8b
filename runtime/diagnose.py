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

Every run's tokens and sampled logits are compared with a clean reference: the same policy with no fault
and the guard on (or, for a clean run, the uncached `off` policy). The report lists policy x site x
classification with the first occurrence's origin and a suggested fix; the exit status is 1 when any
non-benign event, output mismatch or failed check occurred.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.config import POLICIES, EngineConfig
from runtime.context import get_forward_context
from runtime.engine import Engine
from runtime.executor.forward_batch import ForwardBatch
from runtime.executor.graph_runner import WARMUP_RUNS
from runtime.layers.sampler import SamplingParams, sample
from runtime.mem_cache.translation import ONE_OFF_SITE
from runtime.models.loader import load_model
from runtime.models.tokenizer import load_tokenizer
from telemetry.events import KeyChangeEvent
from telemetry.names import NON_BENIGN_CLASSIFICATIONS

PHASES = ("scheduler", "reserved_decode", "draft_steps", "midforward_remap")
DRAFT_STEPS = 3
LOGIT_ATOL = 1e-5  # runs are bit-deterministic (one thread, same ops): anything above is a real difference


# ---- the workload -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """Sizes derived from the model's sliding window W, so that every prompt is longer than the window and
    the scheduler phase runs out of pool space (W = 8 for the tiny model)."""

    window: int
    vocab: int
    seed: int = 0
    new_tokens: int = 8  # per request in the scheduler phase

    @property
    def prompt_lens(self) -> tuple[int, ...]:
        w = self.window
        return (w + 12, w + 19, w + 5, w + 25)

    @property
    def direct_prompt_lens(self) -> tuple[int, ...]:
        w = self.window
        return (w + 2, w + 4, w + 1)

    def engine_config(self, model: str, policy: str, **changes) -> EngineConfig:
        w = self.window
        # A little more than the four prompts, so that decode must retract; the SWA pool as large, so that
        # the remap can hold two windows twice over.
        full = 4 * w + 64
        return EngineConfig(
            model=model, loc_cache=policy, graphs=True, graph_batch_sizes=(1, 2), page_size=1,
            max_total_tokens=full, swa_full_tokens_ratio=1.0, max_running_requests=4,
            chunked_prefill_size=w + 4, hicache_size=4 * full, seed=self.seed, **changes,
        )

    def prompts(self, lens: tuple[int, ...], salt: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed * 1000 + salt)
        hi = min(self.vocab, 260)
        return [torch.randint(4, hi, (n,), generator=gen).tolist() for n in lens]


@dataclass
class _Seq:
    """One request driven directly through the model runner (no scheduler)."""

    ids: list[int]
    row: int
    locs: list[int] = field(default_factory=list)  # full slot of each cached position
    reserved: list[int] = field(default_factory=list)  # slots allocated ahead, not yet written
    out: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


class _Driver:
    """Runs forwards the scheduler never produces: reserved slots, several steps in one forward, a mapping
    update in the middle of a forward. Same pools, runner and sampling as the engine."""

    def __init__(self, engine: Engine, seed: int):
        self.engine = engine
        self.runner = engine.runner
        self.pool = engine.pool
        self.alloc = engine.pool.allocator
        self.table = engine.runner.req_to_token
        self.window = engine.model_config.sliding_window
        self.params = SamplingParams(max_new_tokens=1 << 20)  # greedy
        self.gen = torch.Generator().manual_seed(seed)
        self.remaps = 0

    # -- requests ---------------------------------------------------------------------------------------------
    def admit(self, prompts: list[list[int]]) -> list[_Seq]:
        """Prefill every prompt in one eager extend forward; sample each first token."""
        seqs = [_Seq(ids=list(p), row=self.table.alloc()) for p in prompts]
        lens = [len(p) for p in prompts]
        locs = self.alloc.alloc_extend([0] * len(seqs), lens, [-1] * len(seqs))
        if locs is None:
            raise RuntimeError("diagnose workload: pools too small for the direct phases")
        offset = 0
        for s, n in zip(seqs, lens):
            self.table.write(s.row, 0, locs[offset:offset + n])
            s.locs = locs[offset:offset + n].tolist()
            offset += n
        batch = ForwardBatch(False, torch.tensor([t for p in prompts for t in p]),
                             torch.tensor([i for n in lens for i in range(n)]), locs, [s.row for s in seqs],
                             [0] * len(seqs), lens)
        self._record(seqs, self.runner.forward(batch))
        self.release_window(seqs)
        return seqs

    def reserve(self, seqs: list[_Seq], steps: list[int]) -> None:
        """Allocate `steps[i]` decode slots ahead for seqs[i] (one allocator mutation, now)."""
        prefix = [len(s.locs) for s in seqs]
        locs = self.alloc.alloc_extend(prefix, [p + k for p, k in zip(prefix, steps)], [s.locs[-1] for s in seqs])
        if locs is None:
            raise RuntimeError("diagnose workload: pools too small to reserve decode slots")
        offset = 0
        for s, p, k in zip(seqs, prefix, steps):
            self.table.write(s.row, p, locs[offset:offset + k])
            s.reserved = locs[offset:offset + k].tolist()
            offset += k

    def decode(self, seqs: list[_Seq], reserved: bool = False) -> None:
        """One decode forward through `ModelRunner.forward` (graph replay for small batches, else eager).
        Without `reserved`, the slots are allocated now, as the scheduler does."""
        if reserved:
            locs = torch.tensor([s.reserved.pop(0) for s in seqs])
        else:
            locs = self.alloc.alloc_decode([len(s.locs) + 1 for s in seqs], [s.locs[-1] for s in seqs])
            for s, loc in zip(seqs, locs):
                self.table.write(s.row, len(s.locs), loc.view(1))
        self._record(seqs, self.runner.forward(self._decode_batch(seqs, locs)))

    def draft_steps(self, seqs: list[_Seq], steps: int) -> None:
        """`steps` decode steps inside one forward: one forward id and one forward-entry invalidation, each
        step writing through its own view of one step-major buffer of reserved slots."""
        per_seq = [torch.tensor(s.reserved[:steps]) for s in seqs]
        buffer = torch.stack(per_seq, dim=1).reshape(-1)  # (steps * B,) step-major
        forward_id = self.runner.next_forward_id()
        self.pool.invalidate_loc_cache("forward_entry")
        with torch.no_grad():
            for k in range(steps):
                locs = buffer[k * len(seqs):(k + 1) * len(seqs)]  # a view at offset k * B
                for s in seqs:
                    s.reserved.pop(0)
                self._record(seqs, self.runner.run(self._decode_batch(seqs, locs), "eager_decode", forward_id))

    def remap_after_first_sliding_layer(self, seqs: list[_Seq], register: bool) -> None:
        """Arm a one-shot hook: after the first sliding layer of the next forward, move the in-window tokens
        of `seqs` to new SWA slots, KV copied, through `set_full_to_swa_mapping` or by registering a rebuilt
        mapping; then rebuild the attention metadata (its window indices derive from the mapping too)."""
        mc = self.engine.model_config
        layer = self.runner.model.model.layers[mc.sliding_layer_ids[0]]

        def hook(module, args, output):
            handle.remove()
            self._remap(seqs, register)

        handle = layer.register_forward_hook(hook)

    def _remap(self, seqs: list[_Seq], register: bool) -> None:
        a = self.alloc
        full = torch.tensor([loc for s in seqs for loc in s.locs])  # includes the tokens being written now
        full = full[a.full_to_swa_index_mapping[full] > 0]
        old = a.full_to_swa_index_mapping[full]
        new = a.swa.alloc(full.numel())
        if new is None:
            raise RuntimeError("diagnose workload: SWA pool too small for the mid-forward remap")
        sp = self.pool.swa_pool
        for buf in sp.k_buffers + sp.v_buffers:
            buf[new] = buf[old]
        if register:
            mapping = a.full_to_swa_index_mapping.clone()
            mapping[full] = new
            self.pool.register_mapping(mapping)
        else:
            a.set_full_to_swa_mapping(full, new)
        a.swa.free(old)
        ctx = get_forward_context()
        ctx.attn_backend.init_forward_metadata(ctx.batch)
        self.remaps += 1

    def release_window(self, seqs: list[_Seq]) -> None:
        """Give back the SWA slots of tokens that left every window (what the scheduler does after a forward)."""
        for s in seqs:
            cut = len(s.locs) - self.window + 1
            if cut > 0:
                self.alloc.free_swa(torch.tensor(s.locs[:cut]))

    def finish(self, seqs: list[_Seq]) -> None:
        for s in seqs:
            self.alloc.free(torch.tensor(s.locs + s.reserved))
            self.table.free(s.row)

    # -- helpers ----------------------------------------------------------------------------------------------
    @staticmethod
    def _decode_batch(seqs: list[_Seq], locs: torch.Tensor) -> ForwardBatch:
        prefix = [len(s.locs) for s in seqs]
        for s, loc in zip(seqs, locs.tolist()):
            s.locs.append(loc)
        return ForwardBatch(True, torch.tensor([(s.ids + s.out)[-1] for s in seqs]), torch.tensor(prefix), locs,
                            [s.row for s in seqs], prefix, [p + 1 for p in prefix])

    def _record(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        tokens = sample(logits, [self.params] * len(seqs), self.gen)
        for s, t, row in zip(seqs, tokens, logits):
            s.out.append(t)
            s.logits.append(row.float().clone())


# ---- one run ------------------------------------------------------------------------------------------------
@dataclass
class PhaseOutput:
    prompts: list[list[int]]
    tokens: list[list[int]]
    logits: list[torch.Tensor]  # per request: (new tokens, vocab) logits each token was sampled from


@dataclass
class RunResult:
    config: EngineConfig
    outputs: dict[str, PhaseOutput]
    phase_starts: dict[str, int]  # first forward id of each phase (graph capture at start-up first)
    key_change_counts: dict[tuple[str, str], int]
    first_events: dict[tuple[str, str], KeyChangeEvent]
    coverage: dict[str, int]
    stale_guard_misses: int  # stale entries recomputed (by the guard or by sampled verification)
    suppressed_logs: int  # event records the rate limiter held back

    def phase_of(self, forward_id: int | None) -> str | None:
        found = None
        for phase, start in self.phase_starts.items():
            if forward_id is not None and forward_id >= start:
                found = phase
        return found


def _phase_output(seqs: list[_Seq]) -> PhaseOutput:
    return PhaseOutput([s.ids for s in seqs], [s.out for s in seqs], [torch.stack(s.logits) for s in seqs])


def run_workload(cfg: EngineConfig, work: Workload, model, tokenizer) -> RunResult:
    """The four phases in one engine (see the module docstring); outputs, events, and what was exercised."""
    engine = Engine(cfg, progress=False, model=model, tokenizer=tokenizer)  # graph capture runs here
    runner = engine.runner
    outputs: dict[str, PhaseOutput] = {}
    # NOTE: reads the runner's forward counter (no public getter) only to label phases in the report
    starts = {"graph_capture": 1, "scheduler": runner.last_forward_id + 1}

    logits: list[torch.Tensor] = []
    params = SamplingParams(max_new_tokens=work.new_tokens, ignore_eos=True)  # greedy
    prompts = work.prompts(work.prompt_lens, 1)
    tokens = engine.generate(prompts, params, logits_out=logits)
    outputs["scheduler"] = PhaseOutput(prompts, tokens, logits)
    engine.scheduler.assert_idle_clean()
    drive = _Driver(engine, work.seed)

    starts["reserved_decode"] = runner.last_forward_id + 1
    seqs = a, b, c = drive.admit(work.prompts(work.direct_prompt_lens, 2))
    drive.reserve(seqs, [6, 5, 2])
    for batch in ([a, b], [a, b], [a, b], [a, b, c], [a, b, c], [a]):  # replay x3, eager x2, replay
        drive.decode(batch, reserved=True)
    drive.release_window(seqs)
    drive.finish(seqs)
    outputs["reserved_decode"] = _phase_output(seqs)

    starts["draft_steps"] = runner.last_forward_id + 1
    seqs = drive.admit(work.prompts(work.direct_prompt_lens[:2], 3))
    drive.reserve(seqs, [DRAFT_STEPS] * len(seqs))
    drive.draft_steps(seqs, DRAFT_STEPS)
    drive.release_window(seqs)
    drive.finish(seqs)
    outputs["draft_steps"] = _phase_output(seqs)

    starts["midforward_remap"] = runner.last_forward_id + 1
    seqs = drive.admit(work.prompts(work.direct_prompt_lens[:2], 4))
    for step in range(4):  # graph replay; steps 1 and 2 get a remap after their first sliding layer
        if step in (1, 2):
            drive.remap_after_first_sliding_layer(seqs, register=step == 2)
        drive.decode(seqs)
        drive.release_window(seqs)
    drive.finish(seqs)
    outputs["midforward_remap"] = _phase_output(seqs)
    engine.scheduler.assert_idle_clean()

    stats, t = engine.stats, engine.stats.translation
    captures = len(runner.graph_runner.batch_sizes) * (WARMUP_RUNS + 1) if runner.graph_runner else 0
    coverage = {mode: n for mode, n in stats.forward_counts.items() if mode != "other"}
    coverage.update(graph_capture=captures, draft_steps=DRAFT_STEPS, midforward_remaps=drive.remaps,
                    hicache_offloads=stats.hicache_offloads, hicache_loadbacks=stats.hicache_loadbacks,
                    swa_evicted_tokens=stats.swa_evicted_tokens)
    return RunResult(
        config=cfg, outputs=outputs, phase_starts=starts,
        key_change_counts={k: v for k, v in t.key_change_counts.items() if v},
        first_events={(e.site, e.classification): e for e in engine.reporter.first_events()},
        coverage=coverage,
        stale_guard_misses=sum(v for (_, reason), v in t.miss_counts.items() if reason == "stale_guard"),
        suppressed_logs=sum(stats.suppressed_counts.values()),
    )


# ---- comparing and explaining -------------------------------------------------------------------------------
@dataclass
class Mismatch:
    phase: str
    tokens_differ: int
    tokens_total: int
    max_logit_diff: float

    def describe(self) -> str:
        return (f"{self.phase}: {self.tokens_differ}/{self.tokens_total} tokens differ, "
                f"max |dlogit| {self.max_logit_diff:.3g}")


def compare(run: RunResult, ref: RunResult) -> list[Mismatch]:
    """Phases whose tokens or sampled logits differ from the reference run's (a corrupted KV entry does not
    always flip a greedy token, so the logits each token was sampled from are compared too)."""
    out = []
    for phase in PHASES:
        mine, theirs = run.outputs[phase], ref.outputs[phase]
        total = sum(len(t) for t in theirs.tokens)
        differ = sum(x != y for m, t in zip(mine.tokens, theirs.tokens) for x, y in zip(m, t))
        differ += sum(abs(len(m) - len(t)) for m, t in zip(mine.tokens, theirs.tokens))
        diff = max((float((m[:n] - t[:n]).abs().max()) for m, t in zip(mine.logits, theirs.logits)
                    if (n := min(len(m), len(t)))), default=0.0)
        if differ or diff > LOGIT_ATOL:
            out.append(Mismatch(phase, differ, total, diff))
    return out


# Where each mapping mutation lives, for the suggested fix.
MUTATION_CODE = {
    "register_mapping": "HybridKVPool.register_mapping -> HybridAllocator.register_mapping",
    "set_mapping": "HybridAllocator.set_full_to_swa_mapping",
    "clear_swa_mapping": "HybridAllocator.clear_swa_mapping",
    "alloc": "HybridAllocator._map (alloc, alloc_extend, alloc_decode, alloc_window)",
    "free": "HybridAllocator.free",
    "free_swa": "HybridAllocator.free_swa",
    "clear": "HybridAllocator.clear",
}


def _mutation_site(cause: str | None) -> str | None:
    marker = "mapping changed at "
    if cause and marker in cause:
        return cause.split(marker, 1)[1].split(";")[0].strip()
    return None


def suggest_fix(e: KeyChangeEvent) -> str:
    """One line: which invalidation is missing, and where it belongs."""
    c = e.classification
    crossed = e.prev_forward_id is not None and e.prev_forward_id != e.forward_id
    if c == "stale_loc":
        if e.cause and "verification" in e.cause:
            return "a write no version counter sees (raw kernel, numpy) changed the buffer: invalidate right after it"
        if crossed:
            return (f"the entry crossed from forward {e.prev_forward_id} to {e.forward_id} while its buffer was "
                    "rewritten in place (a reused static buffer: rule 5 outranks rule 6): invalidate at forward "
                    "entry, before the graph/eager branch")
        site = _mutation_site(e.cause)
        if site is not None:
            return (f"the mapping mutation `{site}` ({MUTATION_CODE.get(site, site)}) changed the mapping "
                    "mid-forward without invalidate_loc_cache(): invalidate there")
        return "an in-place write to the location buffer reached the cache without invalidate_loc_cache(): add it there"
    if c == "cross_forward":
        return (f"missing forward-entry invalidation: the entry from forward {e.prev_forward_id} ({e.prev_mode}) "
                f"reached forward {e.forward_id} ({e.mode}); invalidate before the graph/eager branch")
    if c == "capture_pollution":
        return "invalidate at the start of every graph warm-up/capture run, or the captured graph records no gather"
    if c == "view_offset":
        return "key the memo on the view's data_ptr(), not the storage base pointer"
    if ONE_OFF_SITE in (e.site, e.prev_site):
        return (f"the one-off `{ONE_OFF_SITE}` translation went through the cache and evicted the forward's entry: "
                "route it around the cache (SPEC §5 rule 1)")
    return "benign: a second tensor translated within one forward (one extra gather)"


def _stack(stack: str, frames: int = 4) -> str:
    """The caller stack without torch's module-dispatch frames, innermost `frames` kept."""
    parts = [p for p in stack.split(" > ") if p and not p.startswith("modules/module.py")]
    return " > ".join(parts[-frames:]) or "-"


@dataclass
class Row:
    policy: str
    site: str
    classification: str
    count: int
    first: KeyChangeEvent | None
    phase: str | None  # workload phase of the first occurrence

    @property
    def benign(self) -> bool:
        return self.classification not in NON_BENIGN_CLASSIFICATIONS

    def as_dict(self) -> dict:
        e, first = self.first, None
        if e is not None:
            first = {"forward_id": e.forward_id, "mode": e.mode, "phase": self.phase, "prev_site": e.prev_site,
                     "prev_forward_id": e.prev_forward_id, "prev_mode": e.prev_mode, "cause": e.cause,
                     "stack": e.stack}
        return {"policy": self.policy, "site": self.site, "classification": self.classification,
                "count": self.count, "benign": self.benign, "first": first,
                "fix": suggest_fix(e) if e is not None else None}


@dataclass
class PolicyReport:
    policy: str
    result: RunResult
    reference: str  # what the outputs were compared with
    mismatches: list[Mismatch]
    failures: list[str]


@dataclass
class Report:
    model: str
    inject: tuple[str, ...]
    guard: bool
    verify: float
    policies: list[PolicyReport]
    rows: list[Row]

    @property
    def failures(self) -> list[str]:
        return [f"{p.policy}: {f}" for p in self.policies for f in p.failures]

    @property
    def exit_status(self) -> int:
        return 1 if self.failures else 0

    def totals(self) -> dict:
        by_class: dict[str, int] = {}
        for r in self.rows:
            by_class[r.classification] = by_class.get(r.classification, 0) + r.count
        return {"non_benign_events": sum(r.count for r in self.rows if not r.benign),
                "benign_events": sum(r.count for r in self.rows if r.benign),
                "by_classification": by_class,
                "output_mismatches": sum(len(p.mismatches) for p in self.policies),
                "failures": len(self.failures)}

    def as_dict(self) -> dict:
        return {
            "model": self.model, "inject": list(self.inject), "loc_cache_guard": self.guard,
            "loc_cache_verify": self.verify, "phases": list(PHASES),
            "rows": [r.as_dict() for r in self.rows],
            "runs": [{"policy": p.policy, "reference": p.reference, "outputs_equal": not p.mismatches,
                      "mismatches": [vars(m) for m in p.mismatches], "coverage": p.result.coverage,
                      "stale_guard_misses": p.result.stale_guard_misses,
                      "suppressed_logs": p.result.suppressed_logs, "failures": p.failures}
                     for p in self.policies],
            "totals": self.totals(),
            "failures": self.failures,
            "exit_status": self.exit_status,
        }


REQUIRED_COVERAGE = ("eager_extend", "eager_decode", "graph_capture", "graph_replay", "hicache_offloads",
                     "hicache_loadbacks", "swa_evicted_tokens", "midforward_remaps")


def _checks(run: RunResult, mismatches: list[Mismatch], reference: str) -> list[str]:
    failures = [f"the workload did not exercise {name}" for name in REQUIRED_COVERAGE if not run.coverage.get(name)]
    for (site, classification), n in sorted(run.key_change_counts.items()):
        if classification in NON_BENIGN_CLASSIFICATIONS:
            failures.append(f"{n} {classification} event(s) at {site}")
    if any(ONE_OFF_SITE in (e.site, e.prev_site) for e in run.first_events.values()):
        failures.append(f"the one-off `{ONE_OFF_SITE}` translation went through the cache (SPEC §5 rule 1)")
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
        clean = dict(inject=(), loc_cache_guard=True, loc_cache_verify=0.0)
        reports, rows = [], []
        for policy in policies:
            result = run(policy, **faulty)
            if faulty != clean:
                ref, reference = run(policy, **clean), f"the clean {policy} run"
            else:
                ref, reference = run("off", **clean), "the uncached `off` run"
            mismatches = compare(result, ref)
            reports.append(PolicyReport(policy, result, reference, mismatches, _checks(result, mismatches, reference)))
            keys = sorted(result.key_change_counts, key=lambda k: (k[1] not in NON_BENIGN_CLASSIFICATIONS, k))
            for key in keys:
                first = result.first_events.get(key)
                rows.append(Row(policy, *key, result.key_change_counts[key], first,
                                result.phase_of(first.forward_id) if first else None))
        return Report(model, tuple(inject), guard, verify, reports, rows)
    finally:
        torch.set_num_threads(previous_threads)


def render(report: Report) -> str:
    """The table for people: one line per (policy, site, classification), then origin, cause, stack and fix."""
    lines = [f"swa-runtime diagnose: model {report.model}, inject {' '.join(report.inject) or '(none)'}, "
             f"guard {'on' if report.guard else 'off'}" + (f", verify {report.verify:g}" if report.verify else "")]
    if report.policies:
        cov = report.policies[0].result.coverage
        lines.append(f"workload per policy ({', '.join(PHASES)}): " + ", ".join(f"{k} {v}" for k, v in cov.items()))
    lines.append("")
    header = (f"{'policy':<12}{'site':<16}{'classification':<21}{'kind':<8}{'count':>5}  "
              f"{'first seen':<40}filled by")
    lines += [header, "-" * (len(header) + 30)]
    if not report.rows:
        lines.append("(no key-change events)")
    for r in report.rows:
        e = r.first
        seen = f"fwd {e.forward_id} {e.mode} ({r.phase})" if e else "-"
        filled = f"{e.prev_site} @ fwd {e.prev_forward_id} {e.prev_mode}" if e and e.prev_site else "-"
        kind = "benign" if r.benign else "BUG"
        lines.append(f"{r.policy:<12}{r.site:<16}{r.classification:<21}{kind:<8}{r.count:>5}  {seen:<40}{filled}")
        if e is not None:
            indent = " " * 12
            if e.cause:
                lines.append(f"{indent}cause: {e.cause}")
            if e.stack:
                lines.append(f"{indent}stack: {_stack(e.stack)}")
            lines.append(f"{indent}fix:   {suggest_fix(e)}")
    lines.append("")
    for p in report.policies:
        n = p.result.stale_guard_misses
        recomputed = f" ({n} stale {'entry' if n == 1 else 'entries'} recomputed)" if n else ""
        lines.append(f"outputs {p.policy:<12}{'equal' if not p.mismatches else 'DIFFER'} vs {p.reference}{recomputed}")
        lines += [f"{'':<20}{m.describe()}" for m in p.mismatches]
    totals = report.totals()
    lines += ["", f"non-benign events: {totals['non_benign_events']}, benign: {totals['benign_events']}, "
                  f"failures: {totals['failures']} -> exit {report.exit_status}"]
    lines += [f"  FAIL {f}" for f in report.failures]
    return "\n".join(lines)
