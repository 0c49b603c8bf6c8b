"""Our dequantisation of GGUF blocks (`runtime.models.gguf_dequant`) against the `gguf` package's, bit for bit: the
package is what the oracle (transformers) loads the file through."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf.quants import dequantize as package_dequantize  # noqa: E402

from runtime.models.gguf_dequant import dequantize  # noqa: E402

T = gguf.GGMLQuantizationType
# bytes a block, and where its float16 scales lie (byte offsets): random bytes there could make NaN or infinity
BLOCKS = {T.Q8_0: (34, (0,)), T.Q5_0: (22, (0,)), T.Q4_K: (144, (0, 2)), T.Q6_K: (210, (208,))}


def _same_bits(ours: torch.Tensor, theirs: np.ndarray) -> bool:
    theirs = np.asarray(theirs, dtype=np.float32)
    return tuple(ours.shape) == theirs.shape and np.array_equal(ours.numpy().view(np.uint32), theirs.view(np.uint32))


def _random_blocks(qtype, rows: int, blocks_a_row: int, seed: int = 0) -> np.ndarray:
    """(rows, bytes a row) of random blocks, every bit pattern of values, scales and mins possible; the float16
    scales drawn as finite values of either sign (with zero and subnormals among them)."""
    size, halves = BLOCKS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * blocks_a_row, size), dtype=np.uint8)
    for at in halves:
        scale = (rng.standard_normal(rows * blocks_a_row) * 0.01).astype(np.float16)
        scale[:3] = (0.0, -0.0, 6e-8)  # zero of both signs, a subnormal
        raw[:, at:at + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks_a_row * size)


@pytest.mark.parametrize("qtype", list(BLOCKS), ids=lambda t: t.name)
def test_random_blocks_dequantise_as_the_package_does(qtype):
    data = _random_blocks(qtype, rows=7, blocks_a_row=3)
    ours = dequantize(data, qtype)
    assert ours.dtype == torch.float32
    assert _same_bits(ours, package_dequantize(data, qtype))
    assert ours.abs().sum() > 0  # not all zeros: the comparison saw values


def test_every_tensor_of_the_default_model_dequantises_as_the_package_does(gguf_file):
    kinds = set()
    for tensor in gguf_file.tensors:
        kinds.add(tensor.tensor_type.name)
        assert _same_bits(dequantize(tensor.data, tensor.tensor_type),
                          package_dequantize(tensor.data, tensor.tensor_type)), tensor.name
    assert {"Q8_0", "Q5_0", "Q4_K", "Q6_K", "F32"} <= kinds


def test_a_type_without_our_blocks_goes_to_the_package_and_comes_back_a_copy():
    values = np.arange(12, dtype=np.float16).reshape(3, 4)
    ours = dequantize(values, T.F16)
    assert _same_bits(ours, values.astype(np.float32))
    stored = np.arange(6, dtype=np.float32).reshape(2, 3)
    stored.setflags(write=False)  # as the file's memory map is
    copy = dequantize(stored, T.F32)
    copy += 1  # writable, and not the file's bytes
    assert stored[1, 2] == 5 and copy[1, 2] == 6


def test_a_row_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="not whole blocks of 34"):
        dequantize(np.zeros((2, 50), dtype=np.uint8), T.Q8_0)
