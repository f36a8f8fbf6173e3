"""The API's capacity, shared fairly (SPEC §7, "Bounded memory and
descriptors").

uvicorn refuses new requests past one limit for everything; a single viewer
opening event streams, or a client reopening unfinished heads, used to take
all of it - and with it the health endpoints that external load balancers
check, so they dropped every region. So:

* **health answers have reserved room**: ``/healthz``, ``/readyz`` and the
  forwarding rules' ``.../healthz`` may use ``reserved`` requests beyond
  ``max_requests``; everything else gets 503 past ``max_requests``
  (:class:`RequestCapacity`, ASGI middleware);
* **a flood of connections does not hold the API**: past
  ``max_connections`` open connections, a new one takes the place of the
  one that has waited longest for a request head (slow or idle: what a
  flood holds); when every one is being answered, ``reserved`` more are
  accepted whose first request must be a health answer's (anything else
  gets 503 and the connection closes) - so the health endpoints stay
  reachable (:class:`OpenConnections`, kept by the API's protocol,
  api/listener.py);
* **one source address holds at most** ``max_per_source`` connections
  (:class:`SourceConnections`, kept by the API's protocol: a connection
  over it is closed at once);
* **event streams per token**: at most ``max_streams_per_principal``
  live streams per token - 429 beyond (api/events.py).
"""

from __future__ import annotations

from typing import Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

from healthgate.api.errors import error_response


def is_health_path(path: str) -> bool:
    return path in ("/healthz", "/readyz") or (
        path.startswith("/v1/projects/") and path.endswith("/healthz")
    )


class RequestCapacity:
    """ASGI middleware: requests in flight, with room kept for health answers."""

    def __init__(self, app: ASGIApp, max_requests: int, reserved: int) -> None:
        self.app = app
        self.max_requests = max_requests
        self.reserved = reserved
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_requests
        if is_health_path(scope.get("path", "")):
            limit += self.reserved
        if self.in_flight >= limit:
            await error_response(
                503, f"the API is answering {self.in_flight} requests, as many as it may"
            )(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class SourceConnections:
    """Open API connections per source address (one per server)."""

    def __init__(self, max_per_source: int) -> None:
        self.max_per_source = max_per_source
        self.by_source: dict[str, int] = {}
        self.refused = 0

    def admit(self, source: str) -> bool:
        n = self.by_source.get(source, 0)
        if n >= self.max_per_source:
            self.refused += 1
            return False
        self.by_source[source] = n + 1
        return True

    def release(self, source: str) -> None:
        left = self.by_source.get(source, 1) - 1
        if left > 0:
            self.by_source[source] = left
        else:
            self.by_source.pop(source, None)


class Waiting(Protocol):
    def waiting(self) -> bool:
        """No request of this connection is being answered (it waits for a head)."""

    def evict(self) -> None:
        """Close it: a newer connection needs its place."""


class OpenConnections:
    """The API's open connections (one per server). Past ``max_connections``
    a new connection takes the place of the one that has waited longest for
    a request head (a slow or idle one: what a flood of connections holds),
    or, when every connection is being answered, one of ``reserved`` more
    places kept for health answers."""

    def __init__(self, max_connections: int, reserved: int) -> None:
        self.max_connections = max_connections
        self.reserved = reserved
        self.members: dict[Waiting, None] = {}  # (oldest first)
        self.refused = 0
        self.evicted = 0

    @property
    def open(self) -> int:
        return len(self.members)

    def admit(self, conn: Waiting) -> bool | None:
        """A new connection: True (any request), False (a health answer's
        only: it is in the reserve) or None (refused: close it)."""
        if len(self.members) >= self.max_connections:
            oldest = next((c for c in self.members if c.waiting()), None)
            if oldest is not None:
                del self.members[oldest]
                self.evicted += 1
                oldest.evict()
            elif len(self.members) >= self.max_connections + self.reserved:
                self.refused += 1
                return None
            else:
                self.members[conn] = None
                return False
        self.members[conn] = None
        return True

    def release(self, conn: Waiting) -> None:
        self.members.pop(conn, None)


def is_health_request_line(line: bytes) -> bool:
    """``GET /healthz HTTP/1.1`` and the like: may a reserved connection ask it?"""
    parts = line.split(b" ")
    if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD"):
        return False
    path = parts[1].split(b"?", 1)[0].decode("latin-1")
    return is_health_path(path)
