"""Server-sent events of both endpoints: framing, incremental chunks, the final chunk, `[DONE]`; the streamed
pieces add up to exactly the non-streamed answer (ids and text, including held-back partial UTF-8)."""

from conftest import sse_events
from runtime.models.tokenizer import ByteTokenizer
from runtime.server.app import TextDeltas

PROMPT = [2] + [(37 * i) % 256 + 4 for i in range(1, 15)]
NEW = 48


def stream(client, path, body):
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        return sse_events(r.iter_lines())


def test_generate_stream(client, live):
    params = {"max_new_tokens": NEW, "ignore_eos": True}
    whole = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": params}).json()
    events = stream(client, "/generate", {"input_ids": PROMPT, "sampling_params": params, "stream": True})

    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2, "tokens should arrive incrementally"
    assert all(c["meta"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta"]["finish_reason"] == "length"
    assert len({c["meta"]["id"] for c in chunks}) == 1
    assert [c["meta"]["completion_tokens"] for c in chunks] == list(
        _running_sum(len(c["output_ids"]) for c in chunks))
    assert all(c["meta"]["prompt_tokens"] == len(PROMPT) for c in chunks)
    assert [t for c in chunks for t in c["output_ids"]] == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert any(t >= 0x80 + 4 for t in whole["output_ids"]), "the output should include non-ASCII bytes"
    live.wait_idle_clean()


def test_completions_stream(client, live):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    whole = client.post("/v1/completions", json=body).json()
    events = stream(client, "/v1/completions", {**body, "stream": True})

    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    assert {(c["object"], c["model"], c["id"]) for c in chunks} == {("text_completion", "tiny", chunks[0]["id"])}
    assert chunks[0]["id"].startswith("cmpl-")
    assert all(len(c["choices"]) == 1 and c["choices"][0]["index"] == 0 for c in chunks)
    assert all(c["choices"][0]["finish_reason"] is None and "usage" not in c for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": NEW,
                                   "total_tokens": len(PROMPT) + NEW} == whole["usage"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert whole["choices"][0]["finish_reason"] == "length" and whole["object"] == "text_completion"
    live.wait_idle_clean()


def test_models_lists_the_served_model(client):
    r = client.get("/v1/models")
    assert r.status_code == 200
    assert [(m["id"], m["object"], m["max_model_len"]) for m in r.json()["data"]] == [("tiny", "model", 1024)]


def test_text_deltas_hold_back_unfinished_utf8():
    tok = ByteTokenizer()
    ids = tok.encode("né€!")[1:]  # n, then 2 bytes, then 3 bytes, then !
    deltas = TextDeltas(tok)
    assert [deltas.push((t,)) for t in ids] == ["n", "", "é", "", "", "€", "!"]
    broken = TextDeltas(tok)  # the last byte of the € never comes: flushed as U+FFFD at the end
    pieces = [broken.push((t,)) for t in tok.encode("a€")[1:-1]] + [broken.push((), final=True)]
    assert pieces == ["a", "", "", "\ufffd"]


def _running_sum(xs):
    total = 0
    for x in xs:
        total += x
        yield total
