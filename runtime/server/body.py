"""Reading a JSON request body within bounds: the content type, the size, the time it may take.

- 415 unless `Content-Type: application/json` (UTF-8): a browser page can send `text/plain` or a form to
  any server without asking; it cannot send JSON cross-origin without a CORS preflight that we refuse.
- 413 when the declared Content-Length is over the limit, before a byte of the body is read; for a body of
  undeclared length (chunked), as soon as the bytes received pass the limit.
- 408 when the body has not arrived `timeout_s` after the headers.
413 and 408 close the connection: the rest of the body is never read, so the client cannot go on sending it.
"""

from __future__ import annotations

import anyio
from starlette.requests import ClientDisconnect, Request

from runtime.server.protocol import APIError

CLOSE = {"Connection": "close"}


def require_json(request: Request) -> None:
    ctype = request.headers.get("content-type")
    hint = "send the body with `Content-Type: application/json` (curl: -H 'Content-Type: application/json')"
    if ctype is None:
        raise APIError(415, f"missing Content-Type: {hint}", "invalid_request_error")
    media, _, params = ctype.partition(";")
    if media.strip().lower() != "application/json":
        raise APIError(415, f"Content-Type {media.strip()!r} is not accepted: {hint}", "invalid_request_error")
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise APIError(415, f"charset {value.strip()!r} is not accepted: JSON bodies are UTF-8",
                           "invalid_request_error")


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(f"Content-Length {int(declared)}", max_bytes)
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise _too_large(f"more than {max_bytes} bytes", max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s (received {size} bytes)",
                       "timeout_error", headers=CLOSE) from None
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the body", headers=CLOSE) from None
    return b"".join(chunks)


def _too_large(what: str, max_bytes: int) -> APIError:
    return APIError(413, f"request body too large: {what}; the limit is {max_bytes} bytes (--max-request-bytes)",
                    "invalid_request_error", headers=CLOSE)
