"""A bounded hostile load on loopback: 64 concurrent mixed requests (both endpoints, plain and streamed, text
and token ids), a quarter of them hung up mid-stream, together with one request for each hostile sampling
parameter, one whose logits turn to NaN, and hostile bodies. Every innocent request finishes exactly as it
would alone (the hung-up ones received a prefix of that), the status counters add up to what was sent, and
no slot, row or queue entry is left behind."""

import asyncio
import json
import random

import httpx
import pytest

from conftest import CONTEXT, make_engine, start_server
from runtime.core import SamplingParams

INNOCENT, HUNG_UP = 48, 16
POISON_TOP_K = 7
JSON = {"content-type": "application/json"}


def _innocents():
    """(endpoint, stream, prompt: ids or text, new tokens, ignore_eos) for 48 requests."""
    rng = random.Random(12)
    out = []
    for i in range(INNOCENT):
        n = rng.choice((3, 9, 21, 40))
        ids = [2] + [rng.randrange(4, 260) for _ in range(n - 1)]
        text = "".join(rng.choice("abcdefgh xyz") for _ in range(n))
        kind = i % 6
        endpoint = "/v1/completions" if kind in (2, 5) else "/generate"
        prompt = text if kind in (1, 5) else ids
        out.append((endpoint, kind in (3, 4, 5), prompt, rng.randrange(4, 20), i % 2 == 0))
    return out


HOSTILE_PARAMS = [  # served: each must finish, and hurt no one
    ("/generate", {"temperature": 1e-40}),
    ("/v1/completions", {"temperature": 1e-38}),
    ("/generate", {"temperature": 5e-324, "top_p": 5e-324}),
    ("/v1/completions", {"temperature": 2.0, "top_k": 10**30}),
    ("/generate", {"temperature": 2.0, "top_p": 1e-300, "top_k": 1}),
    ("/generate", {"temperature": 2.0, "stream": True}),
]
HOSTILE_BODIES = [  # (raw body, headers, status, counted as rejected)
    (b"[" * 50_000 + b"]" * 50_000, JSON, 400, False),
    (b'{"input_ids": [2, ' + b"7" * 5000 + b"]}", JSON, 400, False),
    (b'{"text": "\\ud800"}', JSON, 400, False),
    (b'{"text": "hi", "sampling_params": {"temperature": NaN}}', JSON, 400, False),
    (b'{"text": "' + b"a" * (5 << 20) + b'"}', JSON, 413, False),
    (b'{"text": "hi"}', {"content-type": "text/plain"}, 415, False),
    (b'{"text": "hi"}', {**JSON, "host": "evil.example"}, 403, False),
    (b'{"text": "hi"}', {**JSON, "origin": "http://evil.example"}, 403, False),
    (json.dumps({"input_ids": [5] * (CONTEXT + 1)}).encode(), JSON, 400, True),
    (b'{"input_ids": [2, 999]}', JSON, 400, True),
]


@pytest.fixture(scope="module")
def server():
    srv = start_server(make_engine())
    yield srv
    srv.stop()


