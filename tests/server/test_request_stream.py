"""RequestStream's deadline: one timer per request (not a wait per token), cancelled when the request ends.

The engine side is a recorder of aborts: what is under test is the stream's own bookkeeping on the event loop."""

import asyncio

from runtime.core import Req, SamplingParams
from runtime.server.engine_loop import RequestStream, _Final


class AbortRecorder:
    def __init__(self):
        self.aborted: list[str] = []

    def abort(self, rid, reason="abort"):
        self.aborted.append(rid)


def stream(timeout_s):
    queue: asyncio.Queue = asyncio.Queue()
    engine = AbortRecorder()
    return RequestStream(engine, Req([5, 6, 7], SamplingParams(max_new_tokens=4)), queue, timeout_s), queue, engine


def test_a_request_past_its_deadline_ends_with_timeout_after_the_tokens_that_arrived():
    async def run():
        s, queue, engine = stream(0.2)
        queue.put_nowait(11)
        queue.put_nowait(12)  # the engine then falls silent
        events = [ev async for ev in s]
        return s, engine, events

    s, engine, events = asyncio.run(run())
    assert s.output_ids == [11, 12]
    assert s.finish_reason == "timeout" and "--request-timeout" in s.message
    assert engine.aborted == [s.rid]
    assert events[-1].finish_reason == "timeout"


def test_a_finished_request_leaves_no_timer_behind():
    async def run():
        s, queue, engine = stream(60.0)
        for t in (1, 2, 3):
            queue.put_nowait(t)
        queue.put_nowait(_Final("length", None))
        await s.collect()
        armed = [h for h in asyncio.get_running_loop()._scheduled if not h.cancelled()]
        return s, engine, armed

    s, engine, armed = asyncio.run(run())
    assert s.output_ids == [1, 2, 3] and s.finish_reason == "length"
    assert armed == []  # the 60 s deadline was cancelled, not left to hold the stream
    assert engine.aborted == []


def test_abort_cancels_the_deadline():
    async def run():
        s, queue, engine = stream(60.0)
        queue.put_nowait(1)
        async for _ in s:
            break  # the consumer leaves after the first event
        s.abort()
        return s, engine, [h for h in asyncio.get_running_loop()._scheduled if not h.cancelled()]

    s, engine, armed = asyncio.run(run())
    assert engine.aborted == [s.rid] and armed == []
