import pytest
import torch

from runtime.mem_cache.allocator import AllocationError
from runtime.mem_cache.hybrid import HybridAllocator


def snapshot(h: HybridAllocator):
    return (list(h.full._free_pages), list(h.swa._free_pages), h.full_to_swa_index_mapping.clone())


def same(a, b):
    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_alloc_maps_each_full_slot_to_a_distinct_swa_slot_and_sentinel_maps_minus_one():
    h = HybridAllocator(16, 8)
    full = h.alloc_extend([0], [5], [-1])
    swa = h.full_to_swa_index_mapping[full]
    assert len(set(swa.tolist())) == 5 and int(swa.min()) >= 1
    assert int(h.full_to_swa_index_mapping[torch.tensor([-1])]) == -1
    assert h.available_size() == 3  # min(full 11, swa 3)


def test_failed_alloc_leaves_both_pools_and_mapping_untouched():
    h = HybridAllocator(16, 4)
    h.alloc(2)
    before = snapshot(h)
    assert h.alloc_extend([0], [3], [-1]) is None  # full has room, SWA does not
    assert h.alloc(3) is None
    assert same(snapshot(h), before)


def test_free_releases_both_sides_and_double_free_is_an_error_with_no_effect():
    h = HybridAllocator(16, 8)
    a = h.alloc(3)
    b = h.alloc(2)
    h.free(a)
    assert h.full.available_size() == 14 and h.swa.available_size() == 6
    assert int(h.full_to_swa_index_mapping[a].abs().sum()) == 0
    before = snapshot(h)
    with pytest.raises(AllocationError, match="double free"):
        h.free(torch.cat([b, a]))
    assert same(snapshot(h), before)


def test_free_swa_is_page_rounded_and_keeps_full_slots():
    h = HybridAllocator(32, 16, page_size=4)
    full = h.alloc_extend([0], [10], [-1])  # positions 0..9 on 3 pages
    freed = h.free_swa(full[:6])  # positions 0..5: only page 0..3 is wholly out of the window
    assert freed == 4
    m = h.full_to_swa_index_mapping[full]
    assert (m[:4] == 0).all() and (m[4:] > 0).all()
    assert h.swa.available_size() == 16 - 12 + 4
    assert h.full.available_size() == 32 - 12
    h.free(full)  # tokens whose SWA side already left are freed once, on the full side
    assert h.full.available_size() == 32 and h.swa.available_size() == 16


def test_extend_continues_the_swa_page_of_the_last_token():
    h = HybridAllocator(32, 16, page_size=4)
    first = h.alloc_extend([0], [2], [-1])
    more = h.alloc_extend([2], [4], [int(first[-1])])
    swa = h.full_to_swa_index_mapping[torch.cat([first, more])]
    assert swa.tolist() == list(range(int(swa[0]), int(swa[0]) + 4))  # one SWA page, in position order


@pytest.mark.parametrize("bad, exc, msg", [
    (torch.zeros(5, dtype=torch.int64), ValueError, "shape"),
    (torch.zeros(18, dtype=torch.int32), TypeError, "int64"),
    (torch.zeros(18, dtype=torch.int64), ValueError, "sentinel"),
])
def test_register_mapping_rejects_bad_tensors(bad, exc, msg):
    h = HybridAllocator(16, 8)
    before = h.full_to_swa_index_mapping
    with pytest.raises(exc, match=msg):
        h.register_mapping(bad)
    assert h.full_to_swa_index_mapping is before and h.mapping_generation == 0


def test_set_mapping_checks_shapes_and_ranges():
    h = HybridAllocator(16, 8)
    with pytest.raises(ValueError, match="shapes differ"):
        h.set_full_to_swa_mapping(torch.tensor([1, 2]), torch.tensor([1]))
    with pytest.raises(IndexError):
        h.set_full_to_swa_mapping(torch.tensor([1]), torch.tensor([9]))
    assert int(h.full_to_swa_index_mapping[:-1].abs().sum()) == 0


def test_clear_returns_everything():
    h = HybridAllocator(16, 8)
    h.alloc(5)
    h.clear()
    assert h.full.available_size() == 16 and h.swa.available_size() == 8
    assert int(h.full_to_swa_index_mapping[:-1].abs().sum()) == 0 and int(h.full_to_swa_index_mapping[-1]) == -1
