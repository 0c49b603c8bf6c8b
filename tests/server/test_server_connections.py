"""Connection hygiene with raw sockets on loopback: oversized chunked uploads release their connections
however the client leaves, /health and /metrics stay answerable under a connection flood, Content-Length
with Transfer-Encoding is refused, a request followed by a half-close gets its answer, and a client that
closes still aborts its request."""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time

import httpx
import pytest
from conftest import make_engine, start_server

MAX_CONNECTIONS = 8
MAX_BYTES = 1000
PROMPT = b'{"input_ids": [2, 40, 41, 42, 43], "sampling_params": {"max_new_tokens": 4, "ignore_eos": true}}'


@pytest.fixture(scope="module")
def srv():
    server = start_server(make_engine(), max_connections=MAX_CONNECTIONS, max_request_bytes=MAX_BYTES,
                          header_timeout_s=5.0, body_timeout_s=5.0)
    yield server
    server.stop()


def connect(srv) -> socket.socket:
    host, port = srv.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(10)
    return sock


def open_connections(srv) -> int:
    return len(srv.server.server_state.connections)


def wait_released(srv, timeout_s: float = 6.0) -> None:
    deadline = time.monotonic() + timeout_s
    while open_connections(srv) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_connections(srv) == 0, f"{open_connections(srv)} connections still held"


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """The final response on `sock` (interim 1xx answers skipped), read until the server closes."""
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    while data.startswith(b"HTTP/1.1 1"):
        data = data.split(b"\r\n\r\n", 1)[1]
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def post_head(length: int | None = None, chunked: bool = False) -> bytes:
    framing = (f"Content-Length: {length}\r\n" if length is not None else "") + \
              ("Transfer-Encoding: chunked\r\n" if chunked else "")
    return (f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{framing}\r\n"
            ).encode()


def healthy(srv) -> None:
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        assert c.get("/health").status_code == 200
        assert c.post("/generate", content=PROMPT, headers={"Content-Type": "application/json"}).status_code == 200
    srv.wait_idle_clean()


@pytest.mark.parametrize("leave", ["close", "reset", "half-close"])
def test_oversized_chunked_uploads_release_their_connections(srv, caplog, leave):
    chunk = b"x" * 4000
    upload = post_head(chunked=True) + (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 3

    def one() -> None:
        sock = connect(srv)
        try:
            sock.sendall(upload)
        except OSError:
            pass  # the server answered 413 and closed while we were still sending
        if leave == "reset":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif leave == "half-close":
            sock.shutdown(socket.SHUT_WR)
        sock.close()

    def many() -> None:
        for _ in range(40):
            one()

    caplog.set_level(logging.ERROR)
    started = time.monotonic()
    workers = [threading.Thread(target=many) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert time.monotonic() - started < 30
    wait_released(srv)
    assert not [r for r in caplog.records if r.exc_info], "a close raised"
    healthy(srv)


def test_health_and_metrics_answer_under_a_flood_of_idle_connections(srv):
    flood = [connect(srv) for _ in range(6 * MAX_CONNECTIONS)]  # silent: a slowloris holding every place
    try:
        with httpx.Client(base_url=srv.url, timeout=5) as c:
            for _ in range(3):
                started = time.monotonic()
                assert c.get("/health").status_code == 200
                assert "swa_runtime_http_responses_total" in c.get("/metrics").text
                assert time.monotonic() - started < 2.0
    finally:
        for sock in flood:
            sock.close()
    wait_released(srv)


def test_when_every_connection_is_busy_the_reserve_serves_health_and_metrics_only(srv):
    # Each of these has sent its headers and 1 byte of a 100-byte body: a request under way, never shed.
    busy = [connect(srv) for _ in range(MAX_CONNECTIONS)]
    for sock in busy:
        sock.sendall(post_head(length=100) + b"{")
    time.sleep(0.3)
    reserve = []
    try:
        for request in (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
                        b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"):
            reserve.append(connect(srv))
            reserve[-1].sendall(request)
            assert read_response(reserve[-1])[0] == 200
        reserve.append(connect(srv))
        reserve[-1].sendall(post_head(length=len(PROMPT)) + PROMPT)
        status, headers, body = read_response(reserve[-1])
        assert status == 503 and headers["connection"] == "close" and headers["retry-after"] == "1"
        assert "too many open connections" in json.loads(body)["error"]["message"]
    finally:
        for sock in busy + reserve:
            sock.close()
    wait_released(srv)
    healthy(srv)


def test_content_length_with_transfer_encoding_is_refused(srv):
    sock = connect(srv)
    body = b"%x\r\n" % len(PROMPT) + PROMPT + b"\r\n0\r\n\r\n"
    sock.sendall(post_head(length=len(PROMPT), chunked=True) + body)
    status, headers, raw = read_response(sock)
    sock.close()
    assert status == 400 and headers["connection"] == "close"
    assert "Content-Length and Transfer-Encoding" in json.loads(raw)["error"]["message"]
    wait_released(srv)
    healthy(srv)


def test_a_request_followed_by_a_half_close_gets_its_answer(srv):
    sock = connect(srv)
    sock.sendall(post_head(length=len(PROMPT)) + PROMPT)
    sock.shutdown(socket.SHUT_WR)
    status, headers, body = read_response(sock)
    sock.close()
    assert status == 200 and len(json.loads(body)["output_ids"]) == 4
    wait_released(srv)
    healthy(srv)


def test_a_client_that_closes_still_aborts_its_request(srv):
    long = b'{"input_ids": [2, 40, 41], "sampling_params": {"max_new_tokens": 1000, "ignore_eos": true}}'
    sock = connect(srv)
    sock.sendall(post_head(length=len(long)) + long)
    time.sleep(0.3)
    closed_at = time.monotonic()
    sock.close()
    sched = srv.engine.scheduler
    while srv.engine_loop.call(sched.has_work).result(10):
        assert time.monotonic() - closed_at < 5, "the request of a closed connection still runs"
        time.sleep(0.02)
    wait_released(srv)
    healthy(srv)
