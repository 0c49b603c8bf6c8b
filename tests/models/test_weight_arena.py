"""Decode copies placed in one arena of 2 MB pages: the same products to the bit, read from the arena itself, laid
out in read order at 64-byte lines; a bad arena or offset refused; what smaps says read right."""

import pytest
import torch

from runtime import kernels
from runtime.layers.decode_linear import DecodeLinear
from runtime.layers.quantized import set_head_screen
from runtime.layers.weight_arena import (HUGE_PAGE, HUGE_PAGE_SHARE, decode_projections, huge_page_bytes,
                                         place_decode_weights)
from runtime.models.config import Gemma3Config
from runtime.memory_bound import read_buffer
from runtime.models.loader import build_model, random_state_dict

needs_low_bit = pytest.mark.skipif(not kernels.has_low_bit(), reason="our low-bit kernels need AVX512-VNNI or AVX2")


def _projections():
    """One copy of each format, small, with their float inputs."""
    K = kernels.load()
    gen = torch.Generator().manual_seed(0)
    q8 = torch.randint(-127, 128, (48, 256), dtype=torch.int8, generator=gen)
    q4 = torch.randint(0, 16, (48, 256), dtype=torch.int32, generator=gen)
    step, low = torch.rand(48, 8, generator=gen) * 0.01, torch.randn(48, 8, generator=gen) * 0.05
    return {
        "int8": K.Projection.int8(q8, torch.rand(48, generator=gen) * 0.01),
        "int8-block": K.Projection.int8(q8, (torch.rand(48, 8, generator=gen) * 0.01).half().float()),
        "int4": K.Projection.int4(q4, step, low),
        "int4-half": K.Projection.int4(q4, step, low, half_scales=True),
        "int8-wide": K.Projection.int8_wide(q8, torch.rand(48, 2, generator=gen) * 0.01,
                                            torch.rand(256, generator=gen) + 0.5),
    }


@needs_low_bit
def test_placed_copies_multiply_the_same_to_the_bit_and_read_from_the_arena():
    K = kernels.load()
    projections = _projections()
    x = torch.randn(3, 256).bfloat16()
    before = {name: [p.matmul(x[:1]), p.matmul(x)] for name, p in projections.items()}
    total = sum(p.placed_bytes for p in projections.values())
    arena = K.weight_arena(total, True)
    assert arena.data_ptr() % HUGE_PAGE == 0 and arena.numel() == HUGE_PAGE  # rounded up to whole 2 MB pages
    offset = 0
    for name, p in projections.items():
        assert p.format == name
        end = p.place(arena, offset, True)
        assert end % 64 == 0 and end - offset == p.placed_bytes
        assert p.huge_pages
        offset = end
        assert torch.equal(p.matmul(x[:1]), before[name][0]) and torch.equal(p.matmul(x), before[name][1])
    assert offset == total
    arena.zero_()  # the weights and scales now read as zero: every product is 0 if they are read from here
    for p in projections.values():
        assert not p.matmul(x).float().abs().max() > 0


