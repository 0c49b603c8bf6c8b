"""Safe local defaults: Host names other than localhost and IP addresses are refused (DNS rebinding), so are
browser requests from other origins (cross-site POSTs), unless configured; the API docs are off unless
asked for. Every refusal is a 403 with the usual error body, and leaves the server healthy and clean."""

import socket

import httpx
import pytest

from conftest import make_engine, start_server
from runtime.server.site_guard import SitePolicy

BODY = {"input_ids": [2, 40, 41], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
ALLOWED_ORIGIN = "http://localhost:8080"


@pytest.fixture(scope="module")
def configured():
    srv = start_server(make_engine(), allowed_hosts=("runtime", "api.example"), allowed_origins=(ALLOWED_ORIGIN,),
                       enable_api_docs=True)
    yield srv
    srv.stop()


def _port(srv) -> int:
    return int(srv.url.rsplit(":", 1)[1])


def _check(srv, headers: dict, status: int, message: str | None = None) -> httpx.Response:
    r = httpx.post(f"{srv.url}/generate", json=BODY, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    if message is not None:
        assert r.json()["error"] == {"message": message, "type": "permission_error", "code": 403}
    assert httpx.get(f"{srv.url}/health", timeout=10).json()["status"] == "ok"
    srv.wait_idle_clean()
    return r


@pytest.mark.parametrize("host", ["evil.example", "evil.example:30000", "attacker.127.0.0.1.nip.io", "127.0.0.1:x"])
def test_unknown_host_names_are_refused(live, host):
    _check(live, {"Host": host}, 403, f"Host {host!r} is not served here: use an IP address or localhost, or "
                                      "start the server with --allowed-hosts naming it")


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1", "app.localhost:9", "127.0.0.1:5", "[::1]:8", "10.1.2.3"])
def test_local_names_and_ip_addresses_are_served(live, host):
    _check(live, {"Host": host}, 200)


def test_a_request_without_host_is_served(live):
    with socket.create_connection(("127.0.0.1", _port(live)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://localhost:8080", "https://127.0.0.1"])
def test_cross_origin_requests_are_refused(live, origin):
    _check(live, {"Origin": origin}, 403, f"cross-origin request from {origin!r} refused; start the server with "
                                          f"--allowed-origins {origin} to allow it")


def test_dns_rebinding_is_refused(live):
    port = _port(live)
    _check(live, {"Host": f"rebind.example:{port}", "Origin": f"http://rebind.example:{port}"}, 403,
           f"Host 'rebind.example:{port}' is not served here: use an IP address or localhost, or start the "
           "server with --allowed-hosts naming it")


def test_same_origin_is_served(live):
    port = _port(live)
    _check(live, {"Host": f"localhost:{port}", "Origin": f"http://localhost:{port}"}, 200)


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_api_docs_are_off_by_default(live, path):
    r = httpx.get(f"{live.url}{path}")
    assert r.status_code == 404 and r.json()["error"]["message"] == f"no route {path}"
    assert httpx.get(f"{live.url}/health", timeout=10).json()["status"] == "ok"
    live.wait_idle_clean()


def test_configured_hosts_origins_and_docs(configured):
    _check(configured, {"Host": "runtime:30000"}, 200)
    _check(configured, {"Host": "other.example"}, 403)
    r = _check(configured, {"Origin": ALLOWED_ORIGIN}, 200)
    assert r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    _check(configured, {"Origin": "http://localhost:8081"}, 403)
    preflight = {"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}
    r = httpx.options(f"{configured.url}/generate", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    r = httpx.options(f"{configured.url}/generate", headers={**preflight, "Origin": "http://evil.example"})
    assert r.status_code == 403
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{configured.url}{path}").status_code == 200


def test_a_server_bound_to_every_interface_checks_host_only_when_names_are_given():
    assert SitePolicy("0.0.0.0").host_refusal("runtime:30000") is None
    assert SitePolicy("::").host_refusal("anything.example") is None
    strict = SitePolicy("0.0.0.0", allowed_hosts=("runtime",))
    assert strict.host_refusal("runtime:30000") is None and strict.host_refusal("10.0.0.7:30000") is None
    assert strict.host_refusal("evil.example").startswith("Host 'evil.example' is not served here")
    assert SitePolicy("api.internal").host_refusal("API.internal:80") is None
    assert SitePolicy("0.0.0.0").origin_refusal("http://evil.example", "runtime:30000") is not None
