"""Static input buffers for decode graphs: capture and replay.

On CPU this is a static-buffer replay: each captured batch size owns persistent input buffers (token ids,
positions, write locations) whose addresses never change, and a replay copies the live batch into them and
runs the model over them. That reproduces the hazard of CUDA graphs that matters here: the translation
cache sees the same `(data_ptr, numel)` key on every replay while the contents change.
CUDA graphs proper are not implemented yet (no GPU was available to build and test them).

This class only owns the buffers; the model runner runs the warm-up and capture forwards over
`capture_batch(bs)` and replays over `load(batch)`. Padded entries point at row 0 of the request table,
slot 0 of both pools: the sink.
"""

from __future__ import annotations

import torch

from runtime.executor.forward_batch import ForwardBatch
from runtime.mem_cache.paths import GRAPH_PATHS

WARMUP_RUNS = 2  # warm-up forwards before the capture forward, per batch size


class _StaticBuffers:
    def __init__(self, bs: int, device):
        self.bs = bs
        self.input_ids = torch.zeros(bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(bs, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(bs, dtype=torch.int64, device=device)


class StaticGraphRunner:
    def __init__(self, batch_sizes: tuple[int, ...], max_batch: int, device):
        sizes = tuple(bs for bs in sorted(set(batch_sizes)) if bs <= max_batch)
        self.batch_sizes = sizes or (1,)
        self.buffers = {bs: _StaticBuffers(bs, device) for bs in self.batch_sizes}
        self.path_counts = dict.fromkeys(GRAPH_PATHS, 0)  # runtime/mem_cache/paths.py

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def can_run(self, batch: ForwardBatch) -> bool:
        self.path_counts["decode_twice_graph_max"] += batch.is_decode and batch.batch_size >= 2 * self.max_batch_size
        return batch.is_decode and batch.batch_size <= self.max_batch_size

    def capture_batch(self, bs: int) -> ForwardBatch:
        """The all-padding batch that warm-up and capture run over."""
        return self._static_batch(self.buffers[bs], [], [], [])

    def load(self, batch: ForwardBatch) -> ForwardBatch:
        """Copy a live decode batch into the smallest buffers that hold it; the static batch to replay."""
        bs = next(b for b in self.batch_sizes if b >= batch.batch_size)
        buf = self.buffers[bs]
        n = batch.batch_size
        self.path_counts["graph_replay_padded" if n < bs else "graph_replay_exact"] += 1
        # Zero the padded region on every replay so no stale slot survives.
        buf.input_ids[:n].copy_(batch.input_ids)
        buf.input_ids[n:].zero_()
        buf.positions[:n].copy_(batch.positions)
        buf.positions[n:].zero_()
        buf.out_cache_loc[:n].copy_(batch.out_cache_loc)
        buf.out_cache_loc[n:].zero_()
        return self._static_batch(buf, batch.req_rows, batch.prefix_lens, batch.seq_lens)

    @staticmethod
    def _static_batch(buf: _StaticBuffers, rows, prefix_lens, seq_lens) -> ForwardBatch:
        pad = buf.bs - len(rows)
        return ForwardBatch(
            is_decode=True,
            input_ids=buf.input_ids,
            positions=buf.positions,
            out_cache_loc=buf.out_cache_loc,
            req_rows=list(rows) + [0] * pad,
            prefix_lens=list(prefix_lens) + [0] * pad,
            seq_lens=list(seq_lens) + [1] * pad,
        )