def test_hostile_load_hurts_no_innocent_request_and_leaks_nothing(server):
    engine = server.engine
    forward = engine.runner.forward

    def poisoned_forward(batch):  # NaN logits for the one request marked with POISON_TOP_K
        logits = forward(batch)
        rows = {r.row for r in engine.scheduler.running if r.params.top_k == POISON_TOP_K}
        hit = [i for i, row in enumerate(batch.req_rows) if row in rows]
        if hit:
            logits = logits.clone()
            logits[hit] = float("nan")
        return logits

    before = dict(engine.stats.request_counts)
    engine.runner.forward = poisoned_forward
    try:
        innocent, hung_up, hostile, poisoned, bodies = asyncio.run(_load(server.url))
    finally:
        engine.runner.forward = forward
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "running": 0, "waiting": 0}
    server.wait_idle_clean()

    reference = make_engine()
    tok = reference.tokenizer

    def alone(prompt, n, ignore_eos):
        ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
        return reference.generate([ids], SamplingParams(max_new_tokens=n, ignore_eos=ignore_eos))[0]

    for (endpoint, stream, prompt, n, ignore_eos), got in zip(_innocents(), innocent):
        expected = alone(prompt, n, ignore_eos)
        assert got == (expected if endpoint == "/generate" else tok.decode(expected)), (endpoint, stream, prompt)
    for prompt, received in hung_up:
        assert 0 < len(received) < 400 and received == alone(prompt, len(received), True)
    assert all(status == 200 for status in hostile), hostile
    assert poisoned[0] == 500 and poisoned[1].startswith("sampling failed: non-finite logits")
    assert [status for status, _ in bodies] == [b[2] for b in HOSTILE_BODIES]
    assert all(message for _, message in bodies)

    counts = engine.stats.request_counts
    delta = {k: counts[k] - before[k] for k in counts}
    assert delta == {"finished": INNOCENT + len(HOSTILE_PARAMS), "aborted": HUNG_UP,
                     "rejected": sum(b[3] for b in HOSTILE_BODIES), "refused": 0, "error": 1, "other": 0}


async def _load(url: str):
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def innocent(endpoint, stream, prompt, n, ignore_eos):
            if endpoint == "/generate":
                key = "text" if isinstance(prompt, str) else "input_ids"
                body = {key: prompt, "sampling_params": {"max_new_tokens": n, "ignore_eos": ignore_eos}}
            else:
                body = {"prompt": prompt, "max_tokens": n, "ignore_eos": ignore_eos, "temperature": 0}
            if not stream:
                r = await client.post(endpoint, json=body)
                assert r.status_code == 200, r.text
                data = r.json()
                return data["output_ids"] if endpoint == "/generate" else data["choices"][0]["text"]
            events = await _events(client, endpoint, {**body, "stream": True})
            if endpoint == "/generate":
                return [t for e in events for t in e["output_ids"]]
            return "".join(e["choices"][0]["text"] for e in events)

        async def hang_up(prompt):
            body = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 400,
                                                                              "ignore_eos": True}}
            received = []
            async with client.stream("POST", "/generate", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        received += json.loads(line[len("data: "):])["output_ids"]
                        if len(received) >= 2:
                            break
            return prompt, received

        async def hostile(endpoint, params):
            params = dict(params)
            stream = params.pop("stream", False)
            if endpoint == "/generate":
                body = {"input_ids": [2, 77, 78], "stream": stream,
                        "sampling_params": {"max_new_tokens": 12, **params}}
            else:
                body = {"prompt": [2, 77, 78], "max_tokens": 12, "stream": stream, **params}
            if stream:
                events = await _events(client, endpoint, body)
                return 200 if events[-1]["meta"]["finish_reason"] == "length" else 0
            return (await client.post(endpoint, json=body)).status_code

        async def poisoned():
            r = await client.post("/generate", json={"input_ids": [2, 55], "sampling_params": {
                "max_new_tokens": 12, "temperature": 0.5, "top_k": POISON_TOP_K}})
            return r.status_code, r.json()["error"]["message"]

        async def bad_body(raw, headers, *_):
            r = await client.post("/generate", content=raw, headers=headers)
            return r.status_code, r.json()["error"]["message"]

        rng = random.Random(5)
        hung_prompts = [[2] + [rng.randrange(4, 260) for _ in range(rng.choice((5, 30)))] for _ in range(HUNG_UP)]
        return await asyncio.gather(
            asyncio.gather(*(innocent(*spec) for spec in _innocents())),
            asyncio.gather(*(hang_up(p) for p in hung_prompts)),
            asyncio.gather(*(hostile(*h) for h in HOSTILE_PARAMS)),
            poisoned(),
            asyncio.gather(*(bad_body(*b) for b in HOSTILE_BODIES)))


async def _events(client, endpoint, body) -> list[dict]:
    async with client.stream("POST", endpoint, json=body) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines()]
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
    assert "data: [DONE]" in lines[-2:]
    assert all("error" not in e for e in events), events
    return events
