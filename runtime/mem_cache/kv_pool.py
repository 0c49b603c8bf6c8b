"""Per-layer K and V buffers of one pool (full or SWA)."""

from __future__ import annotations

import torch

from runtime import kernels


class KVPool:
    """`num_layers` pairs of (rows, Hkv, D) buffers. Row 0..page_size-1 is the reserved padding sink, so
    padded batch entries may write there harmlessly."""

    def __init__(self, size: int, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.size = size
        self.rows = size + page_size
        self.dtype = dtype
        shape = (self.rows, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer], self.v_buffers[layer]

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc (T,) int; k, v (T, Hkv, D)
        fused = (kernels.for_tensor(k) if k.dtype == v.dtype == self.dtype and loc.dtype in (torch.int64, torch.int32)
                 and k.stride(-1) == v.stride(-1) == 1 else None)
        if fused is not None:  # both rows copied in one call (two index_puts cost ~30 us a layer at decode)
            fused.write_kv(self.k_buffers[layer], self.v_buffers[layer], loc, k, v)
            return
        self.k_buffers[layer][loc] = k.to(self.dtype)
        self.v_buffers[layer][loc] = v.to(self.dtype)

    def copy_to_host(self, loc: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer, the K and V rows at `loc` (n,) as host tensors (n, Hkv, D)."""
        return [k[loc].cpu() for k in self.k_buffers], [v[loc].cpu() for v in self.v_buffers]

    def copy_from_host(self, loc: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
        """Write per-layer host rows (as `copy_to_host` returned them) at `loc`."""
        for buf, data in zip(self.k_buffers + self.v_buffers, ks + vs):
            buf[loc] = data.to(buf.device)

    def bytes_per_token(self) -> int:
        k = self.k_buffers[0] if self.k_buffers else None
        if k is None:
            return 0
        return 2 * len(self.k_buffers) * k.shape[1] * k.shape[2] * k.element_size()
