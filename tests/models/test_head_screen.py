"""The LM head screened in 4 bits and refined in 8 (`runtime/layers/head_screen.py`): near each row's top the logits
are the int8 head's to the bit, far below it the coarse copy's; rows beyond the streaming kernels' take the int8 head
alone, and switched off it serves every row."""

import pytest
import torch

from runtime import kernels
from runtime.layers.head_screen import REFINE_MARGIN, coarse_int4, screen_max_rows
from runtime.layers.quantized import Int8HeadEmbedding, set_head_screen

pytestmark = pytest.mark.skipif(not kernels.has_low_bit(), reason="the screen runs on our int4 kernel (AVX512-VNNI or AVX2)")


def _head(weight: torch.Tensor) -> Int8HeadEmbedding:
    with torch.device("cpu"):
        head = Int8HeadEmbedding(*weight.shape)
    head.load_state_dict({"weight": weight})
    return head.to(torch.bfloat16)


def _weight(vocab: int = 16 * 4096, dim: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(vocab, dim, generator=torch.Generator().manual_seed(seed)) * 0.1


def _rows(rows: int, seed: int) -> torch.Tensor:
    """Hidden states whose top logits stand ~30 above the median, as a real head's do, with the screen's error a
    fraction of the margin."""
    return torch.randn(rows, 128, generator=torch.Generator().manual_seed(seed)).bfloat16() * 6


def test_coarse_copy_rounds_each_group_to_its_own_16_levels():
    w = torch.randn(32, 64)
    q, step, low = coarse_int4(w)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    back = low.repeat_interleave(32, 1) + step.repeat_interleave(32, 1) * q
    assert float((back - w).abs().max()) <= float(step.max()) / 2 + 1e-6  # half a step at most
    groups = w.view(-1, 32)
    torch.testing.assert_close(low.view(-1), groups.amin(-1))  # the levels span each group exactly
    torch.testing.assert_close((low + 15 * step).view(-1), groups.amax(-1))


def test_coarse_copy_is_the_rounding_in_float32_operations():
    w = torch.randn(48, 96) * 0.05
    w[3, :32] = 0.25  # a constant group: step 0, every value at its low
    q, step, low = coarse_int4(w)
    groups = w.view(-1, 32)
    lo, hi = groups.amin(-1), groups.amax(-1)
    s = (hi - lo) / 15
    expected = ((groups - lo[:, None]) / torch.where(s > 0, s, 1.0)[:, None]).round().clamp(0, 15).to(torch.int32)
    assert torch.equal(q, expected.view(48, 96))
    assert torch.equal(step, s.view(48, 3)) and torch.equal(low, lo.view(48, 3))
    assert step[3, 0] == 0 and bool((q[3, :32] == 0).all())


@pytest.mark.parametrize("rows", [1, 4, 8, 16])  # a batch-1 step, decode batches
def test_logits_near_the_top_are_the_int8_heads_and_the_rest_are_screened(rows):
    head = _head(_weight(seed=rows))
    copy = head.int8
    assert copy.screen is not None and copy.screen.nbytes() < 0.75 * copy.kernel_weight.nbytes()
    x = _rows(rows, rows)
    exact = copy.kernel_weight.matmul(x, float_out=True)
    screened = copy.screen.coarse.matmul(x, float_out=True)
    error = float((screened - exact).abs().max())
    assert 0 < error < REFINE_MARGIN / 2.5
    before = copy.screen.refined_groups
    logits = copy.screen.logits(x)
    assert copy.screen.refined_groups > before
    # a token within the margin less twice the screen's error of the top is certainly refined
    near = exact >= exact.max(dim=1, keepdim=True).values - (REFINE_MARGIN - 2 * error)
    assert torch.equal(logits[near], exact[near])
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))  # the greedy token: the int8 head's
    assert torch.equal(logits, torch.where(logits == exact, exact, screened))  # every value one or the other
    assert (logits == screened).float().mean() > 0.9 and not torch.equal(logits, exact)  # most stay screened


def test_a_batch_of_rows_gets_what_each_row_gets_alone():
    """A decode batch screened (peaked rows refined by their own groups, a flat one whole) gives each row the logits a
    batch-1 step gives it: the quality measured at one row holds for every batch."""
    head = _head(_weight(seed=3))
    x = _rows(12, 3)
    x[4] *= 1e-3  # a flat row: every logit within the margin of its top
    batch = head.int8.screen.logits(x)
    alone = torch.cat([head.int8.screen.logits(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(batch, alone)
    assert torch.equal(batch[4], head.int8.kernel_weight.matmul(x[4:5], float_out=True)[0])


def test_the_head_screens_its_rows_up_to_the_limit_and_not_when_switched_off():
    model_like = type("M", (), {})()
    head = _head(_weight(seed=9))
    model_like.lm_head, model_like.model = None, type("Inner", (), {"embed_tokens": head})()
    limit = screen_max_rows()
    x = _rows(limit + 1, 9)
    int8 = head.int8.kernel_weight
    with torch.no_grad():
        assert torch.equal(head.logits(x), int8.matmul(x, float_out=True))  # more rows: the int8 head alone
        screened = head.logits(x[:limit])
        assert torch.equal(screened, head.int8.screen.logits(x[:limit]))
        assert not torch.equal(screened, int8.matmul(x[:limit], float_out=True))
        assert set_head_screen(model_like, True)
        assert not set_head_screen(model_like, False) and head.int8.screen is None
        plain = head.logits(x[:limit])
    assert torch.equal(plain, int8.matmul(x[:limit], float_out=True))
