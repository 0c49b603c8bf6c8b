"""From a request's tokens to the text the OpenAI endpoints send: detokenized as it arrives, cut at stop strings.

The engine stops on token ids (EOS, `<end_of_turn>`); a stop *string* can span several tokens, or end inside
one, so it is matched on the decoded text, as the text arrives. Text that may still turn out to be the start
of a stop string is held back until the next piece decides it, so that a stop string split across two
streamed chunks never leaks its first half to the client. The request ends as soon as its stop string
appears: it is aborted, which frees its KV slots at once, and answered with finish reason `stop`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.server.protocol import failure_of

if TYPE_CHECKING:
    from runtime.server.engine_loop import RequestStream


class TextDeltas:
    """Incremental detokenization: the text each new batch of tokens adds. Held back while the decoded text
    ends in U+FFFD (an unfinished multi-byte character); `final=True` flushes whatever is left. Decodes a
    short window (from the last emitted boundary), so that a long completion costs linear, not quadratic,
    work; the concatenated deltas equal `decode(all ids)` as long as the decoder is prefix-stable at
    boundaries where the text was complete."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids already turned into text

    def push(self, ids: tuple[int, ...], final: bool = False) -> str:
        self._ids.extend(ids)
        before = self._tok.decode(self._ids[self._prefix:self._read])
        after = self._tok.decode(self._ids[self._prefix:])
        if not final and (after.endswith("\ufffd") or len(after) <= len(before)):
            return ""
        delta = after[len(before):] if after.startswith(before) else after
        self._prefix, self._read = self._read, len(self._ids)
        return delta


class StopMatcher:
    """Feed text with `push()`; it returns the part that is safe to emit. Once a stop string appears,
    `stopped` is True, the text before it has been returned and everything after it is dropped. `flush()`
    at the end of the text returns what was held back.

    Contract: the concatenation of every `push()` and the final `flush()` equals the whole text cut before
    the earliest occurrence of any stop string (the whole text if none occurs), however the text was split.
    """

    def __init__(self, stops: Iterable[str]):
        self.stops = tuple(s for s in dict.fromkeys(stops) if s)
        self.stopped = False
        self._held = ""

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped, self._held = True, ""
            return buf[:min(found)]
        keep = self._partial_match(buf)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_match(self, buf: str) -> int:
        """Length of the longest end of `buf` that is the beginning of a stop string (shorter than it)."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best


@dataclass(frozen=True)
class TextPiece:
    """New text of a request; the last piece carries the finish reason (`length` or `stop`), or `failure`
    (status, message, type) when the server ended the request (engine error, shutdown)."""

    text: str
    finish_reason: str | None = None
    failure: tuple[int, str, str] | None = None
    token_ids: tuple[int, ...] = ()  # the tokens this piece's event brought (their text may be held back)
    logprobs: tuple = ()  # TokenLogprob of each of them, when the request asked


async def text_pieces(stream: RequestStream, tokenizer, stops: Iterable[str] = ()) -> AsyncIterator[TextPiece]:
    """The text of `stream` as it arrives (one piece per stream event), cut before the first stop string;
    on a stop string the request is finished at once (counted `finished`) and the last piece says `stop`."""
    deltas, matcher = TextDeltas(tokenizer), StopMatcher(stops)
    async for ev in stream:
        final = ev.finish_reason is not None
        text = matcher.push(deltas.push(ev.token_ids, final=final))
        if matcher.stopped:
            stream.finish("stop")
            yield TextPiece(text, "stop", None, ev.token_ids, ev.logprobs)
            return
        if final:
            text += matcher.flush()
        failure = failure_of(ev.finish_reason, ev.message)
        yield TextPiece(text, None if failure else ev.finish_reason, failure, ev.token_ids, ev.logprobs)
