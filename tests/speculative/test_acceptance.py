"""Acceptance: greedy keeps exactly what one-token decoding gives; speculative sampling keeps the target's
distribution whatever the draft (checked by sampling against the exact distribution)."""

import pytest
import torch

from runtime.speculative.acceptance import accept_greedy, accept_sampling


def test_greedy_keeps_the_agreed_prefix_and_adds_the_target_token():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_greedy([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert accept_greedy([], [4]) == [4]
    with pytest.raises(ValueError):
        accept_greedy([5, 6], [5, 6])


def _empirical(draft, probs, trials, seed=0):
    """Frequencies of the first and second emitted tokens (the second where one was emitted)."""
    gen = torch.Generator().manual_seed(seed)
    V = probs.shape[1]
    first, second, second_n, lengths = torch.zeros(V), torch.zeros(V), 0, []
    for _ in range(trials):
        out = accept_sampling(draft, probs, gen)
        lengths.append(len(out))
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
            second_n += 1
    return first / trials, second / max(second_n, 1), lengths


def test_speculative_sampling_emits_the_target_distribution_whatever_the_draft():
    torch.manual_seed(0)
    V, trials = 6, 20000
    probs = torch.softmax(torch.randn(3, V) * 1.5, dim=-1)  # k = 2
    for draft in ([0, 1], [int(probs[0].argmax()), int(probs[1].argmax())], [5, 5]):
        first, second, lengths = _empirical(draft, probs, trials)
        # sampling error of a frequency over 20000 trials is below 0.004; a rule that kept every draft token
        # (or always resampled) would be off by tenths
        assert (first - probs[0]).abs().max() < 0.015, (draft, first, probs[0])
        assert min(lengths) >= 1 and max(lengths) <= 3
    # the second token, given the first draft token was kept, follows p_1 (check on a draft of the argmax)
    draft = [int(probs[0].argmax()), 2]
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(V)
    n = 0
    for _ in range(trials):
        out = accept_sampling(draft, probs, gen)
        if out[0] == draft[0] and len(out) > 1:
            counts[out[1]] += 1
            n += 1
    assert n > 1000 and ((counts / n) - probs[1]).abs().max() < 0.03


def test_a_certain_target_keeps_a_matching_draft_and_replaces_a_wrong_one():
    probs = torch.zeros(3, 4)
    probs[0, 1] = probs[1, 2] = probs[2, 3] = 1.0
    gen = torch.Generator().manual_seed(0)
    assert accept_sampling([1, 2], probs, gen) == [1, 2, 3]
    assert accept_sampling([1, 0], probs, gen) == [1, 2]
    with pytest.raises(ValueError):
        accept_sampling([1], probs, gen)
