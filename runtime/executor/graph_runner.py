"""Static input buffers for decode and verify graphs: capture and replay.

On CPU this is a static-buffer replay: each captured size owns persistent input buffers (token ids,
positions, write locations) whose addresses never change, and a replay copies the live batch into them and
runs the model over them. That reproduces the hazard of CUDA graphs that matters here: the translation
cache sees the same `(data_ptr, numel)` key on every replay while the contents change.
On a GPU the same replay runs (checked on an H100, docs/performance.md "On a GPU"), but CUDA graphs proper
are not implemented yet: each replay still launches every kernel, and a decode step is launch-bound there.

- `StaticGraphRunner`: decode, one token per request, per captured batch size bs.
- `StaticVerifyRunner`: speculative verify forwards, per (bs, K): room for bs requests of K + 1 tokens (the
  last accepted token and up to K drafts). Requests whose drafts are shorter are packed one after another as
  in the eager batch, so the live tokens are the first ones and the padding is one contiguous tail.

These classes only own the buffers; the model runner runs the warm-up and capture forwards over
`capture_batch(bs)` and replays over `load(batch)`. The tail after the live tokens is zeroed on every load and
belongs to padded entries of at most K + 1 tokens each: row 0 of the request table, prefix 0, positions 0,
write location slot 0 of both pools (the sink), keys read from row 0 (the sink again). A padded entry thus
writes and reads only the sink, and its logits are never computed (`ForwardBatch.live`).
"""

from __future__ import annotations

import torch

from runtime.executor.forward_batch import ForwardBatch
from runtime.mem_cache.paths import GRAPH_PATHS, VERIFY_PATHS

WARMUP_RUNS = 2  # warm-up forwards before the capture forward, per captured size


class _StaticBuffers:
    def __init__(self, bs: int, tokens: int, device):
        self.bs = bs
        self.tokens = tokens
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(tokens, dtype=torch.int64, device=device)


class StaticGraphRunner:
    """Decode graphs: one token per request."""

    tokens_per_request = 1
    paths = GRAPH_PATHS  # runtime/mem_cache/paths.py; the first two: (exact, padded)

    def __init__(self, batch_sizes: tuple[int, ...], max_batch: int, device):
        sizes = tuple(bs for bs in sorted(set(batch_sizes)) if bs <= max_batch)
        self.batch_sizes = sizes or (1,)
        w = self.tokens_per_request
        self.buffers = {bs: _StaticBuffers(bs, bs * w, device) for bs in self.batch_sizes}
        self.path_counts = dict.fromkeys(self.paths, 0)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def can_run(self, batch: ForwardBatch) -> bool:
        self.path_counts["decode_twice_graph_max"] += batch.is_decode and batch.batch_size >= 2 * self.max_batch_size
        return batch.is_decode and batch.batch_size <= self.max_batch_size

    def capture_batch(self, bs: int) -> ForwardBatch:
        """The all-padding batch that warm-up and capture run over (logits at every entry: full shapes)."""
        return self._static_batch(self.buffers[bs], None)

    def load(self, batch: ForwardBatch) -> ForwardBatch:
        """Copy a live batch into the smallest buffers that hold it; the static batch to replay."""
        buf = self.buffers[next(b for b in self.batch_sizes if b >= batch.batch_size)]
        n = batch.num_tokens
        self.path_counts[self.paths[1 if n < buf.tokens else 0]] += 1
        # Zero the padded tail on every replay so no stale slot survives.
        for static, live in ((buf.input_ids, batch.input_ids), (buf.positions, batch.positions),
                             (buf.out_cache_loc, batch.out_cache_loc)):
            static[:n].copy_(live)
            if n < buf.tokens:
                static[n:].zero_()
        return self._static_batch(buf, batch)

    def _static_batch(self, buf: _StaticBuffers, batch: ForwardBatch | None) -> ForwardBatch:
        """`batch`'s requests over the buffers, then padded entries (row 0, prefix 0, at most
        `tokens_per_request` tokens each) for the rest of the tokens; None: padding only."""
        rows, prefix, seq = ([], [], []) if batch is None else (batch.req_rows, batch.prefix_lens, batch.seq_lens)
        w = self.tokens_per_request
        pad = buf.tokens - sum(s - p for p, s in zip(prefix, seq))
        pad_lens = [w] * (pad // w) + ([pad % w] if pad % w else [])
        return ForwardBatch(
            is_decode=w == 1,
            input_ids=buf.input_ids,
            positions=buf.positions,
            out_cache_loc=buf.out_cache_loc,
            req_rows=list(rows) + [0] * len(pad_lens),
            prefix_lens=list(prefix) + [0] * len(pad_lens),
            seq_lens=list(seq) + pad_lens,
            verify=w > 1,
            live=None if batch is None else len(rows),
        )


class StaticVerifyRunner(StaticGraphRunner):
    """Verify graphs: per batch size, room for K + 1 tokens per request (`num_speculative_tokens` = K)."""

    paths = VERIFY_PATHS

    def __init__(self, batch_sizes: tuple[int, ...], max_batch: int, num_speculative_tokens: int, device):
        self.tokens_per_request = num_speculative_tokens + 1
        super().__init__(batch_sizes, max_batch, device)

    def can_run(self, batch: ForwardBatch) -> bool:
        """A verify batch of at most the largest batch size whose drafts are at most K tokens long."""
        return (batch.verify and 0 < batch.batch_size <= self.max_batch_size
                and max(batch.extend_lens) <= self.tokens_per_request)
