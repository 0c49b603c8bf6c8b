"""Server-sent events of the two OpenAI endpoints, for any number of choices.

Chunks of different choices interleave as their text arrives, each tagged with its `index`. The last chunk
of a choice carries its finish reason. Usage: with `stream_options.include_usage`, every chunk has
`"usage": null` and a last chunk with no choices carries the request's usage (OpenAI's form); without it,
a completion choice's last chunk carries that choice's usage (what clients that read the final chunk expect).
A request the server ended (engine error, shutdown) sends the text it had, then an error event, then
`[DONE]`; the other choices are aborted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from runtime.server import choices, protocol
from runtime.server.chat import chat_chunk


def request_usage(streams: Sequence, per_prompt: int) -> tuple[int, int]:
    """(prompt tokens, counting each prompt once; completion tokens of every choice)."""
    prompt = sum(s.prompt_tokens for s in streams[::per_prompt])
    return prompt, sum(len(s.output_ids) for s in streams)


async def completion_events(streams: Sequence, tokenizer, rid: str, model: str, created: int,
                            stops: tuple[str, ...], per_prompt: int, include_usage: bool,
                            logprobs: bool) -> AsyncIterator[bytes]:
    offsets = [0] * len(streams)

    def chunk(index: int, piece, reason: str | None) -> bytes:
        lp = None
        if logprobs:
            lp = choices.completion_logprobs(tokenizer, piece.token_ids, piece.logprobs, offsets[index])
            offsets[index] += len(piece.text)
        choice = protocol.completion_choice(index, piece.text, reason, lp)
        usage = None
        if reason is not None and not include_usage:
            s = streams[index]
            usage = (s.prompt_tokens, len(s.output_ids))
        body = protocol.completion_body(rid, created, model, [choice], usage)
        if include_usage:
            body["usage"] = None
        return protocol.sse(body)

    state = {"failed": False}
    async for data in _events(streams, tokenizer, stops, chunk, state):
        yield data
    if include_usage and not state["failed"]:
        yield protocol.sse(protocol.completion_body(rid, created, model, [], request_usage(streams, per_prompt)))
    yield protocol.SSE_DONE


async def chat_events(streams: Sequence, tokenizer, rid: str, model: str, created: int, stops: tuple[str, ...],
                      include_usage: bool, logprobs: bool) -> AsyncIterator[bytes]:
    def chunk(index: int, piece, reason: str | None) -> bytes:
        lp = choices.chat_logprobs(tokenizer, piece.token_ids, piece.logprobs) if logprobs else None
        delta = {"content": piece.text} if piece.text else {}
        return protocol.sse(chat_chunk(rid, created, model, index, delta, reason, lp, include_usage))

    for i in range(len(streams)):
        yield protocol.sse(chat_chunk(rid, created, model, i, {"role": "assistant", "content": ""}, None, None,
                                      include_usage))
    state = {"failed": False}
    async for data in _events(streams, tokenizer, stops, chunk, state):
        yield data
    if include_usage and not state["failed"]:
        yield protocol.sse({"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created,
                            "model": model, "choices": [],
                            "usage": protocol.usage_body(request_usage(streams, len(streams)))})
    yield protocol.SSE_DONE


async def _events(streams: Sequence, tokenizer, stops, chunk, state: dict) -> AsyncIterator[bytes]:
    """The content chunks of every choice. On a failure: that choice's text, an error event, then the end
    (`state["failed"]` set; closing the merge aborts the other choices)."""
    merged = choices.merge(streams, tokenizer, stops)
    try:
        async for index, piece in merged:
            if piece.failure is not None:
                if piece.text:
                    yield chunk(index, piece, None)
                yield protocol.sse(protocol.error_body(*piece.failure))
                state["failed"] = True
                return
            if piece.text or piece.finish_reason is not None or piece.logprobs:
                yield chunk(index, piece, piece.finish_reason)
    finally:
        await merged.aclose()
