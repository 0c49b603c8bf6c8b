"""A multi-turn chat workload through `Engine.generate` on the tiny model, with the prefix cache on and off.

Every turn resends the whole conversation plus a new user message; conversations grow far past the sliding
window, and there are more of them than the pools hold, so the cache must evict (to the host tier when it has
one) and later turns must match, load back, and reuse. Outputs must be token-identical to the uncached run,
the sampled logits equal within float tolerance, no non-benign translation event may occur, and the hit rate
must be positive."""

import pytest
import torch

from runtime.config import EngineConfig
from runtime.core import SamplingParams
from runtime.engine import Engine
from runtime.models.config import Gemma3Config
from runtime.models.loader import build_model, random_state_dict
from runtime.models.tokenizer import ByteTokenizer
from telemetry.names import NON_BENIGN_CLASSIFICATIONS

CONFIG = Gemma3Config.tiny(sliding_window=8)
STATE = random_state_dict(CONFIG, seed=5)
CHATS, TURNS = 6, 4
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


def engine(**cfg):
    base = dict(model="tiny", max_total_tokens=160, swa_full_tokens_ratio=0.5, chunked_prefill_size=16,
                max_running_requests=4, graph_batch_sizes=(1, 2, 4))
    base.update(cfg)
    return Engine(EngineConfig(**base), model=build_model(CONFIG, STATE, torch.float32), tokenizer=ByteTokenizer())


def chat(e: Engine) -> tuple[list[list[int]], list[torch.Tensor]]:
    """CHATS conversations, TURNS turns each, all conversations of a turn in one batch; the outputs and the
    logits each token was sampled from, turn by turn."""
    gen = torch.Generator().manual_seed(11)
    history = [torch.randint(4, 260, (12,), generator=gen).tolist() for _ in range(CHATS)]
    outputs, logits = [], []
    for _ in range(TURNS):
        turn_logits: list[torch.Tensor] = []
        answers = e.generate(history, PARAMS, logits_out=turn_logits)
        outputs += answers
        logits += turn_logits
        history = [h + a + torch.randint(4, 260, (5,), generator=gen).tolist() for h, a in zip(history, answers)]
    assert max(len(h) for h in history) > 3 * CONFIG.sliding_window
    return outputs, logits


@pytest.fixture(scope="module")
def uncached():
    e = engine(disable_prefix_caching=True)
    out = chat(e)
    assert e.slots.tree is None and e.stats.prefix_cache.queried_tokens == 0
    return out


def bad_events(e):
    return {k: v for k, v in e.stats.translation.key_change_counts.items() if v and k[1] in NON_BENIGN_CLASSIFICATIONS}


@pytest.mark.parametrize("policy, hicache, page_size", [("memo", 0, 1), ("memo", 4096, 1), ("memo", 0, 4),
                                                       ("layerwise", 4096, 4)])
def test_multi_turn_chat_is_token_identical_with_the_cache_on_and_hits(uncached, policy, hicache, page_size):
    e = engine(loc_cache=policy, hicache_size=hicache, page_size=page_size)
    tokens, logits = chat(e)
    if page_size == 1:  # the uncached reference ran with page_size 1: same tokens whatever the page size
        ref_tokens, ref_logits = uncached
        assert tokens == ref_tokens
        for mine, ref in zip(logits, ref_logits):
            torch.testing.assert_close(mine, ref, rtol=0, atol=1e-4)
    else:
        assert tokens == uncached[0]
    assert bad_events(e) == {}
    pc, tree = e.stats.prefix_cache, e.slots.tree
    assert pc.hit_tokens > 0.2 * pc.queried_tokens  # later turns reuse much of their conversation
    assert tree.evictions > 0  # more conversations than the pools hold
    if hicache:
        assert tree.loadbacks > 0 and e.stats.translation.invalidation_counts["prefix_loadback"] > 0
    e.scheduler.assert_idle_clean()
    e.slots.clear_prefix_cache()
    assert e.pool.allocator.full.used_size() == 0 and e.slots.host.used == 0
