"""The KV sanitizer's one-call write check (`writes_owned`, runtime/kernels/ledger.cpp) against the rules it
stands for (docs/kv-sanitizer.md), written out here per token: it may only say "in order" where every write is.

A full slot is in order when its owner is the token's table row at the token's position, or, for a padded token
(row 0), when it is the sink, slot 0; a SWA slot when it is a real slot (> 0) owned by the token's full slot, or
the sink for padding. Anything it cannot be sure of (an index out of range, a negative one, a slot to claim) is
not in order: the torch checks then decide and report.
"""

from __future__ import annotations

import random

import pytest
import torch

from runtime import kernels
from runtime.mem_cache.ownership import FREE, TREE, UNCLAIMED


@pytest.fixture(scope="module")
def K():
    module = kernels.load()
    assert module is not None, f"the fused CPU kernels did not build: {kernels.failure()}"
    return module


def in_order(owner, at_pos, swa_owner, loc, swa, rows, pos, full):
    """The rules, token by token."""
    for i, (row, s) in enumerate(zip(rows, loc)):
        if full and not (0 <= s < len(owner)):
            return False
        if full and (s != 0 if row == 0 else (owner[s] != row or at_pos[s] != pos[i])):
            return False
        if swa is not None:
            w = swa[i]
            if not 0 <= w < len(swa_owner):
                return False
            if w != 0 if row == 0 else (w == 0 or swa_owner[w] != s):
                return False
    return True


def ledger_case(rng: random.Random, tokens: int):
    """A ledger of 64 full and 32 SWA slots in which `tokens` new tokens own their slots, then one slip of a
    random kind (or none)."""
    owner = [rng.choice((FREE, TREE, UNCLAIMED, 7)) for _ in range(64)]
    at_pos = [rng.randrange(-1, 50) for _ in range(64)]
    swa_owner = [rng.choice((FREE, UNCLAIMED, 3)) for _ in range(32)]
    free_full, free_swa = rng.sample(range(1, 64), tokens), rng.sample(range(1, 32), tokens)
    rows, pos, loc, swa = [], [], [], []
    for t in range(tokens):
        if rng.random() < 0.2:  # a padded entry: the sinks
            rows.append(0), pos.append(rng.randrange(50)), loc.append(0), swa.append(0)
            continue
        row, p, s, w = rng.randrange(1, 9), rng.randrange(50), free_full[t], free_swa[t]
        owner[s], at_pos[s], swa_owner[w] = row, p, s
        rows.append(row), pos.append(p), loc.append(s), swa.append(w)
    slip = rng.choice(("none", "owner", "pos", "pad", "swa_owner", "swa_sink", "range", "negative", "unclaimed"))
    i = rng.randrange(tokens)
    if slip == "owner" and rows[i]:
        owner[loc[i]] = rows[i] + 1
    elif slip == "pos" and rows[i]:
        at_pos[loc[i]] = pos[i] + 1
    elif slip == "pad" and not rows[i]:
        loc[i] = rng.randrange(1, 64)
    elif slip == "swa_owner" and rows[i]:
        swa_owner[swa[i]] = loc[i] + 1
    elif slip == "swa_sink" and rows[i]:
        swa[i] = 0
    elif slip == "range":
        loc[i] = 64 + rng.randrange(3)
    elif slip == "negative":
        loc[i] = -1
    elif slip == "unclaimed" and rows[i]:
        owner[loc[i]] = UNCLAIMED
    return owner, at_pos, swa_owner, loc, swa, rows, pos


@pytest.mark.parametrize("seed", range(4))
def test_writes_owned_says_in_order_exactly_where_the_rules_do(K, seed):
    rng = random.Random(seed)
    verdicts = {True: 0, False: 0}
    for _ in range(300):
        owner, at_pos, swa_owner, loc, swa, rows, pos = ledger_case(rng, rng.randrange(1, 9))
        full, with_swa = rng.random() < 0.8, rng.random() < 0.7
        dtype = rng.choice((torch.int64, torch.int32))
        expected = in_order(owner, at_pos, swa_owner, loc, swa if with_swa else None, rows, pos, full)
        got = K.writes_owned(torch.tensor(owner), torch.tensor(at_pos), torch.tensor(loc, dtype=dtype),
                             torch.tensor(rows), torch.tensor(pos), torch.tensor(swa_owner),
                             torch.tensor(swa, dtype=dtype) if with_swa else None, full)
        assert got == expected, (owner, at_pos, swa_owner, loc, swa, rows, pos, full, with_swa)
        verdicts[got] += 1
    assert verdicts[True] > 50 and verdicts[False] > 50  # both outcomes were exercised


def test_writes_owned_leaves_what_it_cannot_read_to_the_torch_checks(K):
    owner, at_pos, rows, pos = torch.tensor([0, 5]), torch.tensor([-1, 3]), torch.tensor([5]), torch.tensor([3])
    loc = torch.tensor([1])
    assert K.writes_owned(owner, at_pos, loc, rows, pos, None, None, True)
    assert not K.writes_owned(owner.int(), at_pos, loc, rows, pos, None, None, True)  # not the ledger's int64
    assert not K.writes_owned(owner, at_pos, torch.tensor([1, 1]), rows, pos, None, None, True)  # T differs
    assert not K.writes_owned(owner, at_pos, loc.float(), rows, pos, None, None, True)
    assert not K.writes_owned(owner, at_pos, loc, rows, pos, None, torch.tensor([1]), True)  # no SWA ledger
