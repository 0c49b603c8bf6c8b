"""Bounded bodies and connections, probed with raw sockets on loopback: an oversized body is refused before
it is read, slow or silent clients are cut off by the header, body and keep-alive timeouts, connections
beyond the cap shed the longest idle ones, and the server stays responsive and leak-free throughout."""

import json
import socket
import threading
import time

import httpx
import pytest

from conftest import make_engine, start_server

TIMEOUT = 0.5  # header, body and keep-alive timeouts of the server under test
MAX_CONNECTIONS = 16
MAX_BYTES = 1 << 20


@pytest.fixture(scope="module")
def tight():
    srv = start_server(make_engine(), header_timeout_s=TIMEOUT, body_timeout_s=TIMEOUT,
                       keep_alive_timeout_s=TIMEOUT, max_connections=MAX_CONNECTIONS, max_request_bytes=MAX_BYTES)
    yield srv
    srv.stop()


def _address(srv) -> tuple[str, int]:
    host, port = srv.url.removeprefix("http://").split(":")
    return host, int(port)


def _connect(srv) -> socket.socket:
    sock = socket.create_connection(_address(srv))
    sock.settimeout(10)
    return sock


def _response(sock: socket.socket) -> tuple[int, dict, dict | None, bool]:
    """(status, headers, JSON body, closed by the server afterwards) of the next response on `sock`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    try:
        closed = sock.recv(1) == b""
    except (ConnectionResetError, TimeoutError):
        closed = True
    return int(status_line.split()[1]), headers, json.loads(body) if body else None, closed


def _post_head(path: str, length: int | None, extra: str = "") -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{size}{extra}\r\n"
            ).encode()


def _assert_healthy_and_clean(srv) -> None:
    r = httpx.get(f"{srv.url}/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    srv.wait_idle_clean()


def _connections(srv) -> int:
    return len(srv.server.server_state.connections)


def test_a_declared_50_mb_body_is_refused_before_it_is_read(tight):
    sock = _connect(tight)
    start = time.monotonic()
    sock.sendall(_post_head("/generate", 50_000_000) + b'{"text": "' + b"a" * 65536)
    status, headers, body, closed = _response(sock)
    elapsed = time.monotonic() - start
    assert status == 413 and headers["connection"] == "close" and closed
    assert body["error"]["message"] == (f"request body too large: Content-Length 50000000; the limit is {MAX_BYTES} "
                                        "bytes (--max-request-bytes)")
    assert elapsed < 1.0, f"413 took {elapsed:.2f} s"
    sock.close()
    _assert_healthy_and_clean(tight)


def test_an_undeclared_body_is_cut_off_at_the_limit(tight):
    sock = _connect(tight)
    sock.sendall(_post_head("/v1/completions", None))
    chunk = b"a" * 65536
    sent = 0
    while sent <= MAX_BYTES:  # chunked: the server can only count
        sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        sent += len(chunk)
    status, _, body, closed = _response(sock)
    assert status == 413 and closed
    assert body["error"]["message"].startswith(f"request body too large: more than {MAX_BYTES} bytes")
    sock.close()
    _assert_healthy_and_clean(tight)


@pytest.mark.parametrize("sent, status, message", [
    (b"", 408, f"no complete request headers within {TIMEOUT:g} s"),
    (b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le", 408,
     f"no complete request headers within {TIMEOUT:g} s"),
    (_post_head("/generate", 100) + b"{", 408,
     f"the request body did not arrive within {TIMEOUT:g} s (received 1 bytes)"),
], ids=["silent", "partial headers", "1 byte of a 100-byte body"])
def test_slow_clients_are_cut_off(tight, sent, status, message):
    sock = _connect(tight)
    start = time.monotonic()
    sock.sendall(sent)
    got, headers, body, closed = _response(sock)
    elapsed = time.monotonic() - start
    assert (got, body["error"]["message"], body["error"]["type"]) == (status, message, "timeout_error")
    assert headers["connection"] == "close" and closed
    assert TIMEOUT * 0.9 < elapsed < TIMEOUT + 1.0, f"cut off after {elapsed:.2f} s"
    sock.close()
    _assert_healthy_and_clean(tight)


def test_an_idle_kept_alive_connection_is_closed(tight):
    sock = _connect(tight)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    start = time.monotonic()
    status, headers, _, closed = _response(sock)  # waits for the close after the response
    elapsed = time.monotonic() - start
    assert status == 200 and closed and headers.get("connection") != "close"  # kept alive, then closed idle
    assert TIMEOUT * 0.9 < elapsed < TIMEOUT + 1.0, f"closed after {elapsed:.2f} s"
    sock.close()
    _assert_healthy_and_clean(tight)


def test_beyond_the_cap_the_longest_idle_connections_are_shed_and_all_released(tight):
    deadline = time.monotonic() + 5
    while _connections(tight) and time.monotonic() < deadline:
        time.sleep(0.05)
    idle = [_connect(tight) for _ in range(MAX_CONNECTIONS)]
    extra = [_connect(tight) for _ in range(MAX_CONNECTIONS)]  # each newcomer sheds the oldest idle one
    for sock in idle:
        status, headers, body, closed = _response(sock)
        assert status == 503 and headers["retry-after"] == "1" and closed
        assert body["error"]["message"] == f"too many open connections (limit {MAX_CONNECTIONS}); try again shortly"
    for sock in extra:  # the silent newcomers hear 408 once the header timeout passes
        assert _response(sock)[0] == 408
    for sock in idle + extra:
        sock.close()
    deadline = time.monotonic() + 5
    while _connections(tight) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _connections(tight) == 0, "connections still held"
    _assert_healthy_and_clean(tight)


def test_a_maximal_body_does_not_stall_the_event_loop(tight):
    """A body at the limit (here 1 MiB of token ids) is parsed and refused while /health keeps answering."""
    ids = b"5," * (MAX_BYTES // 2 - 20)
    raw = b'{"input_ids": [' + ids + b"5]}"
    assert len(raw) <= MAX_BYTES
    latencies, done = [], threading.Event()

    def probe():
        with httpx.Client(base_url=tight.url, timeout=10) as client:
            while not done.is_set():
                start = time.monotonic()
                assert client.get("/health").status_code == 200
                latencies.append(time.monotonic() - start)

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        r = httpx.post(f"{tight.url}/generate", content=raw, headers={"content-type": "application/json"},
                       timeout=30)
    finally:
        done.set()
        thread.join()
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"prompt ({MAX_BYTES // 2 - 19} tokens)")
    assert max(latencies) < 1.0, f"/health took up to {max(latencies):.2f} s"
    _assert_healthy_and_clean(tight)
