"""Forwards the scheduler never produces, driven straight through the model runner: slots reserved ahead,
several steps in one forward, a mapping update in the middle of a forward, decode and verify batches of
chosen shapes.
Same pools, runner and sampling as the engine; page size 1 or more."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.context import get_forward_context
from runtime.core import SamplingParams
from runtime.engine import Engine
from runtime.executor.forward_batch import ForwardBatch
from runtime.layers.sampler import sample
from runtime.speculative.acceptance import accept_greedy

DRAFT_STEPS = 3  # decode steps inside one forward in the draft_steps phase


@dataclass
class Seq:
    """One request driven directly through the model runner (no scheduler)."""

    ids: list[int]
    row: int
    locs: list[int] = field(default_factory=list)  # full slot of each cached position
    reserved: list[int] = field(default_factory=list)  # slots allocated ahead, not yet written
    out: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


class Driver:
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
    def admit(self, prompts: list[list[int]]) -> list[Seq]:
        """Prefill every prompt in one eager extend forward; sample each first token."""
        seqs = [Seq(ids=list(p), row=self.rows.pop(0)) for p in prompts]
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

    def reserve(self, seqs: list[Seq], steps: list[int]) -> None:
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

    def decode(self, seqs: list[Seq], reserved: bool = False) -> None:
        """One decode forward through `ModelRunner.forward` (graph replay for small batches, else eager).
        Without `reserved`, the slots are allocated now, as the scheduler does."""
        if reserved:
            locs = torch.tensor([s.reserved.pop(0) for s in seqs])
        else:
            locs = self.alloc.alloc_decode([len(s.locs) + 1 for s in seqs], [s.locs[-1] for s in seqs])
            for s, loc in zip(seqs, locs):
                self.table.write(s.row, len(s.locs), loc.view(1))
        self._record(seqs, self.runner.forward(self._decode_batch(seqs, locs)))

    def verify(self, seqs: list[Seq], drafts: list[list[int]]) -> None:
        """One speculative verify forward through `ModelRunner.forward` (replayed over the verify graph of its
        batch size, or eagerly beyond the largest), over reserved slots: each seq's last token and its draft.
        Greedy acceptance as the engine's; the slots of rejected drafts stay reserved for the positions they
        were reserved for, so the next verify writes them again and no allocator mutation comes between."""
        lens = [1 + len(d) for d in drafts]
        locs = torch.tensor([loc for s, n in zip(seqs, lens) for loc in s.reserved[:n]])
        prefix = [len(s.locs) for s in seqs]
        ids = [t for s, d in zip(seqs, drafts) for t in [(s.ids + s.out)[-1], *d]]
        batch = ForwardBatch(is_decode=False, verify=True, input_ids=torch.tensor(ids),
                             positions=torch.tensor([p + i for p, n in zip(prefix, lens) for i in range(n)]),
                             out_cache_loc=locs, req_rows=[s.row for s in seqs], prefix_lens=prefix,
                             seq_lens=[p + n for p, n in zip(prefix, lens)])
        logits = self.runner.forward(batch)  # (T, vocab)
        offset = 0
        for s, d, n in zip(seqs, drafts, lens):
            rows = logits[offset:offset + n]
            offset += n
            tokens = accept_greedy(d, rows.argmax(-1).tolist())
            s.out += tokens
            s.logits += [row.float().clone() for row in rows[:len(tokens)]]
            s.locs += s.reserved[:len(tokens)]  # the last token's and the accepted drafts' KV is kept
            del s.reserved[:len(tokens)]

    def draft_steps(self, seqs: list[Seq], steps: int) -> None:
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

    def remap_after_first_sliding_layer(self, seqs: list[Seq], register: bool) -> None:
        """Arm a one-shot hook: after the first sliding layer of the next forward, move the in-window tokens
        of `seqs` to new SWA slots, KV copied, through `set_full_to_swa_mapping` or by registering a rebuilt
        mapping; then rebuild the attention metadata (its window indices derive from the mapping too)."""
        mc = self.engine.model_config
        layer = self.runner.model.model.layers[mc.sliding_layer_ids[0]]

        def hook(module, args, output):
            handle.remove()
            self._remap(seqs, register)

        handle = layer.register_forward_hook(hook)

    def _remap(self, seqs: list[Seq], register: bool) -> None:
        a, ps = self.alloc, self.alloc.page_size
        full = torch.tensor([loc for s in seqs for loc in s.locs])  # includes the tokens being written now
        full = full[a.full_to_swa_index_mapping[full] > 0]
        old = a.full_to_swa_index_mapping[full]
        # whole pages move: a token keeps its offset in its page (the allocator continues pages that way)
        pages = sorted(set((old // ps).tolist()))
        fresh = a.swa.alloc(len(pages) * ps)
        if fresh is None:
            raise RuntimeError("diagnose workload: SWA pool too small for the mid-forward remap")
        base = dict(zip(pages, fresh[::ps].tolist()))
        new = torch.tensor([base[slot // ps] + slot % ps for slot in old.tolist()], dtype=torch.int64)
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

    def release_window(self, seqs: list[Seq]) -> None:
        """Give back the SWA slots of tokens that left every window (what the scheduler does after a forward)."""
        for s in seqs:
            cut = len(s.locs) - self.window + 1
            if cut > 0:
                self.alloc.free_swa(torch.tensor(s.locs[:cut]))

    def finish(self, seqs: list[Seq]) -> None:
        for s in seqs:
            self.alloc.free(torch.tensor(s.locs + s.reserved))
            self.rows.append(s.row)

    # -- helpers ----------------------------------------------------------------------------------------------
    @staticmethod
    def _decode_batch(seqs: list[Seq], locs: torch.Tensor) -> ForwardBatch:
        prefix = [len(s.locs) for s in seqs]
        for s, loc in zip(seqs, locs.tolist()):
            s.locs.append(loc)
        return ForwardBatch(is_decode=True, input_ids=torch.tensor([(s.ids + s.out)[-1] for s in seqs]),
                            positions=torch.tensor(prefix), out_cache_loc=locs, req_rows=[s.row for s in seqs],
                            prefix_lens=prefix, seq_lens=[p + 1 for p in prefix])

    def _record(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        tokens = sample(logits, [self.params] * len(seqs), self.gen)
        for s, t, row in zip(seqs, tokens, logits):
            s.out.append(t)
            s.logits.append(row.float().clone())