@needs_low_bit
def test_a_bad_arena_or_offset_is_refused():
    K = kernels.load()
    p = _projections()["int8-block"]
    x = torch.randn(1, 256).bfloat16()
    expected = p.matmul(x)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        p.place(K.weight_arena(p.placed_bytes, False), 32, False)
    with pytest.raises(RuntimeError, match="holds"):
        p.place(K.weight_arena(p.placed_bytes, False), HUGE_PAGE - 64, False)
    with pytest.raises(RuntimeError, match="uint8"):
        p.place(torch.zeros(HUGE_PAGE // 4), 0, False)
    with pytest.raises(RuntimeError, match="bytes"):
        K.weight_arena(0, True)
    assert torch.equal(p.matmul(x), expected)


@needs_low_bit
def test_a_long_weight_in_huge_pages_streams_differently_to_the_same_sums():
    """Past 16 MB packed, a weight placed in 2 MB pages reads as one stream a thread on Zen 4 (quant_kernels.cpp):
    the same groups and blocks in the same order within each sum, so the same values to the bit."""
    K = kernels.load()
    gen = torch.Generator().manual_seed(1)
    N, Kd = 32768, 1024  # 16 MB of 4-bit values
    p = K.Projection.int4(torch.randint(0, 16, (N, Kd), dtype=torch.uint8, generator=gen),
                          torch.rand(N, Kd // 32, generator=gen) * 0.01, torch.randn(N, Kd // 32, generator=gen) * 0.05)
    x = torch.randn(1, Kd).bfloat16()
    four_kb = p.matmul(x, float_out=True)
    p.place(K.weight_arena(p.placed_bytes, True), 0, True)
    assert torch.equal(p.matmul(x, float_out=True), four_kb)


@needs_low_bit
def test_a_built_model_has_its_copies_in_one_arena_in_read_order():
    config = Gemma3Config.tiny(vocab_size=272)  # a multiple of 16: the head gets its int8 copy and screen
    model = build_model(config, random_state_dict(config, seed=0), torch.bfloat16, quantization="int8-head")
    arena = model.decode_arena
    projections = decode_projections(model)
    layers = [m for m in model.modules() if isinstance(m, DecodeLinear)]
    assert len(layers) == 4 * config.num_hidden_layers
    assert arena is not None and arena.projections == len(projections) == len(layers) + 2  # + the head's screen, int8
    assert projections[0] is model.model.layers[0].self_attn.qkv_proj.decode.projection
    assert projections[3] is model.model.layers[0].mlp.down_proj.decode.projection
    assert projections[-1] is model.model.embed_tokens.int8.kernel_weight.projection
    assert arena.nbytes == sum(p.placed_bytes for p in projections) <= arena.buffer.numel()
    # the kernels stream as from 2 MB pages only where the kernel gave them (smaps), whatever this machine allows
    in_huge_pages = arena.huge_bytes >= HUGE_PAGE_SHARE * arena.buffer.numel()
    assert all(p.huge_pages == in_huge_pages for p in projections)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, config.hidden_size, generator=gen).bfloat16()
    o_in = torch.randn(1, layers[1].in_features, generator=gen).bfloat16()
    with torch.no_grad():
        before = [layers[1](o_in), model.compute_logits(x)]
        copies = DecodeLinear.copies_set
        moved = place_decode_weights(model, huge_pages=False)
        assert DecodeLinear.copies_set == copies + 1  # a decode stack made before is remade
        assert moved.huge_bytes == 0 and not any(p.huge_pages for p in decode_projections(model))
        after = [layers[1](o_in), model.compute_logits(x)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    moved.buffer.zero_()
    with torch.no_grad():
        assert not model.compute_logits(x).abs().max() > 0  # the head reads from the new arena


def test_a_float32_model_places_nothing():
    config = Gemma3Config.tiny()
    model = build_model(config, random_state_dict(config, seed=0), torch.float32)
    assert model.decode_arena is None and place_decode_weights(model) is None


def test_huge_page_bytes_sums_the_mappings_the_buffer_lies_in(tmp_path):
    buf = torch.zeros(8 << 20, dtype=torch.uint8)
    start, mb = buf.data_ptr(), 1 << 20
    smaps = tmp_path / "smaps"
    smaps.write_text(
        f"{start - 8192:x}-{start + 4096:x} rw-p 00000000 00:00 0\nRss: 12 kB\nAnonHugePages:     2048 kB\n"
        f"{start + 4096:x}-{start + 4 * mb:x} rw-p 00000000 00:00 0\nAnonHugePages:     4096 kB\n"
        f"{start + 8 * mb:x}-{start + 10 * mb:x} rw-p 00000000 00:00 0\nAnonHugePages:     2048 kB\n")
    # the first two mappings overlap the buffer, the third starts at its end
    assert huge_page_bytes(buf, smaps) == 6 * mb
    assert huge_page_bytes(buf[:4096], smaps) == 4096  # one mapping's 2 MB, capped at the buffer's size
    assert huge_page_bytes(buf, tmp_path / "missing") == 0


@needs_low_bit
def test_the_bandwidth_probe_reads_from_pages_asked_as_the_weights_are():
    buf = read_buffer(8 << 20)
    assert buf.dtype == torch.float32 and buf.numel() == 2 << 20 and bool((buf == 1).all())
    assert buf.data_ptr() % HUGE_PAGE == 0  # from `weight_arena`, not torch's allocator


@needs_low_bit
def test_switching_the_screen_off_gives_its_bytes_back_and_keeps_the_int8_head():
    config = Gemma3Config.tiny(vocab_size=272)
    model = build_model(config, random_state_dict(config, seed=0), torch.bfloat16, quantization="int8-head")
    head = model.model.embed_tokens.int8
    screen_bytes = head.screen.coarse.placed_bytes
    before = model.decode_arena
    x = torch.randn(1, config.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        exact = head.kernel_weight.matmul(x, float_out=True)
        assert not set_head_screen(model, False)
        assert torch.equal(model.compute_logits(x), exact)  # the int8 head alone, read from the new buffer
    after = model.decode_arena
    assert after.buffer.data_ptr() != before.buffer.data_ptr()
    assert after.nbytes == before.nbytes - screen_bytes and after.projections == before.projections - 1
