"""The diagnose workload: five phases per policy through one engine, and the comparison of runs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.config import EngineConfig
from runtime.context import get_forward_context
from runtime.engine import Engine
from runtime.executor.forward_batch import ForwardBatch
from runtime.core import SamplingParams
from runtime.layers.sampler import sample
from telemetry.events import KeyChangeEvent


PHASES = ("scheduler", "prefix_cache", "reserved_decode", "draft_steps", "midforward_remap")
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
    chats: int = 4  # prefix-cache phase: conversations, run two at a time
    chat_turns: int = 4
    chat_new_tokens: int = 4  # per turn

    @property
    def chat_first_len(self) -> int:
        return self.window + 4

    @property
    def chat_user_len(self) -> int:
        return self.window - 5

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
        # A little more than the four prompts, so that decode must retract; the SWA pool half as large: the
        # remap can still hold two windows twice over, and the prefix cache's windows outgrow it before its
        # full KV outgrows the full pool (so that SWA pressure tombstones some).
        full = 4 * w + 64
        return EngineConfig(
            model=model, loc_cache=policy, graphs=True, graph_batch_sizes=(1, 2), page_size=1,
            max_total_tokens=full, swa_full_tokens_ratio=0.5, max_running_requests=4,
            chunked_prefill_size=w + 4, hicache_size=4 * full, seed=self.seed,
            kv_sanitizer=changes.pop("kv_sanitizer", "strict"), **changes,  # every access checked
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
        self.rows = engine.scheduler.free_rows  # the scheduler is idle between phases: borrow its rows
        self.window = engine.model_config.sliding_window
        self.params = SamplingParams(max_new_tokens=1 << 20)  # greedy
        self.gen = torch.Generator().manual_seed(seed)
        self.remaps = 0

    # -- requests ---------------------------------------------------------------------------------------------
    def admit(self, prompts: list[list[int]]) -> list[_Seq]:
        """Prefill every prompt in one eager extend forward; sample each first token."""
        seqs = [_Seq(ids=list(p), row=self.rows.pop(0)) for p in prompts]
        lens = [len(p) for p in prompts]
        locs = self.alloc.alloc_extend([0] * len(seqs), lens, [-1] * len(seqs))
        if locs is None:
            raise RuntimeError("diagnose workload: pools too small for the direct phases")
        offset = 0
        for s, n in zip(seqs, lens):
            self.table.write(s.row, 0, locs[offset:offset + n])
            s.locs = locs[offset:offset + n].tolist()
            offset += n
        batch = ForwardBatch(is_decode=False, input_ids=torch.tensor([t for p in prompts for t in p]),
                             positions=torch.tensor([i for n in lens for i in range(n)]), out_cache_loc=locs,
                             req_rows=[s.row for s in seqs], prefix_lens=[0] * len(seqs), seq_lens=lens)
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
        with self.runner.multi_step() as step:
            for k in range(steps):
                locs = buffer[k * len(seqs):(k + 1) * len(seqs)]  # a view at offset k * B
                for s in seqs:
                    s.reserved.pop(0)
                self._record(seqs, step(self._decode_batch(seqs, locs)))

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
            self.rows.append(s.row)

    # -- helpers ----------------------------------------------------------------------------------------------
    @staticmethod
    def _decode_batch(seqs: list[_Seq], locs: torch.Tensor) -> ForwardBatch:
        prefix = [len(s.locs) for s in seqs]
        for s, loc in zip(seqs, locs.tolist()):
            s.locs.append(loc)
        return ForwardBatch(is_decode=True, input_ids=torch.tensor([(s.ids + s.out)[-1] for s in seqs]),
                            positions=torch.tensor(prefix), out_cache_loc=locs, req_rows=[s.row for s in seqs],
                            prefix_lens=prefix, seq_lens=[p + 1 for p in prefix])

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


def chat_phase(engine: Engine, work: Workload) -> PhaseOutput:
    """Multi-turn chats through the engine's loop, two conversations at a time: every turn resends the
    conversation so far plus a new user message. Later turns hit the prefix cache; the conversations do not
    all fit in the pools, so older ones are evicted (their SWA windows tombstoned, their nodes sent to the
    host tier) and loaded back, with a registered mapping, when their next turn comes."""
    params = SamplingParams(max_new_tokens=work.chat_new_tokens, ignore_eos=True)  # greedy
    history = work.prompts((work.chat_first_len,) * work.chats, 5)
    out = PhaseOutput([], [], [])
    for turn in range(work.chat_turns):
        for pair in range(0, work.chats, 2):
            convs = list(range(pair, min(pair + 2, work.chats)))
            prompts = [history[i] for i in convs]
            logits: list[torch.Tensor] = []
            tokens = engine.generate(prompts, params, logits_out=logits)
            out.prompts += prompts
            out.tokens += tokens
            out.logits += logits
            users = work.prompts((work.chat_user_len,) * len(convs), 100 + turn * work.chats + pair)
            for i, answer, user in zip(convs, tokens, users):
                history[i] = history[i] + answer + user
    return out


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
    engine.slots.clear_prefix_cache()  # the next phase starts from an empty cache

    starts["prefix_cache"] = runner.last_forward_id + 1
    outputs["prefix_cache"] = chat_phase(engine, work)
    engine.scheduler.assert_idle_clean()
    engine.slots.clear_prefix_cache()  # the direct phases below borrow the pools
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
    engine.close()

    stats, t, tree = engine.stats, engine.stats.translation, engine.slots.tree
    coverage = dict(runner.branch_counts)  # every runner branch, by name
    coverage.update(draft_steps=DRAFT_STEPS, midforward_remaps=drive.remaps,
                    hicache_offloads=stats.hicache_offloads, hicache_loadbacks=stats.hicache_loadbacks,
                    swa_evicted_tokens=stats.swa_evicted_tokens, prefix_cache_hits=stats.prefix_cache.hit_tokens,
                    prefix_cache_evictions=tree.evictions if tree else 0,
                    prefix_cache_tombstones=tree.tombstones if tree else 0,
                    prefix_cache_loadbacks=tree.loadbacks if tree else 0)
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
