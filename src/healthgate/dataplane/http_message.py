"""HTTP/1.1 messages as the L7 front end handles them: what a request is,
which requests the fast path may forward as they are, how a request is
written to an upstream, and the short answers the proxy gives itself.

Framing is httptools' (the llhttp parser uvicorn uses): the proxy feeds it
bytes and gets callbacks (dataplane/http.py). Here is what the proxy needs
around that:

* :class:`Request` - one parsed request, buffered whole (so it can be
  retried in the next region), and :meth:`Request.serialize`: the request
  line, the headers but the hop-by-hop ones (``http_scan.HOP_BY_HOP``, and every
  header named by ``Connection``), ``X-Forwarded-For`` with the client
  appended, the body with its length;
* :data:`IDEMPOTENT` and :data:`RETRY_STATUSES` - what may be tried again;
* :func:`simple_response` - the proxy's own short answers (400, 408, 413,
  431, 502, 503).
"""

from __future__ import annotations

from collections.abc import Sequence

from healthgate.http_scan import HOP_BY_HOP, SPOOFABLE

Address = tuple[str, int]
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
RETRY_STATUSES = frozenset({502, 503, 504})


class Request:
    __slots__ = (
        "body",
        "data",
        "failed",
        "groups",
        "head_bytes",
        "headers",
        "hung",
        "keep_alive",
        "last_error",
        "method",
        "size",
        "url",
    )

    def __init__(self) -> None:
        self.url = bytearray()
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = bytearray()
        self.method = "GET"
        self.keep_alive = True
        self.head_bytes = 0
        self.size = 0  # the body's bytes (held in ``body``, then in ``data``)
        # set when the fast path made the first try: what it sent, the route
        # it used (when it had one), the endpoint not to try again, the
        # region not to try again (one that hung: all its candidates), and
        # why. By address, not by position: without a recorded route the
        # general path chooses again, and the route may have moved meanwhile
        # (the hung region no longer first, but a fallback).
        self.data: bytes | None = None
        self.groups: Sequence[Sequence[Address]] | None = None
        self.failed: Address | None = None
        self.hung: Sequence[Address] | None = None
        self.last_error = ""

    def serialize(self, client_ip: str) -> bytes:
        """The request as the upstream gets it (see the module doc); the
        body is moved into it, not copied twice (its size stays in ``size``)."""
        if self.data is not None:
            return self.data
        out = bytearray(f"{self.method} ".encode())
        out += self.url
        out += b" HTTP/1.1\r\n"
        forwarded = None
        named = _connection_named(self.headers)
        for name, value in self.headers:
            low = name.lower()
            if low in HOP_BY_HOP or low in named or low in SPOOFABLE:
                continue
            if low == b"x-forwarded-for":
                forwarded = value
                continue
            out += name + b": " + value + b"\r\n"
        xff = (forwarded + b", " if forwarded else b"") + client_ip.encode()
        out += b"X-Forwarded-For: " + xff + b"\r\n"
        if self.body or self.method in ("POST", "PUT", "PATCH"):
            out += b"Content-Length: %d\r\n" % len(self.body)
        out += b"\r\n"
        self.size = len(self.body)
        data = b"".join((out, self.body))
        self.body = bytearray()  # (held once, in data, while it is tried)
        self.data = data
        return data


def _connection_named(headers: Sequence[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Headers a client named in ``Connection`` are hop-by-hop too (RFC 9110 §7.6.1)."""
    named: set[bytes] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            named.update(t.strip().lower() for t in value.split(b",") if t.strip())
    return frozenset(named)


def simple_response(status: int, reason: str, message: str, close: bool = False) -> bytes:
    body = (message + "\n").encode()
    conn = b"Connection: close\r\n" if close else b""
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n".encode()
        + conn
        + b"X-Healthgate: proxy\r\n\r\n"
        + body
    )
