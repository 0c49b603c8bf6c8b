"""Graph capture and replay for decode.

On CPU this is a static-buffer replay: each captured batch size owns persistent input buffers (token ids,
positions, write locations, request rows) whose addresses never change, and a replay copies the live batch
into them and runs the model over them. That reproduces the hazard of CUDA graphs that matters here: the
translation cache sees the same `(data_ptr, numel)` key on every replay while the contents change.
CUDA graphs proper are not implemented yet (no GPU was available to build and test them).

Capture runs warm-up forwards and then the capture forward, each invalidating the cache first (the
`skip-capture-invalidation` fault disables that, which leaves a warm-up entry for capture to find).
Padded entries point at row 0 of the request table, slot 0 of both pools: the sink.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from runtime.executor.forward_batch import ForwardBatch

WARMUP_RUNS = 2


class _StaticBuffers:
    def __init__(self, bs: int, device):
        self.bs = bs
        self.input_ids = torch.zeros(bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(bs, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(bs, dtype=torch.int64, device=device)


class StaticGraphRunner:
    def __init__(self, runner, batch_sizes: tuple[int, ...]):
        self.runner = runner
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        limit = runner.cfg.max_running_requests
        self.batch_sizes = tuple(bs for bs in self.batch_sizes if bs <= limit) or (1,)
        self.buffers = {bs: _StaticBuffers(bs, runner.cfg.device) for bs in self.batch_sizes}

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.batch_size <= self.batch_sizes[-1]

    def capture(self, progress: bool = False) -> None:
        """Warm up and capture every batch size over the padding sink."""
        skip = "skip-capture-invalidation" in self.runner.faults
        for bs in tqdm(self.batch_sizes, desc="Capturing decode graphs", unit="batch size", disable=not progress):
            buf = self.buffers[bs]
            for _ in range(WARMUP_RUNS + 1):
                forward_id = self.runner.next_forward_id()
                if not skip:
                    self.runner.pool.invalidate_loc_cache("graph_capture")
                with torch.no_grad():
                    self.runner.run(self._static_batch(buf, [], [], []), "graph_capture", forward_id)

    def replay(self, batch: ForwardBatch, forward_id: int) -> torch.Tensor:
        bs = next(b for b in self.batch_sizes if b >= batch.batch_size)
        buf = self.buffers[bs]
        n = batch.batch_size
        # Copy the live batch in; zero the padded region on every replay so no stale slot survives.
        buf.input_ids[:n].copy_(batch.input_ids)
        buf.input_ids[n:].zero_()
        buf.positions[:n].copy_(batch.positions)
        buf.positions[n:].zero_()
        buf.out_cache_loc[:n].copy_(batch.out_cache_loc)
        buf.out_cache_loc[n:].zero_()
        static = self._static_batch(buf, batch.req_rows, batch.prefix_lens, batch.seq_lens)
        return self.runner.run(static, "graph_replay", forward_id)[:n]

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
