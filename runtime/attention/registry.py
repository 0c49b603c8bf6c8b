"""Attention backends by name, imported lazily: Triton loads only when chosen."""

from __future__ import annotations

from runtime.attention.base import AttentionBackend


def make_backend(name: str, pool, req_to_token, sliding_window: int | None) -> AttentionBackend:
    if name == "torch":
        from runtime.attention.torch_native import TorchNativeBackend

        return TorchNativeBackend(pool, req_to_token, sliding_window)
    if name == "triton":
        try:
            from runtime.attention.triton_backend import TritonBackend
        except ModuleNotFoundError as exc:
            if exc.name != "triton":
                raise
            raise RuntimeError("the triton attention backend needs triton: pip install 'swa-runtime[triton]' "
                               "(or use --attention-backend torch)") from None

        return TritonBackend(pool, req_to_token, sliding_window)
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")
