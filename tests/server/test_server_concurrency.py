"""Concurrent HTTP requests are batched and still produce exactly the one-at-a-time greedy outputs; clients
that hang up mid-stream abort their requests; afterwards nothing is left in the pools."""

import asyncio
import json
import random

import httpx

from conftest import CONTEXT, WINDOW, make_engine
from runtime.layers.sampler import SamplingParams

PROMPT_LENS = (3, 9, 21, 40, 5, 17)  # most longer than the window (8); 21 and 40 take several prefill chunks
NEW_TOKENS = (12, 24, 9, 30, 20, 16)


def prompts():
    rng = random.Random(7)
    return [[2] + [rng.randrange(4, 260) for _ in range(n - 1)] for n in PROMPT_LENS]


def test_concurrent_requests_match_sequential_and_leave_pools_clean(live):
    assert max(PROMPT_LENS) > WINDOW and max(p + n for p, n in zip(PROMPT_LENS, NEW_TOKENS)) < CONTEXT
    ignore_eos = [i % 2 == 0 for i in range(len(PROMPT_LENS))]

    # Reference: a second engine, one request at a time.
    ref_engine = make_engine()
    expected = [ref_engine.generate([p], SamplingParams(max_new_tokens=n, ignore_eos=ie))[0]
                for p, n, ie in zip(prompts(), NEW_TOKENS, ignore_eos)]
    assert len({tuple(e) for e in expected}) == len(expected), "the outputs must tell the requests apart"
    assert all(len(set(e)) > 1 for e in expected if len(e) > 4), "greedy output should not be one repeated token"

    decode_batch_sizes = []
    forward = live.engine.runner.forward

    def recording_forward(batch):
        if batch.is_decode:
            decode_batch_sizes.append(batch.batch_size)
        return forward(batch)

    live.engine.runner.forward = recording_forward
    stats = live.engine.stats
    aborted_before, generated_before = stats.request_counts["aborted"], stats.generation_tokens
    try:
        outputs, received = asyncio.run(_workload(live.url, ignore_eos))
    finally:
        live.engine.runner.forward = forward

    assert outputs == expected
    assert max(decode_batch_sizes) >= 4, "the requests should have been decoded together"
    live.wait_idle_clean()
    # Both hung-up streams were aborted, each after the tokens its client saw and long before 400.
    assert stats.request_counts["aborted"] - aborted_before == 2
    aborted_tokens = stats.generation_tokens - generated_before - sum(map(len, outputs))
    assert sum(received) <= aborted_tokens < 2 * 400


async def _workload(url, ignore_eos):
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def generate(ids, n, ie):
            r = await client.post("/generate", json={"input_ids": ids, "sampling_params": {
                "max_new_tokens": n, "ignore_eos": ie}})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["meta"]["completion_tokens"] == len(body["output_ids"])
            assert body["meta"]["prompt_tokens"] == len(ids)
            return body["output_ids"]

        async def hang_up(ids):
            """Stream a long request; close the connection after two events. Returns the tokens received."""
            events, received = 0, 0
            body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
            async with client.stream("POST", "/generate", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        events += 1
                        received += len(json.loads(line[len("data: "):])["output_ids"])
                        if events == 2:
                            break
            return received

        long_prompt = prompts()[3]
        tasks = [generate(p, n, ie) for p, n, ie in zip(prompts(), NEW_TOKENS, ignore_eos)]
        results = await asyncio.gather(*tasks, hang_up(long_prompt[:30]), hang_up(long_prompt[5:]))
        return list(results[:len(tasks)]), list(results[len(tasks):])
