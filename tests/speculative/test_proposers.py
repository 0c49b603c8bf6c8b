"""Draft proposers: prompt lookup and the suffix table, on token lists whose right answers are plain to see."""

import pytest

from runtime.speculative.ngram import NgramIndex
from runtime.speculative.suffix import SuffixProposer, SuffixTable


def ngram(tokens, k=3, min_n=1, max_n=3):
    index = NgramIndex(k, min_n, max_n)
    index.extend(tokens)
    return index


def test_prompt_lookup_copies_what_followed_the_latest_earlier_occurrence():
    #          0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 8, 9, 5, 6, 1, 5, 6]
    # the suffix (5, 6) occurred before ending at 2 and at 7; the latest earlier one (7) is followed by 5, 6
    assert ngram(tokens).propose() == [1, 5, 6]
    assert ngram(tokens, k=1).propose() == [1]


def test_the_longest_matching_suffix_wins_over_a_shorter_more_recent_one():
    tokens = [1, 2, 3, 40, 41, 9, 3, 50, 2, 3]  # (2, 3) occurred at 1..2; (3) alone more recently at 6
    assert ngram(tokens, max_n=2).propose() == [40, 41, 9]
    assert ngram(tokens, max_n=1).propose() == [50, 2, 3]


def test_nothing_is_proposed_without_an_earlier_occurrence_or_below_min_n():
    assert ngram([1, 2, 3, 4]).propose() == []
    assert ngram([7]).propose() == []
    assert ngram([1, 2, 9, 2], min_n=2).propose() == []  # only a 1-gram repeats
    assert ngram([1, 2, 9, 2], min_n=1).propose() == [9, 2]


def test_the_index_grows_token_by_token_like_a_decode():
    index = NgramIndex(4, 1, 4)
    text = [3, 1, 4, 1, 5, 9, 2, 6]
    index.extend(text)
    index.extend([3, 1, 4])  # the text starts again
    assert index.propose() == [1, 5, 9, 2]
    index.extend([1, 5])
    assert index.propose() == [9, 2, 6, 3]


def test_bad_bounds_are_refused():
    for k, lo, hi in ((0, 1, 2), (2, 0, 2), (2, 3, 2)):
        with pytest.raises(ValueError):
            NgramIndex(k, lo, hi)


def test_the_suffix_table_follows_the_most_frequent_continuation_of_the_longest_context():
    table = SuffixTable(max_depth=3)
    table.learn([1, 2, 3, 1, 2, 3, 1, 2, 4])  # after (1, 2): 3 twice, 4 once
    assert table.propose([9, 1, 2], 4) == [3, 1, 2, 3]
    table.learn([7, 1, 2, 4, 7, 1, 2, 4])  # (7, 1, 2) is followed by 4: the longer context decides
    assert table.propose([7, 1, 2], 1) == [4]
    assert table.propose([8], 3) == []


def test_the_suffix_table_forgets_the_least_recently_updated_contexts_beyond_its_bound():
    table = SuffixTable(max_depth=2, max_contexts=10)
    table.learn(list(range(100)))
    assert len(table) == 10
    assert table.propose([98], 1) == [99] and table.propose([3], 1) == []


def test_a_suffix_proposer_learns_from_earlier_outputs():
    shared = SuffixTable(max_depth=4)
    first = SuffixProposer(shared, 3)
    first.extend([10, 11])
    assert first.propose() == []
    first.finish([20, 21, 22, 23, 24])
    second = SuffixProposer(shared, 3)
    second.extend([30, 20, 21])
    assert second.propose() == [22, 23, 24]
    second.extend([99, 30])  # its own history comes first: 30 was followed by 20 in this request
    assert second.propose() == [20, 21, 99]
