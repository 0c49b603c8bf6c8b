"""`/abort_request` needs the admin token (403 without one configured, 401 with a wrong one), and a cancelled
request's own client is told so: 410 when it waits for the whole answer, an error event when streaming."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest
from conftest import make_engine, sse_events, start_server

PROMPT = [2] + [(29 * i) % 256 + 4 for i in range(1, 12)]
TOKEN = "admin-token-for-tests-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LONG = {"max_new_tokens": 900, "ignore_eos": True}


@pytest.fixture(scope="module")
def guarded():
    srv = start_server(make_engine(), admin_token=TOKEN)
    yield srv
    srv.stop()


@pytest.fixture
def admin_client(guarded):
    with httpx.Client(base_url=guarded.url, timeout=60) as c:
        yield c


def start_stream(client, rid: str) -> tuple[threading.Thread, threading.Event, list]:
    events, started = [], threading.Event()

    def consume():
        body = {"input_ids": PROMPT, "stream": True, "rid": rid, "sampling_params": LONG}
        with client.stream("POST", "/generate", json=body) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                started.set()
            events.extend(sse_events(lines))

    worker = threading.Thread(target=consume)
    worker.start()
    assert started.wait(30)
    return worker, started, events


def kv_used(client) -> float:
    line = next(ln for ln in client.get("/metrics").text.splitlines()
                if ln.startswith('swa_runtime_kv_tokens{pool="full",state="used"}'))
    return float(line.rsplit(" ", 1)[1])


def test_without_a_configured_token_abort_is_refused_and_the_request_runs_on(client, live):
    worker, _, events = start_stream(client, "victim")
    for body in ({"rid": "victim"}, {"abort_all": True}):
        r = client.post("/abort_request", json=body, headers=AUTH)
        assert r.status_code == 403 and "--admin-token" in r.json()["error"]["message"]
    assert worker.is_alive() and kv_used(client) > 0  # still generating
    client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})
    worker.join(60)
    assert events[-2]["meta"]["finish_reason"] == "length" and events[-2]["meta"]["completion_tokens"] == 900
    live.wait_idle_clean()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-token-0123456789"},
                                     {"Authorization": f"Basic {TOKEN}"}])
def test_a_wrong_or_missing_token_gets_401(admin_client, headers):
    r = admin_client.post("/abort_request", json={"abort_all": True}, headers=headers)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert "admin token" in r.json()["error"]["message"]


@pytest.mark.parametrize("abort", [{"rid": "to-abort"}, {"abort_all": True}])
def test_a_cancelled_stream_ends_with_an_error_event_and_frees_its_slots(admin_client, guarded, abort):
    worker, _, events = start_stream(admin_client, "to-abort")
    started = time.monotonic()
    r = admin_client.post("/abort_request", json=abort, headers=AUTH)
    assert r.status_code == 200 and r.json() == {}
    worker.join(30)
    assert time.monotonic() - started < 10
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == 410 and error["type"] == "request_cancelled" and "/abort_request" in error["message"]
    assert not any(isinstance(e, dict) and e.get("meta", {}).get("finish_reason") for e in events)
    guarded.wait_idle_clean()
    # ended: a no-op
    assert admin_client.post("/abort_request", json={"rid": "to-abort"}, headers=AUTH).status_code == 200


def wait_in_background(client, rid: str) -> Callable[[], httpx.Response]:
    """POST a long /generate named `rid` from another thread; returns a call that waits for its response."""
    result = {}

    def wait():
        result["r"] = client.post("/generate", json={"input_ids": PROMPT, "rid": rid, "sampling_params": LONG})

    worker = threading.Thread(target=wait)
    worker.start()

    def response() -> httpx.Response:
        worker.join(30)
        return result["r"]
    return response


def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_cancelled_request_waiting_for_its_whole_answer_gets_410(admin_client, guarded):
    response = wait_in_background(admin_client, "whole")
    until(lambda: kv_used(admin_client) > 0)
    assert admin_client.post("/abort_request", json={"rid": "whole"}, headers=AUTH).status_code == 200
    r = response()
    assert r.status_code == 410 and r.json()["error"]["type"] == "request_cancelled"
    metrics = admin_client.get("/metrics").text
    assert 'swa_runtime_http_responses_total{code="410"} 1.0' in metrics
    guarded.wait_idle_clean()


def test_an_abort_that_arrives_before_the_engine_has_answered_the_submission_is_not_lost(admin_client, guarded):
    """The engine may take a request (and start computing it) before its handler hears back; an abort sent
    in between must still cancel it. Holding the engine thread makes that window as wide as we like."""
    loop, release = guarded.engine_loop, threading.Event()
    held = loop.call(lambda: release.wait(30))
    response = wait_in_background(admin_client, "early")
    until(lambda: loop._pending_adds > 0)  # submitted, not yet taken by the (held) engine thread
    assert admin_client.post("/abort_request", json={"rid": "early"}, headers=AUTH).status_code == 200
    release.set()
    held.result(30)
    r = response()
    assert r.status_code == 410 and r.json()["error"]["type"] == "request_cancelled"
    guarded.wait_idle_clean()


def test_abort_all_and_a_request_id_header_cancel_a_chat_completion(admin_client, guarded):
    body = {"messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 900,
            "stream": True, "ignore_eos": True}
    for abort in ({"rid": "chat-7"}, {"abort_all": True}):
        lines, started = [], threading.Event()

        def consume():
            with admin_client.stream("POST", "/v1/chat/completions", json=body,
                                     headers={"X-Request-Id": "chat-7"}) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()

        worker = threading.Thread(target=consume)
        worker.start()
        assert started.wait(30)
        assert admin_client.post("/abort_request", json=abort, headers=AUTH).status_code == 200
        worker.join(30)
        events = sse_events(lines)
        assert events[0]["id"] == "chatcmpl-chat-7" and events[-1] == "[DONE]"
        assert events[-2]["error"]["type"] == "request_cancelled"
        assert not any(c.get("finish_reason") for e in events[:-1] if "choices" in e for c in e["choices"])
        guarded.wait_idle_clean()


def test_abort_request_validates_its_body(admin_client):
    r = admin_client.post("/abort_request", json={}, headers=AUTH)
    assert r.status_code == 400 and "exactly one of `rid` or `abort_all: true`" in r.json()["error"]["message"]
    assert admin_client.post("/abort_request", content=b'{"rid": "x"}', headers=AUTH).status_code == 415
    assert admin_client.post("/abort_request", json={"abort_all": True}, headers=AUTH).status_code == 200


def test_a_short_token_is_refused_at_start_up():
    from runtime.server.options import ServerOptions

    with pytest.raises(ValueError, match="at least 16 characters"):
        ServerOptions(admin_token="short")
