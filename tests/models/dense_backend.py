"""A dense reference attention backend for model tests (no KV cache): the oracle for the model alone."""

import torch


class DenseCausalBackend:
    """Reference attention over the T tokens of one sequence (token i at relative position i): causal, and
    on sliding layers limited to the last `sliding_window` tokens. No KV cache. Computes in float32.

    `respect_window=False` turns sliding layers into global ones (to show that the window matters);
    `calls` records what each layer handed over.
    """

    def __init__(self, respect_window: bool = True) -> None:
        self.respect_window = respect_window
        self.calls = []

    def forward(self, q, k, v, layer):  # q (T, H, D), k/v (T, Hkv, D) -> (T, H, D)
        self.calls.append((layer.layer_id, layer.sliding_window, layer.scaling, q.shape, k.shape, v.shape, q.dtype))
        T, H, _ = q.shape
        group = H // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)  # (T, H, D): query head h reads kv head h // group
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * layer.scaling  # (H, T, T)
        i = torch.arange(T)
        visible = i[None, :] <= i[:, None]  # (Tq, Tk)
        if self.respect_window and layer.sliding_window is not None:
            visible &= i[:, None] - i[None, :] < layer.sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)  # (T, H, D)
