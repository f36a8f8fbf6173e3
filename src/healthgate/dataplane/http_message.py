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
        "held_head",
        "http11",
        "hung",
        "keep_alive",
        "last_error",
        "method",
        "refusal",
        "size",
        "url",
    )

    def __init__(self) -> None:
        self.url = bytearray()
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = bytearray()
        self.method = "GET"
        self.keep_alive = True
        self.http11 = True  # (an HTTP/1.0 client gets no interim answers)
        self.head_bytes = 0
        self.held_head = 0  # its head's bytes while it waits in the queue
        self.refusal: bytes | None = None  # not a request: the answer that ends the connection
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
            if low in HOP_BY_HOP or low in named or low in SPOOFABLE or b"_" in low:
                continue  # ("_": a name that may mean "-" to a backend - nginx drops them)
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


def check_head(req: Request) -> tuple[int, str, str] | None:
    """What the proxy answers instead of forwarding a request whose head it
    may not pass on - (status, reason, message) - or None; an absolute-form
    target is made origin-form here, its authority the one Host.

    * HTTP/1.1 needs exactly one ``Host`` (RFC 9112 §3.2: 400 without one
      or with two - which one a backend would read is anyone's guess);
    * a transfer coding other than ``chunked`` alone (``deflate, chunked``)
      is not understood: 501, as nginx answers (the parser would take the
      chunks off and forward a body still deflated, as if it were plain);
    * ``http://host/path`` - the target's authority wins over ``Host``
      (RFC 9112 §3.2.2), so it is forwarded as ``/path`` with that Host,
      never with the client's other one; a userinfo part is refused.
    """
    hosts = [v for n, v in req.headers if n.lower() == b"host"]
    codings: list[bytes] = []
    for name, value in req.headers:
        if name.lower() == b"transfer-encoding":
            codings += [c.strip().lower() for c in value.split(b",") if c.strip()]
    if codings and codings != [b"chunked"]:
        return (
            501,
            "Not Implemented",
            "only the chunked transfer coding is understood "
            f"(got {b', '.join(codings)[:80].decode('latin-1')!r})",
        )
    url = bytes(req.url)
    low = url[:8].lower()
    if low.startswith((b"http://", b"https://")):
        rest = url[url.index(b"//") + 2 :]
        cut = min((i for i in (rest.find(b"/"), rest.find(b"?")) if i >= 0), default=len(rest))
        authority, path = rest[:cut], rest[cut:]
        if not authority or b"@" in authority:
            return 400, "Bad Request", "an absolute-form target needs a host and no userinfo"
        req.url = bytearray(path if path.startswith(b"/") else b"/" + path)
        req.headers = [(n, v) for n, v in req.headers if n.lower() != b"host"]
        req.headers.insert(0, (b"Host", authority))
        return None
    if len(hosts) > 1:
        return 400, "Bad Request", "a request may have one Host header, not several"
    if not hosts and req.http11:
        return 400, "Bad Request", "an HTTP/1.1 request needs a Host header (RFC 9112 §3.2)"
    return None


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
