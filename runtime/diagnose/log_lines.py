"""Production log text, line by line: lines of bounded length from plain or gzip streams, each split into
the JSON values it holds and the fragments that are not (cut short, garbled), and log-supplied strings made
safe to print. Knows nothing of which events a line carries (from_log.py does)."""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from typing import BinaryIO

MAX_LINE_BYTES = 1 << 20  # a key-change record is about 1 KiB; longer lines are skipped unread
_CHUNK = 1 << 16
_MAX_DECODES = 64  # JSON decode attempts per line (records glued together, or after a cut one)
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


def read_lines(stream: BinaryIO) -> Iterator[bytes | None]:
    """Each line's bytes (without the newline), or None for a line over MAX_LINE_BYTES. A gzip stream (by
    its magic bytes) is decompressed; its errors (a cut or corrupt member) propagate as OSError, EOFError or
    zlib.error after the lines read so far."""
    head = stream.read(2)
    if head == b"\x1f\x8b":
        return _lines(gzip.GzipFile(fileobj=_Prepend(head, stream)))
    return _lines(_Prepend(head, stream))


def _lines(stream) -> Iterator[bytes | None]:
    """Split a stream at newlines; a line over MAX_LINE_BYTES is never buffered, only reported as None."""
    pending, skipping = bytearray(), False
    while chunk := stream.read(_CHUNK):
        start = 0
        while (nl := chunk.find(b"\n", start)) >= 0:
            if skipping or len(pending) + nl - start > MAX_LINE_BYTES:
                yield None
            else:
                pending += chunk[start:nl]
                yield bytes(pending)
            pending.clear()
            skipping, start = False, nl + 1
        if not skipping:
            pending += chunk[start:]
            if len(pending) > MAX_LINE_BYTES:
                pending.clear()
                skipping = True
    if skipping:
        yield None
    elif pending:
        yield bytes(pending)  # a last line without its newline: complete or cut, the parser will tell


def _decode(text: str, pos: int):
    """(object, end, None) or (None, pos, why) for the JSON value starting at `pos`."""
    try:
        obj, end = _DECODER.raw_decode(text, pos)
        return obj, end, None
    except json.JSONDecodeError as exc:
        rest = text[exc.pos:]
        cut = (exc.pos >= len(text) or exc.msg.startswith("Unterminated string")
               or any(lit.startswith(rest) for lit in _LITERALS))
        return None, pos, "truncated" if cut else "not_json"
    except (ValueError, RecursionError):  # an integer over Python's digit limit; nesting over the parser's depth
        return None, pos, "not_json"


def split_line(text: str) -> tuple[list[tuple[str, object]], str]:
    """Split one line into pieces, each ("json", object) or (why unusable, the fragment's text), and the text
    before the first JSON object (a collector's prefix, or junk)."""
    obj, end, why = _decode(text, 0) if text[:1] in "[{" else (None, 0, "not_json")
    if why is None and end == len(text):
        return [("json", obj)], ""  # the ordinary line
    start = text.find("{")
    if start < 0:
        return [(_bare_kind(text), text)], ""
    pieces, pos, budget = [], start, _MAX_DECODES
    while pos < len(text):
        if budget <= 0:
            pieces.append(("not_json", text[pos:]))  # more glued objects than a log line holds
            break
        obj, end, why = _decode(text, pos)
        budget -= 1
        if why is not None:  # cut short: look for a complete record glued after it (its writer died mid-line)
            nxt = text.find('{"', pos + 1)
            while nxt >= 0 and budget > 0:
                obj, end, again = _decode(text, nxt)
                budget -= 1
                after = _SPACE.match(text, end).end()
                if again is None and (after == len(text) or text[after] == "{"):
                    break
                nxt = text.find('{"', nxt + 1)
            else:
                pieces.append((why, text[pos:]))
                break
            pieces.append(("truncated", text[pos:nxt]))
        pieces.append(("json", obj))
        pos = _SPACE.match(text, end).end()
        if pos < len(text) and text[pos] != "{":
            pieces.append(("not_json", text[pos:]))  # junk after a complete object
            break
    return pieces, text[:start]


def _bare_kind(text: str) -> str:
    """A line with no object in it: a JSON scalar or array (not ours), or not JSON at all."""
    try:
        json.loads(text)
        return "other_json"
    except (ValueError, RecursionError):
        return "not_json"


def clean(value: object, limit: int = 4000) -> str | None:
    """A log-supplied string made safe to print: ASCII, control characters escaped, bounded length."""
    if not isinstance(value, str):
        return None
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", value[:limit].encode("ascii", "backslashreplace")
                        .decode("ascii"))
    return text + ("..." if len(value) > limit else "")


class _Prepend:
    """A binary stream with bytes already read put back in front."""

    def __init__(self, head: bytes, stream):
        self._head, self._stream = head, stream

    def read(self, n: int = -1) -> bytes:
        if not self._head:
            return self._stream.read(n)
        if 0 <= n < len(self._head):
            out, self._head = self._head[:n], self._head[n:]
            return out
        out, self._head = self._head, b""
        return out + self._stream.read(n - len(out) if n >= 0 else -1)
