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
* **one source address holds at most** ``max_per_source`` connections
  (:class:`SourceConnections`, kept by the API's protocol: a connection
  over it is closed at once);
* **event streams per principal**: at most ``max_streams_per_principal``
  live streams per token's (project, role) - 429 beyond
  (api/events.py).
"""

from __future__ import annotations

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
