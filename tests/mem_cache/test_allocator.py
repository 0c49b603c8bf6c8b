import pytest
import torch

from runtime.mem_cache.allocator import AllocationError, PagedAllocator


def test_token_allocator_hands_out_every_usable_slot_once_and_refuses_more():
    a = PagedAllocator(8, page_size=1)
    got = a.alloc(8)
    assert sorted(got.tolist()) == list(range(1, 9))  # slot 0 is the reserved sink
    assert a.alloc(1) is None
    assert a.available_size() == 0


def test_double_free_raises_and_changes_nothing():
    a = PagedAllocator(8, page_size=1)
    locs = a.alloc(3)
    a.free(locs[:2])
    before = (list(a._free_pages), bytes(a._held))
    with pytest.raises(AllocationError, match="double free"):
        a.free(locs)  # locs[2] is held, locs[0:2] are not: nothing may be released
    assert (list(a._free_pages), bytes(a._held)) == before
    assert a.available_size() == 7


@pytest.mark.parametrize("bad, exc", [
    (torch.tensor([0]), IndexError),          # the reserved slot
    (torch.tensor([9]), IndexError),          # past the end
    (torch.tensor([-1]), IndexError),
    (torch.tensor([1.0]), TypeError),         # wrong dtype
    ([1, 2], TypeError),                      # not a tensor
])
def test_free_rejects_bad_locations(bad, exc):
    a = PagedAllocator(8, page_size=1)
    a.alloc(8)
    with pytest.raises(exc):
        a.free(bad)
    assert a.available_size() == 0


def test_paged_extend_fills_the_partial_page_then_takes_new_pages():
    a = PagedAllocator(16, page_size=4)  # pages 1..4, slots 4..19
    first = a.alloc_extend([0], [3], [-1])
    assert first.tolist() == [4, 5, 6]
    more = a.alloc_extend([3], [9], [6])  # slot 7 finishes page 1, then a page for positions 4..7, then one
    assert more.tolist() == [7, 8, 9, 10, 11, 12]
    dec = a.alloc_decode([10], [12])
    assert dec.tolist() == [13]
    assert a.available_size() == 4


def test_paged_extend_that_does_not_fit_takes_nothing():
    a = PagedAllocator(8, page_size=4)
    assert a.alloc_extend([0, 0], [4, 5], [-1, -1]) is None  # needs 3 pages, has 2
    assert a.available_size() == 8


def test_paged_alloc_rejects_a_partial_page_request():
    with pytest.raises(ValueError, match="multiple of page_size"):
        PagedAllocator(8, page_size=4).alloc(3)


def test_pool_size_must_be_whole_pages():
    with pytest.raises(ValueError):
        PagedAllocator(10, page_size=4)
