"""Speculative decoding through the engine: greedy outputs token-identical to speculation off (float32), across
page sizes, the prefix cache, retraction to the host tier and token budgets, with every slot given back."""

import pytest
import torch

from runtime.config import EngineConfig
from runtime.core import SamplingParams
from runtime.engine import Engine
from runtime.models.config import Gemma3Config
from runtime.models.loader import build_model, random_state_dict
from runtime.models.tokenizer import ByteTokenizer

CONFIG = Gemma3Config.tiny()
STATE = random_state_dict(CONFIG, seed=0)
# repetitive prompts (something to copy) and one with nothing repeated
PROMPTS = [[2] + [10, 11, 12, 13, 14, 15] * 6, [2] + list(range(40, 60)) * 2, [2, 5, 6, 7, 8, 9, 5, 6, 7],
           [2] + [(i * 37) % 250 + 4 for i in range(30)]]


def engine(**overrides) -> Engine:
    cfg = dict(model="tiny", dtype="float32", quantization="none", max_total_tokens=4096, swa_full_tokens_ratio=0.25,
               max_running_requests=8, chunked_prefill_size=64, graph_batch_sizes=(1, 2, 4))
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg), progress=False, model=build_model(CONFIG, STATE, torch.float32),
                  tokenizer=ByteTokenizer())


def run(prompts, params, **overrides):
    e = engine(**overrides)
    out = e.generate(prompts, params)
    e.scheduler.assert_idle_clean()
    return out, e


@pytest.mark.parametrize("algorithm", ["ngram", "suffix"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_outputs_equal_speculation_off(algorithm, page_size):
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain, _ = run(PROMPTS, params, page_size=page_size)
    spec, e = run(PROMPTS, params, page_size=page_size, speculative_algorithm=algorithm, num_speculative_tokens=4)
    assert spec == plain
    s = e.stats.spec
    assert s.accepted_tokens[algorithm] > 0 and s.draft_tokens[algorithm] >= s.accepted_tokens[algorithm]
    assert e.stats.forward_counts["target_verify"] > 0
    # a verify emits more than one token on average here: fewer forwards than generated tokens
    decode_like = sum(e.stats.forward_counts[m] for m in ("graph_replay", "eager_decode", "target_verify"))
    assert decode_like < sum(len(o) for o in spec) - len(PROMPTS)
    assert e.stats.translation.invalidation_counts["spec_rollback"] > 0  # rejected drafts were rolled back


def test_pool_pressure_retraction_and_the_prefix_cache_keep_outputs_and_slots():
    """Pools too small for every request at once: decode retracts to the host tier and loads back, finished
    requests' KV goes to the prefix cache, a second round hits it; outputs equal speculation off."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    tight = dict(max_total_tokens=256, swa_full_tokens_ratio=0.5, hicache_size=4096, chunked_prefill_size=32)
    prompts = PROMPTS + [p[:-3] for p in PROMPTS]
    plain, base = run(prompts, params, **tight)
    spec, e = run(prompts, params, speculative_algorithm="ngram", **tight)
    assert spec == plain
    assert e.stats.hicache_offloads > 0 and e.stats.hicache_loadbacks > 0  # pressure really happened
    turn2 = [p + o for p, o in zip(prompts[:2], spec[:2])]  # a conversation goes on: its prefix is cached
    assert e.generate(turn2, params) == base.generate(turn2, params)
    assert e.stats.prefix_cache.hit_tokens > 0
    e.scheduler.assert_idle_clean()


@pytest.mark.parametrize("max_new", [1, 2, 3, 7])
def test_a_token_budget_cuts_the_accepted_tokens(max_new):
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    plain, _ = run(PROMPTS, params)
    spec, _ = run(PROMPTS, params, speculative_algorithm="ngram", num_speculative_tokens=8)
    assert spec == plain and all(len(o) == max_new for o in spec)


def test_a_stop_token_inside_an_accepted_draft_ends_the_request_there():
    params = SamplingParams(max_new_tokens=40)
    free, _ = run(PROMPTS[:1], SamplingParams(max_new_tokens=40, ignore_eos=True))
    stop = free[0][12]  # a token the request generates, inside a run the drafter copies
    outs = []
    for overrides in ({}, {"speculative_algorithm": "ngram", "num_speculative_tokens": 8}):
        e = engine(**overrides)
        e.scheduler.eos_ids = {stop}
        outs.append(e.generate(PROMPTS[:1], params))
        e.scheduler.assert_idle_clean()
    assert outs[0] == outs[1] and outs[0][0][-1] == stop and stop not in outs[0][0][:-1]


def test_sampled_requests_speculate_and_give_every_slot_back():
    params = SamplingParams(max_new_tokens=32, temperature=0.8, top_k=20, ignore_eos=True)
    out, e = run(PROMPTS, params, speculative_algorithm="ngram")
    assert all(len(o) == 32 for o in out)
    assert e.stats.spec.draft_tokens["ngram"] > 0


def test_drafts_back_off_where_nothing_is_accepted():
    """A drafter whose guesses the model never takes: after each fully rejected draft the request waits
    twice as long before drafting again, so most steps are plain decode steps."""
    from runtime.speculative import speculator

    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    plain, _ = run(PROMPTS[:1], params)
    e = engine(speculative_algorithm="ngram")
    original = speculator.Speculator.draft

    def wrong(self, req, limit):  # the real drafter's bookkeeping, then a guess nobody makes
        real = original(self, req, limit)
        return tuple(259 - t for t in real) if real else ()

    e.scheduler.speculator.draft = wrong.__get__(e.scheduler.speculator)
    assert e.generate(PROMPTS[:1], params) == plain
    s = e.stats.spec
    assert s.accepted_tokens["ngram"] == 0 and 0 < e.stats.forward_counts["target_verify"] <= 8
    e.scheduler.assert_idle_clean()


@pytest.mark.parametrize("algorithm", ["ngram", "suffix"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_the_strict_kv_sanitizer_sees_no_foreign_or_freed_slot(algorithm, page_size):
    """Verify, rollback (inside and across pages), retraction to the host tier and prefix hits, every KV write
    and attention read checked against the ownership ledger: no violation, no other bug-class event."""
    from telemetry.names import NON_BENIGN_CLASSIFICATIONS

    tight = dict(max_total_tokens=256, swa_full_tokens_ratio=0.5, hicache_size=4096, chunked_prefill_size=32)
    e = engine(page_size=page_size, speculative_algorithm=algorithm, kv_sanitizer="strict", **tight)
    e.generate(PROMPTS + [p[:-3] for p in PROMPTS], SamplingParams(max_new_tokens=24, ignore_eos=True))
    e.scheduler.assert_idle_clean()
    assert e.stats.forward_counts["target_verify"] > 0 and e.stats.hicache_offloads > 0
    assert e.runner.verify_graphs.path_counts["verify_replay_padded"] > 0  # padded tails write only the sink
    assert e.stats.translation.invalidation_counts["spec_rollback"] > 0
    events = {k: n for k, n in e.stats.translation.key_change_counts.items() if n and k[1] in NON_BENIGN_CLASSIFICATIONS}
    assert events == {}
