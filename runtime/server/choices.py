"""One OpenAI request, several engine requests: `n` choices per prompt and batches of prompts.

Each choice is an engine request of its own (its own KV, its own seed `seed + i`); they run side by side in
the continuous batch. `submit_all` admits them all or none (a refusal part-way aborts those already
admitted); `collect_all` reads them concurrently into whole texts; `merge` interleaves their text pieces for
one event stream, tagged with the choice's index. Log probabilities are shaped here for both endpoints.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from runtime.core import SamplingParams, TokenLogprob
from runtime.server.protocol import APIError
from runtime.server.stops import TextPiece, text_pieces


async def submit_all(engine_loop, jobs: Sequence[tuple[list[int], SamplingParams]],
                     traceparent: str | None = None, timeout_s: float | None = None) -> list:
    """The streams of every (prompt ids, params) job, or none: a failure aborts those already admitted.
    `traceparent`: the client's trace context, continued by each job's request span; `timeout_s` bounds each
    job (the server's request deadline)."""
    streams = []
    try:
        for ids, params in jobs:
            streams.append(await engine_loop.submit(ids, params, traceparent=traceparent, timeout_s=timeout_s))
    except BaseException:
        for s in streams:
            s.abort()
        raise
    return streams


def abort_all(streams: Sequence) -> None:
    for s in streams:
        s.abort()


@dataclass
class ChoiceResult:
    """A choice's whole output: its text cut at the first stop string, and the tokens (and log
    probabilities) of every event that text came from."""

    text: str = ""
    finish_reason: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, piece: TextPiece) -> None:
        if piece.failure is not None:
            raise APIError(*piece.failure)
        self.text += piece.text
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.token_ids.extend(piece.token_ids)
        self.logprobs.extend(piece.logprobs)


async def collect_all(streams: Sequence, tokenizer, stops: tuple[str, ...]) -> list[ChoiceResult]:
    """Every stream's whole output, read concurrently; the first failure (engine error, shutdown) raises
    its APIError and the other streams are aborted by their `async with`."""

    async def one(stream) -> ChoiceResult:
        result = ChoiceResult()
        async with stream:
            async for piece in text_pieces(stream, tokenizer, stops):
                result.add(piece)
        return result

    return list(await asyncio.gather(*(one(s) for s in streams)))


async def merge(streams: Sequence, tokenizer, stops: tuple[str, ...]) -> AsyncIterator[tuple[int, TextPiece]]:
    """(choice index, piece) as each choice's text arrives. Ends when every choice has ended; closing it
    early (the client left) cancels the readers, whose `async with` aborts their requests."""
    if len(streams) == 1:  # the common case: read in place, without a task and a queue hop per token
        async with streams[0] as stream:
            async for piece in text_pieces(stream, tokenizer, stops):
                yield 0, piece
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream) -> None:
        try:
            async with stream:
                async for piece in text_pieces(stream, tokenizer, stops):
                    await queue.put((index, piece))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            index, item = await queue.get()
            if item is done:
                left -= 1
                continue
            yield index, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- log probabilities ------------------------------------------------------------------------------------


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob],
                        text_offset: int = 0) -> dict:
    """OpenAI's completions `logprobs`: tokens, their log probabilities, the top alternatives as
    {token text: log probability}, and each token's character offset in the choice's text."""
    tokens, offsets, top = [], [], []
    for tid, lp in zip(token_ids, logprobs):
        text = _token_text(tokenizer, tid)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        top.append({_token_text(tokenizer, i): v for i, v in lp.top})
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs], "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> dict:
    """OpenAI's chat `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}`."""

    def entry(tid: int, value: float) -> dict:
        text = _token_text(tokenizer, tid)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(tid, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for tid, lp in zip(token_ids, logprobs)]}
