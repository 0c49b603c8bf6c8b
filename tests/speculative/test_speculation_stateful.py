"""Randomised: speculative verify and rollback mixed with aborts, retraction to the host tier and prefix-cache
hits under tight pools. Whatever the interleaving, every slot comes back, no bug-class translation event is
counted, and each request that ran to the end emitted what it emits alone without speculation."""

import functools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.core import Req, SamplingParams
from telemetry.names import NON_BENIGN_CLASSIFICATIONS
from test_engine_speculation import engine

TIGHT = dict(max_total_tokens=192, swa_full_tokens_ratio=0.5, hicache_size=2048, chunked_prefill_size=24,
             max_running_requests=4)


@functools.lru_cache(maxsize=None)
def alone(prompt: tuple[int, ...], max_new: int) -> list[int]:
    """What the request emits by itself, one token a step (a fresh engine, nothing else running)."""
    return engine().generate([list(prompt)], SamplingParams(max_new_tokens=max_new, ignore_eos=True))[0]


unit = st.lists(st.integers(4, 40), min_size=1, max_size=4)
prompt = st.builds(lambda u, n, tail: tuple([2] + (u * n)[:40] + tail), unit, st.integers(2, 6),
                   st.lists(st.integers(4, 40), max_size=3))
request = st.tuples(prompt, st.integers(1, 20), st.one_of(st.none(), st.integers(0, 12)))  # abort after k steps


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(request, min_size=2, max_size=6), algorithm=st.sampled_from(["ngram", "suffix"]),
       page_size=st.sampled_from([1, 4]), k=st.integers(1, 6))
def test_verify_rollback_abort_retraction_and_prefix_hits_keep_slots_and_outputs(requests, algorithm, page_size, k):
    e = engine(page_size=page_size, speculative_algorithm=algorithm, num_speculative_tokens=k, **TIGHT)
    reqs = [Req(list(p), SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n, _ in requests]
    for r in reqs:
        e.scheduler.add(r)
    step = 0
    while not all(r.done for r in reqs):
        for r, (_, _, abort_at) in zip(reqs, requests):
            if abort_at == step and not r.done:
                e.scheduler.abort(r.rid)
        assert e.step() or all(r.done for r in reqs), "no progress with requests pending"
        step += 1
    e.scheduler.assert_idle_clean()
    events = {key: n for key, n in e.stats.translation.key_change_counts.items()
              if key[1] in NON_BENIGN_CLASSIFICATIONS and n}
    assert events == {}
    for r, (p, n, _) in zip(reqs, requests):
        if r.status == "finished":
            assert r.output_ids == alone(p, n)
        else:
            assert r.status == "aborted" and r.output_ids == alone(p, n)[:len(r.output_ids)]
