"""The diagnose workload: its phases, the engine setups that run them, and one run's results.

Every setup runs in an engine of its own, under each policy (see the package docstring for the phases):
page size 1 and 4, prefix cache on and off, host tier on and off, and a wide setup whose decode batches are
padded into a larger graph or run eagerly at twice the largest graph size, and whose verify batches fill
their graph exactly, are padded, or run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.config import EngineConfig
from runtime.core import SamplingParams
from runtime.diagnose.driver import DRAFT_STEPS, Driver, Seq
from runtime.diagnose.coverage import memory_path_counts
from runtime.engine import Engine
from telemetry.events import KeyChangeEvent

PHASES = ("scheduler", "prefix_cache", "prefix_edits", "reserved_decode", "draft_steps", "midforward_remap",
          "reserved_verify", "wide_decode")
BENIGN = "benign_fresh_tensor"  # the one classification that is not a bug
LOGIT_ATOL = 1e-5  # two runs of one build are bit-deterministic (one thread, same ops): above is a real difference


# ---- setups -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """One engine configuration of the workload and the phases it runs."""

    name: str
    phases: tuple[str, ...]
    page_size: int = 1
    prefix_cache: bool = True
    host_tier: float = 4.0  # host-tier tokens, in full pools (0: none)
    graph_batch_sizes: tuple[int, ...] = (1, 2)
    max_running: int = 4
    speculative: str = "none"  # --speculative-algorithm: verify forwards and rollbacks in the scheduler phases


SETUPS = (
    Setup("base", PHASES[:6], speculative="ngram"),
    Setup("paged", PHASES[:6], page_size=4, speculative="ngram"),  # rollbacks inside and across pages
    Setup("small_host", PHASES[:3], host_tier=0.5),  # the prefix cache fills the host tier
    Setup("no_prefix", PHASES[:2], page_size=4, prefix_cache=False, speculative="suffix"),
    Setup("no_host", PHASES[:3], host_tier=0.0),
    # batches of 3 replayed in the graph of 4, eager batches of 8 = twice the largest graph size; verify
    # batches of up to 4 requests replayed, of 5 eager (the verify graphs exist when speculating)
    Setup("wide", PHASES[6:], graph_batch_sizes=(1, 2, 4), max_running=8, speculative="ngram"),
)


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

    def wide_prompt_lens(self, n: int) -> tuple[int, ...]:
        return tuple(self.window + 1 + i % 3 for i in range(n))

    def engine_config(self, model: str, policy: str, setup: Setup = SETUPS[0], **changes) -> EngineConfig:
        w = self.window
        # A little more than the four prompts, so that decode must retract; the SWA pool half as large: the
        # remap can still hold two windows twice over, and the prefix cache's windows outgrow it before its
        # full KV outgrows the full pool (so that SWA pressure tombstones some). The wide setup holds all of
        # its requests at once (their prompts, a window each in the SWA pool).
        full = 4 * w + 64 if setup.max_running <= 4 else setup.max_running * (2 * w + 8)
        full = -(-full // setup.page_size) * setup.page_size
        # float32 and no quantization: the dense reference holds every run to float32 arithmetic
        return EngineConfig(
            model=model, dtype="float32", quantization="none", speculative_algorithm=setup.speculative,
            loc_cache=policy, graphs=True, graph_batch_sizes=setup.graph_batch_sizes,
            page_size=setup.page_size, max_total_tokens=full, swa_full_tokens_ratio=0.5,
            max_running_requests=setup.max_running, chunked_prefill_size=w + 4,
            hicache_size=int(setup.host_tier * full), disable_prefix_caching=not setup.prefix_cache,
            seed=self.seed,
            kv_sanitizer=changes.pop("kv_sanitizer", "strict"), **changes,  # every access checked
        )

    def prompts(self, lens: tuple[int, ...], salt: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed * 1000 + salt)
        hi = min(self.vocab, 260)
        return [torch.randint(4, hi, (n,), generator=gen).tolist() for n in lens]


# ---- the phases ---------------------------------------------------------------------------------------------
@dataclass
class PhaseOutput:
    prompts: list[list[int]]
    tokens: list[list[int]]
    logits: list[torch.Tensor]  # per request: (new tokens, vocab) logits each token was sampled from


def _phase_output(seqs: list[Seq]) -> PhaseOutput:
    return PhaseOutput([s.ids for s in seqs], [s.out for s in seqs], [torch.stack(s.logits) for s in seqs])


def scheduler_phase(engine: Engine, work: Workload, drive: Driver) -> PhaseOutput:
    """Four requests through the engine's loop: chunked prefill, graph replay and eager decode, window
    eviction, retraction under pool pressure (to the host tier and back, or recomputed without one)."""
    logits: list[torch.Tensor] = []
    params = SamplingParams(max_new_tokens=work.new_tokens, ignore_eos=True)  # greedy
    prompts = work.prompts(work.prompt_lens, 1)
    tokens = engine.generate(prompts, params, logits_out=logits)
    return PhaseOutput(prompts, tokens, logits)


def chat_phase(engine: Engine, work: Workload, drive: Driver) -> PhaseOutput:
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


def prefix_edits_phase(engine: Engine, work: Workload, drive: Driver) -> PhaseOutput:
    """What chats do besides appending, through the engine's loop: the same prompt sent twice at once (the
    second finisher's copy is freed: the tree has it), and a user editing a message a few tokens before the
    end of a conversation, once while its cached copy sits tombstoned on the device (the request's copy
    replaces it) and once after the conversation went to the host tier (the request's device copy replaces
    the host copy; the host node is split where the edit diverges)."""
    w = work.window
    params = SamplingParams(max_new_tokens=work.chat_new_tokens, ignore_eos=True)  # greedy
    out = PhaseOutput([], [], [])

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        logits: list[torch.Tensor] = []
        tokens = engine.generate(prompts, params, logits_out=logits)
        out.prompts.extend(prompts)
        out.tokens.extend(tokens)
        out.logits.extend(logits)
        return tokens

    x, y = work.prompts((w + 4, w + 4), 200)
    for turn in range(2):  # turn 2 of x twice at once
        users = work.prompts((2 * w, 2 * w), 201 + turn)
        answers = generate([x, x, y] if turn else [x, y])
        cached = [len(x) + len(answers[0]) - 1, len(y) + len(answers[-1]) - 1]  # what the tree got of each
        x, y = x + answers[0] + users[0], y + answers[-1] + users[1]
    # edits diverging a window and 2 tokens before the end of what the tree holds of the conversation: inside
    # its tombstoned part, which the edit's own last window covers
    generate([x[:cached[0] - w - 2] + work.prompts((3,), 203)[0]])
    generate(work.prompts((3 * w, 3 * w), 204))  # other requests push both conversations to the host tier
    generate([y[:cached[1] - w - 2] + work.prompts((3,), 205)[0]])
    return out


def reserved_decode_phase(engine: Engine, work: Workload, drive: Driver) -> PhaseOutput:
    seqs = a, b, c = drive.admit(work.prompts(work.direct_prompt_lens, 2))
    drive.reserve(seqs, [6, 5, 2])
    for batch in ([a, b], [a, b], [a, b], [a, b, c], [a, b, c], [a]):  # replay x3, eager x2, replay
        drive.decode(batch, reserved=True)
    drive.release_window(seqs)
    drive.finish(seqs)
    return _phase_output(seqs)


def draft_steps_phase(engine: Engine, work: Workload, drive: Driver) -> PhaseOutput:
    seqs = drive.admit(work.prompts(work.direct_prompt_lens[:2], 3))
    drive.reserve(seqs, [DRAFT_STEPS] * len(seqs))
    drive.draft_steps(seqs, DRAFT_STEPS)
    drive.release_window(seqs)
    drive.finish(seqs)
    return _phase_output(seqs)


def midforward_remap_phase(engine: Engine, work: Workload, drive: Driver) -> PhaseOutput:
    seqs = drive.admit(work.prompts(work.direct_prompt_lens[:2], 4))
    for step in range(4):  # graph replay; steps 1 and 2 get a remap after their first sliding layer
        if step in (1, 2):
            drive.remap_after_first_sliding_layer(seqs, register=step == 2)
        drive.decode(seqs)
        drive.release_window(seqs)
    drive.finish(seqs)
    return _phase_output(seqs)


def reserved_verify_phase(engine: Engine, work: Workload, drive: Driver) -> PhaseOutput:
    """Verify forwards of every shape the verify graphs treat differently, back to back over slots reserved
    ahead (only the forward entry invalidates between them): the largest graph filled exactly (every request
    drafting K tokens), padded (shorter drafts, a request without one, one request alone), and eager (one
    request more than the largest graph size). The drafts are random tokens: mostly rejected, their slots
    written again by the next step."""
    k, n = engine.cfg.num_speculative_tokens, max(engine.cfg.graph_batch_sizes)
    seqs = drive.admit(work.prompts(work.wide_prompt_lens(n + 1), 7))
    # the first two replay the same buffers: a replay over a rewritten buffer at the same address
    steps = [(seqs[:n], [k] * n), (seqs[:n], [k] * (n - 1) + [0]), (seqs[:1], [1]), (seqs, [1] * (n + 1))]
    drive.reserve(seqs, [sum(1 + lens[i] for batch, lens in steps for i, t in enumerate(batch) if t is s)
                         for s in seqs])
    for step, (batch, lens) in enumerate(steps):
        drive.verify(batch, work.prompts(tuple(lens), 300 + step))
    drive.release_window(seqs)
    drive.finish(seqs)
    return _phase_output(seqs)


def wide_decode_phase(engine: Engine, work: Workload, drive: Driver) -> PhaseOutput:
    """Decode batches of every shape the graphs treat differently: all requests at once (eager, at least
    twice the largest graph size), a batch one short of a graph size (replayed padded), exact sizes."""
    seqs = drive.admit(work.prompts(work.wide_prompt_lens(engine.cfg.max_running_requests), 6))
    largest = max(engine.cfg.graph_batch_sizes)
    for batch in (seqs, seqs[:largest - 1], seqs, seqs[-largest:], seqs[:largest - 1], seqs[:1], seqs):
        drive.decode(batch)
        drive.release_window(batch)
    drive.finish(seqs)
    return _phase_output(seqs)


PHASE_RUNNERS = {"scheduler": scheduler_phase, "prefix_cache": chat_phase, "prefix_edits": prefix_edits_phase,
                 "reserved_decode": reserved_decode_phase, "draft_steps": draft_steps_phase,
                 "midforward_remap": midforward_remap_phase, "reserved_verify": reserved_verify_phase,
                 "wide_decode": wide_decode_phase}


# ---- one run ------------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    config: EngineConfig
    setup: str
    outputs: dict[str, PhaseOutput]
    phase_starts: dict[str, int]  # first forward id of each phase (graph capture at start-up first)
    key_change_counts: dict[tuple[str, str], int]
    phase_events: dict[str, dict[tuple[str, str], int]]  # the key-change counts of each phase alone
    first_events: dict[tuple[str, str], KeyChangeEvent]
    coverage: dict[str, int]  # runner branches and workload features
    memory_paths: dict[str, int]  # every declared memory path (runtime/mem_cache/paths.py), by name
    stale_guard_misses: int  # stale entries recomputed (by the guard or by sampled verification)
    suppressed_logs: int  # event records the rate limiter held back

    def phase_of(self, forward_id: int | None) -> str | None:
        found = None
        for phase, start in self.phase_starts.items():
            if forward_id is not None and forward_id >= start:
                found = phase
        return found

    def bug_events_in(self, phase: str) -> int:
        """Non-benign key-change events counted during `phase`."""
        return sum(n for (_, c), n in self.phase_events.get(phase, {}).items() if c != BENIGN)


def run_workload(cfg: EngineConfig, work: Workload, model, tokenizer, setup: Setup = SETUPS[0]) -> RunResult:
    """The phases of `setup` in one engine built from `cfg`; outputs, events, and what was exercised."""
    engine = Engine(cfg, progress=False, model=model, tokenizer=tokenizer)  # graph capture runs here
    runner, counts = engine.runner, engine.stats.translation.key_change_counts
    drive = Driver(engine, work.seed)
    outputs: dict[str, PhaseOutput] = {}
    # NOTE: reads the runner's forward counter (no public getter) only to label phases in the report
    starts = {"graph_capture": 1}
    phase_events = {"graph_capture": {k: v for k, v in counts.items() if v}}
    for phase in setup.phases:
        before = dict(counts)
        starts[phase] = runner.last_forward_id + 1
        outputs[phase] = PHASE_RUNNERS[phase](engine, work, drive)
        phase_events[phase] = {k: v - before.get(k, 0) for k, v in counts.items() if v > before.get(k, 0)}
        engine.scheduler.assert_idle_clean()
        engine.slots.clear_prefix_cache()  # the next phase starts from an empty cache (the driver borrows pools)
    engine.close()

    stats, t, tree = engine.stats, engine.stats.translation, engine.slots.tree
    coverage = dict(runner.branch_counts)  # every runner branch, by name
    coverage.update(draft_steps=DRAFT_STEPS if "draft_steps" in outputs else 0, midforward_remaps=drive.remaps,
                    hicache_offloads=stats.hicache_offloads, hicache_loadbacks=stats.hicache_loadbacks,
                    swa_evicted_tokens=stats.swa_evicted_tokens, prefix_cache_hits=stats.prefix_cache.hit_tokens,
                    prefix_cache_evictions=tree.evictions if tree else 0,
                    prefix_cache_tombstones=tree.tombstones if tree else 0,
                    prefix_cache_loadbacks=tree.loadbacks if tree else 0)
    return RunResult(
        config=cfg, setup=setup.name, outputs=outputs, phase_starts=starts,
        key_change_counts={k: v for k, v in t.key_change_counts.items() if v}, phase_events=phase_events,
        first_events={(e.site, e.classification): e for e in engine.reporter.first_events()},
        coverage=coverage, memory_paths=memory_path_counts(engine),
        stale_guard_misses=sum(v for (_, reason), v in t.miss_counts.items() if reason == "stale_guard"),
        suppressed_logs=sum(stats.suppressed_counts.values()),
    )


# ---- comparing ----------------------------------------------------------------------------------------------
@dataclass
class Mismatch:
    phase: str
    tokens_differ: int
    tokens_total: int
    max_logit_diff: float
    setup: str = SETUPS[0].name
    undetected: bool = False  # no bug-class event was counted in the phase: the detectors missed it

    def describe(self) -> str:
        where = self.phase if self.setup == SETUPS[0].name else f"{self.setup}/{self.phase}"
        return (f"{where}: {self.tokens_differ}/{self.tokens_total} tokens differ, "
                f"max |dlogit| {self.max_logit_diff:.3g}")


def compare(run: RunResult, ref: RunResult) -> list[Mismatch]:
    """Phases whose tokens or sampled logits differ from another run's of the same setup, bit for bit (a
    corrupted KV entry does not always flip a greedy token, so the logits are compared too)."""
    out = []
    for phase in run.outputs:
        mine, theirs = run.outputs[phase], ref.outputs[phase]
        total = sum(len(t) for t in theirs.tokens)
        differ = sum(x != y for m, t in zip(mine.tokens, theirs.tokens) for x, y in zip(m, t))
        differ += sum(abs(len(m) - len(t)) for m, t in zip(mine.tokens, theirs.tokens))
        diff = max((float((m[:n] - t[:n]).abs().max()) for m, t in zip(mine.logits, theirs.logits)
                    if (n := min(len(m), len(t)))), default=0.0)
        if differ or diff > LOGIT_ATOL:
            out.append(Mismatch(phase, differ, total, diff, run.setup))
    return out
