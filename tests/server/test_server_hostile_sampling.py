"""Sampling parameters at the edge of what the schema accepts are served (a vanishing temperature behaves
as greedy), and a request whose sampling fails ends alone, with status `error`: the requests decoded in the
same batch finish exactly as they would alone."""

import asyncio

import httpx
import pytest
import torch

from conftest import make_engine, start_server
from runtime.core import SamplingParams

PROMPTS = [[2, 40, 41, 42, 43], [2, 90, 17, 33, 200, 201, 5, 6, 7, 8, 9], [2, 120, 121]]
NEW = 24
POISON_TOP_K = 7  # marks the request whose logits the test turns into NaN


@pytest.fixture(scope="module")
def reference():
    engine = make_engine()
    return [engine.generate([p], SamplingParams(max_new_tokens=NEW, ignore_eos=True))[0] for p in PROMPTS]


@pytest.fixture(scope="module")
def server():
    srv = start_server(make_engine())
    yield srv
    srv.stop()


async def _plain(client, prompt, **sampling):
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": NEW, "ignore_eos": True, **sampling}}
    return await client.post("/generate", json=body)


async def _completion(client, prompt, **params):
    return await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": NEW, "ignore_eos": True,
                                                      **params})


@pytest.mark.parametrize("temperature", [1e-40, 1e-38, 5e-324])
def test_vanishing_temperature_is_greedy_and_hurts_no_one(temperature, server, reference):
    before = dict(server.engine.stats.request_counts)

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(
                _plain(client, PROMPTS[0]),  # innocent, greedy
                _plain(client, PROMPTS[1], temperature=temperature),
                _completion(client, PROMPTS[2], temperature=temperature, top_p=5e-324, top_k=10**30),
                _plain(client, PROMPTS[2], temperature=temperature, top_k=1))

    innocent, hostile, completion, top1 = asyncio.run(run())
    assert [r.status_code for r in (innocent, hostile, completion, top1)] == [200] * 4, hostile.text
    assert innocent.json()["output_ids"] == reference[0]
    assert hostile.json()["output_ids"] == reference[1]  # greedy in the limit, not NaN
    assert completion.json()["choices"][0]["text"] == server.engine.tokenizer.decode(reference[2])
    assert top1.json()["output_ids"] == reference[2]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    server.wait_idle_clean()
    counts = server.engine.stats.request_counts
    assert {k: counts[k] - before[k] for k in counts if counts[k] != before[k]} == {"finished": 4}


@pytest.fixture(scope="module")
def poisoned_run(server):
    """Three greedy requests and, in the same batches, one whose logits the model turns to NaN. Returns the
    innocent responses, the poisoned one, the status counts it added and the tokens it generated."""
    engine = server.engine
    forward = engine.runner.forward

    def poisoned_forward(batch):
        logits = forward(batch).clone()
        rows = {r.row for r in engine.scheduler.running if r.params.top_k == POISON_TOP_K}
        for i, row in enumerate(batch.req_rows):
            if row in rows:
                logits[i] = float("nan")
        return logits

    before = dict(engine.stats.request_counts)
    generated = engine.stats.generation_tokens
    engine.runner.forward = poisoned_forward
    try:
        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                return await asyncio.gather(*(_plain(client, p) for p in PROMPTS),
                                            _plain(client, PROMPTS[1], temperature=0.7, top_k=POISON_TOP_K))

        *innocent, poisoned = asyncio.run(run())
    finally:
        engine.runner.forward = forward
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    server.wait_idle_clean()
    counts = engine.stats.request_counts
    added = {k: counts[k] - before[k] for k in counts if counts[k] != before[k]}
    return innocent, poisoned, added, engine.stats.generation_tokens - generated


def test_a_request_whose_sampling_fails_ends_alone_with_status_error(poisoned_run, reference):
    innocent, poisoned, added, _ = poisoned_run
    assert poisoned.status_code == 500, poisoned.text
    assert poisoned.json()["error"]["message"].startswith("sampling failed")
    assert [r.status_code for r in innocent] == [200] * 3
    assert [r.json()["output_ids"] for r in innocent] == reference
    assert added == {"finished": 3, "error": 1}


def test_a_failed_request_gets_no_token_after_it_ended(poisoned_run):
    assert poisoned_run[3] == 3 * NEW


def test_sampler_rejects_nan_rows_and_keeps_tiny_temperatures_finite():
    from runtime.layers.sampler import SamplingError, sample

    logits = torch.randn(3, 50) * 20
    greedy = logits.argmax(-1).tolist()
    gen = torch.Generator().manual_seed(0)
    for t in (1e-40, 1e-45, 5e-324):
        assert sample(logits, [SamplingParams(temperature=t, top_p=5e-324)] * 3, gen) == greedy
    logits[1, 3] = float("nan")
    with pytest.raises(SamplingError, match=r"row\(s\) \[1\] of 3"):
        sample(logits, [SamplingParams()] * 3, gen)


def test_sampler_finds_every_kind_of_bad_row_and_breaks_greedy_ties_as_argmax():
    from runtime.layers.sampler import SamplingError, sample

    inf = float("inf")
    logits = torch.randn(6, 40)
    logits[0, 7] = float("nan")
    logits[1, 2] = inf  # +inf: no distribution
    logits[2] = -inf  # nothing left to draw
    logits[3, :30] = -inf  # some -inf is a mask, not a failure
    logits[4, [5, 9]] = 50.0  # a tie: the first maximal index, as argmax
    logits[5, 0] = -inf
    with pytest.raises(SamplingError, match=r"row\(s\) \[0, 1, 2\] of 6"):
        sample(logits, [SamplingParams()] * 6)
    good = logits[3:]
    assert sample(good, [SamplingParams()] * 3) == good.argmax(-1).tolist()
    assert sample(good, [SamplingParams()] * 3)[1] == 5
