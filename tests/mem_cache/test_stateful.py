"""Random operation sequences against a pure-Python reference of the hybrid allocator.

Requests grow by extend/decode, lose their oldest tokens' SWA slots as the window slides, get freed, remapped,
re-registered; a persistent location buffer is rewritten in place between translations, like a replayed
graph's input. Under every policy with the guard on, every translation must equal a gather through the
reference mapping, no slot may leak, and the mapped SWA slots must be exactly the SWA slots in use.
"""

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from runtime.mem_cache.swa_pool import build_hybrid_kv_pool
from telemetry.logging import EventReporter
from telemetry.ratelimit import RateLimiter
from telemetry.stats import EngineStats

FULL, SWA, SLIDING = 48, 24, 3


class HybridMachine(RuleBasedStateMachine):
    policy = "memo"
    page_size = 1

    def __init__(self):
        super().__init__()
        stats = EngineStats(self.policy)
        self.stats = stats
        self.pool = build_hybrid_kv_pool(
            full_size=FULL, swa_size=SWA, page_size=self.page_size, layer_is_swa=[True] * SLIDING + [False],
            num_kv_heads=1, head_dim=2, dtype=torch.float32, policy=self.policy, stats=stats.translation,
            reporter=EventReporter(stats, RateLimiter(3600.0)),
        )
        self.h = self.pool.allocator
        # Reference: per request, its tokens' full slots in position order; full slot -> SWA slot (or absent).
        self.reqs: dict[int, list[int]] = {}
        self.swa_of: dict[int, int] = {}
        self.next_req = 0
        self.static = torch.zeros(4, dtype=torch.int64)  # a persistent location buffer (stable address)
        self.forward_id = 0

    # ---- helpers -------------------------------------------------------------------------------------------
    def _ref_translate(self, locs: list[int]) -> list[int]:
        return [-1 if x == -1 else self.swa_of.get(x, 0) for x in locs]

    def _sync_new(self, full: torch.Tensor) -> None:
        for f in full.tolist():
            self.swa_of[f] = int(self.h.full_to_swa_index_mapping[f])

    def _pages(self, n: int) -> int:
        return -(-n // self.page_size)

    # ---- operations ----------------------------------------------------------------------------------------
    @rule(n=st.integers(1, 9))
    def new_request(self, n):
        need = self._pages(n) * self.page_size
        fits = need <= self.h.full.available_size() and need <= self.h.swa.available_size()
        full = self.h.alloc_extend([0], [n], [-1])
        assert (full is not None) == fits
        if full is None:
            return
        assert full.numel() == n
        self.reqs[self.next_req] = full.tolist()
        self.next_req += 1
        self._sync_new(full)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), extra=st.integers(1, 5))
    def extend(self, data, extra):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        toks = self.reqs[rid]
        if self.swa_of.get(toks[-1], 0) == 0:
            return  # its last token left the window: the engine would not extend it
        full = self.h.alloc_extend([len(toks)], [len(toks) + extra], [toks[-1]])
        if full is None:
            return
        toks.extend(full.tolist())
        self._sync_new(full)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free_request(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        toks = self.reqs.pop(rid)
        self.h.free(torch.tensor(toks))
        for t in toks:
            self.swa_of.pop(t, None)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), window=st.integers(1, 6))
    def slide_window(self, data, window):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        toks = self.reqs[rid]
        left = toks[: max(0, len(toks) - window)]
        if not left:
            return
        freed = self.h.free_swa(torch.tensor(left))
        # Reference for page rounding: positions are page-aligned, so whole pages before the cut go.
        cut = (len(left) // self.page_size) * self.page_size
        expect = [t for t in toks[:cut] if self.swa_of.get(t, 0) > 0]
        assert freed == len(expect)
        for t in expect:
            self.swa_of[t] = 0

    @precondition(lambda self: sum(1 for v in self.swa_of.values() if v > 0) >= 2 and self.page_size == 1)
    @rule(data=st.data())
    def swap_mapping(self, data):
        mapped = sorted(t for t, s in self.swa_of.items() if s > 0)
        a, b = data.draw(st.lists(st.sampled_from(mapped), min_size=2, max_size=2, unique=True))
        sa, sb = self.swa_of[a], self.swa_of[b]
        self.h.set_full_to_swa_mapping(torch.tensor([a, b]), torch.tensor([sb, sa]))
        self.swa_of[a], self.swa_of[b] = sb, sa

    @rule()
    def register_rebuilt_mapping(self):
        self.pool.register_mapping(self.h.full_to_swa_index_mapping.clone())

    @rule()
    def clear(self):
        self.h.clear()
        self.reqs.clear()
        self.swa_of.clear()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def rewrite_static_buffer(self, data):
        held = sorted(t for toks in self.reqs.values() for t in toks)
        vals = data.draw(st.lists(st.sampled_from(held), min_size=4, max_size=4))
        self.static.copy_(torch.tensor(vals))  # in place: same pointer, same length, new contents

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def rewrite_between_layers(self, data):
        """The hazard itself: the static buffer is rewritten between two translations of one forward."""
        self.translate(new_forward=True, layers=1, use_static=True, data=data)
        self.rewrite_static_buffer(data)
        self.translate(new_forward=False, layers=SLIDING, use_static=True, data=data)

    @rule(new_forward=st.booleans(), layers=st.integers(1, SLIDING), use_static=st.booleans(), data=st.data())
    def translate(self, new_forward, layers, use_static, data):
        if new_forward or self.forward_id == 0:
            self.forward_id += 1
        if use_static:
            loc = self.static
        else:
            held = sorted(self.swa_of) or [-1]
            loc = torch.tensor(data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=6)))
        if new_forward:
            self.pool.begin_forward(self.forward_id, "eager_decode")  # invalidates at forward entry
        else:
            self.pool.translator.begin_forward(self.forward_id, "eager_decode")  # same forward goes on
        for layer in range(layers):
            out = self.pool.translate_loc_from_full_to_swa(loc, "kv_write", layer)
            assert out.tolist() == self._ref_translate(loc.tolist())
        self.pool.end_forward()

    # ---- invariants ----------------------------------------------------------------------------------------
    @invariant()
    def mapping_matches_reference(self):
        m = self.h.full_to_swa_index_mapping
        assert int(m[-1]) == -1
        nonzero = {i: int(v) for i, v in enumerate(m[:-1].tolist()) if v}
        assert nonzero == {t: s for t, s in self.swa_of.items() if s}

    @invariant()
    def no_slot_leaks(self):
        ps = self.page_size
        full_pages = {t // ps for toks in self.reqs.values() for t in toks}
        assert self.h.full.available_size() == FULL - len(full_pages) * ps
        swa_pages = {s // ps for s in self.swa_of.values() if s}
        assert self.h.swa.available_size() == SWA - len(swa_pages) * ps

    @invariant()
    def mapped_swa_slots_are_the_swa_slots_in_use(self):
        mapped = [s for s in self.swa_of.values() if s]
        assert len(mapped) == len(set(mapped))
        if mapped:
            assert bool(self.h.swa.is_held(torch.tensor(mapped)).all())
        held_pages = {p for p in range(1, self.h.swa.num_pages + 1) if self.h.swa._held[p]}
        assert held_pages == {s // self.page_size for s in mapped}


SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _machine(policy, page_size):
    cls = type(f"Hybrid_{policy}_{page_size}", (HybridMachine,), {"policy": policy, "page_size": page_size})
    return cls


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", ["memo", "layerwise", "per_forward", "off"])
def test_random_operation_sequences_match_the_reference(policy, page_size):
    machine = _machine(policy, page_size)
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()
