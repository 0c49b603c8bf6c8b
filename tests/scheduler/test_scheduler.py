"""Scheduler on the tiny model: pool pressure, host offload and load-back, recompute, rejection, abort."""

import pytest
import torch

from runtime.config import EngineConfig
from runtime.core import Req, RequestError
from runtime.engine import Engine
from runtime.core import SamplingParams
from runtime.models.config import Gemma3Config
from runtime.models.loader import build_model, random_state_dict
from runtime.models.tokenizer import ByteTokenizer
from telemetry.names import NON_BENIGN_CLASSIFICATIONS

CONFIG = Gemma3Config.tiny(sliding_window=8)
STATE = random_state_dict(CONFIG, seed=3)
GEN = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(4, 260, (n,), generator=GEN).tolist() for n in (5, 14, 23, 9, 30, 17)]
PARAMS = SamplingParams(max_new_tokens=20, ignore_eos=True)


def engine(**cfg):
    base = dict(model="tiny", max_total_tokens=1024, swa_full_tokens_ratio=0.5, chunked_prefill_size=16,
                max_running_requests=8, graph_batch_sizes=(1, 2, 4, 8))
    base.update(cfg)
    return Engine(EngineConfig(**base), model=build_model(CONFIG, STATE, torch.float32), tokenizer=ByteTokenizer())


@pytest.fixture(scope="module")
def reference():
    """Each prompt alone in a roomy engine."""
    e = engine()
    return [e.generate([p], PARAMS)[0] for p in PROMPTS]


def bad_events(e):
    return {k: v for k, v in e.stats.translation.key_change_counts.items() if v and k[1] in NON_BENIGN_CLASSIFICATIONS}


def test_batched_requests_match_requests_run_alone(reference):
    e = engine()
    assert e.generate(PROMPTS, PARAMS) == reference
    e.scheduler.assert_idle_clean()
    assert e.stats.swa_evicted_tokens > 0 and bad_events(e) == {}


@pytest.mark.parametrize("policy", ["memo", "layerwise"])
def test_a_pool_too_small_for_the_batch_offloads_to_host_and_loads_back_with_identical_outputs(reference, policy):
    # 6 requests of up to 50 tokens cannot all stay: the full pool holds 96 tokens.
    e = engine(max_total_tokens=96, swa_full_tokens_ratio=0.5, hicache_size=4096, loc_cache=policy)
    assert e.generate(PROMPTS, PARAMS) == reference
    s = e.stats
    assert s.hicache_offloads > 0 and s.hicache_loadbacks == s.hicache_offloads
    t = s.translation
    assert t.invalidation_counts["register_mapping"] == s.hicache_loadbacks  # one rebuild per load-back
    assert e.pool.allocator.mapping_generation == s.hicache_loadbacks
    assert bad_events(e) == {}
    e.scheduler.assert_idle_clean()


def test_without_a_host_tier_retracted_requests_are_recomputed_with_identical_outputs(reference):
    e = engine(max_total_tokens=96, swa_full_tokens_ratio=0.5, hicache_size=0)
    assert e.generate(PROMPTS, PARAMS) == reference
    assert e.stats.hicache_offloads == 0
    assert e.stats.request_counts["finished"] == len(PROMPTS)
    e.scheduler.assert_idle_clean()


def test_a_request_that_can_never_fit_is_rejected_with_a_message_and_nothing_leaks():
    e = engine(max_total_tokens=64, swa_full_tokens_ratio=0.5)
    with pytest.raises(RequestError, match="full pool holds 64"):
        e.generate([list(range(4, 54))], PARAMS)
    with pytest.raises(RequestError, match="empty prompt"):
        e.scheduler.add(Req([], PARAMS))
    with pytest.raises(RequestError, match="token ids"):
        e.scheduler.add(Req([5, 999], PARAMS))
    assert e.stats.request_counts["rejected"] == 2  # add() records; generate() validates before adding
    e.scheduler.assert_idle_clean()


def test_abort_mid_generation_frees_every_slot():
    e = engine()
    reqs = [Req(p, PARAMS) for p in PROMPTS[:3]]
    for r in reqs:
        e.scheduler.add(r)
    for _ in range(6):
        e.step()
    assert e.scheduler.abort(reqs[1].rid) and reqs[1].status == "aborted"
    assert not e.scheduler.abort(reqs[1].rid)  # twice: no-op
    while e.step():
        pass
    assert [r.status for r in reqs] == ["finished", "aborted", "finished"]
    assert e.stats.request_counts == {"finished": 2, "aborted": 1, "rejected": 0, "refused": 0, "error": 0,
                                      "other": 0}
    e.scheduler.assert_idle_clean()
