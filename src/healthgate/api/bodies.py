"""Request bodies: whose, how large, how fast (SPEC §7, "Bounded memory and
descriptors").

FastAPI reads a body before the route runs - before the route looks at the
token - and nothing bounded how long that took: 1,100 connections sending
bodies slowly, without a token, made every route answer 503 (``/healthz``
included), and two slow manifests from one producer held both manifest
slots, so every tenant's apply waited 60 s. :class:`BodyGate`, ASGI
middleware in front of every route, takes a request that carries a body
(a write) through four steps before any route sees it:

1. **who**: the principal, from the ``Authorization`` header alone - 401
   (no token, an unknown one) or 403 (a viewer's or metrics token: it may
   write nothing) without reading a byte of the body;
2. **how large**: at most the route's limit (``max_body_bytes``, or
   ``max_manifest_bytes`` for ``/v1/apply`` and ``/v1/delete``) - 413, from
   the ``Content-Length`` when it says so, else as the bytes arrive;
3. **how much at once**: every body being read or held, all requests
   together, within ``max_body_bytes_held`` (503 beyond), and at most
   ``max_bodies_per_principal`` of one token's at once (429 beyond);
4. **how fast**: the whole body within ``body_timeout`` of the request's
   start - 408 beyond.

Each refusal closes the connection (``Connection: close``: the rest of the
body is never read). The body, read whole, is then handed to the route as
one message; so a manifest is read *before* it takes one of the few
manifest slots (api/state.py), and a slow one holds nothing but its own
connection, for ``body_timeout`` at most.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from healthgate.api.auth import Access, AccessError
from healthgate.api.errors import error_response

BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass(frozen=True, slots=True)
class BodyLimits:
    limit_for: Callable[[str], int]  # a path's largest body
    timeout: float = 30.0  # the whole body within this of the request's start
    max_held: int = 64 * 1024 * 1024  # bodies read or held, all requests together
    max_per_principal: int = 8  # bodies of one token read or held at once


class _Refused(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class BodyGate:
    """ASGI middleware enforcing the module doc's four steps."""

    def __init__(self, app: ASGIApp, access: Callable[[], Access], limits: BodyLimits) -> None:
        self.app = app
        self.access = access
        self.limits = limits
        self.held = 0  # bytes of bodies read or held now
        self.by_principal: dict[str, int] = {}
        self.refused: dict[int, int] = {}  # code -> how many (for tests and the curious)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _carries_body(scope):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        held = _Held()
        key: str | None = None
        try:
            key = self._admit(headers)
            limit = self.limits.limit_for(scope["path"])
            length = _length(headers)
            if length is not None and length > limit:
                raise _Refused(413, f"request body larger than {limit} bytes")
            self._reserve(held, length or 0)
            body = await self._read(receive, limit, held)
        except _Refused as exc:
            self._release(held, key)
            self.refused[exc.code] = self.refused.get(exc.code, 0) + 1
            response = error_response(exc.code, exc.message)
            response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        except _Gone:
            self._release(held, key)
            return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            await self.app(scope, replay, send)
        finally:
            self._release(held, key)

    def _admit(self, headers: dict[bytes, bytes]) -> str:
        """Who sends this body (step 1), counted against its share (step 3)."""
        authorization = headers.get(b"authorization")
        try:
            who = self.access().authenticate(
                authorization.decode("latin-1") if authorization is not None else None
            )
        except AccessError as exc:
            raise _Refused(exc.code, exc.message) from None
        if not who.may_write:
            raise _Refused(403, f"this token ({who.role} of {who.project}) may not write")
        key = who.key
        n = self.by_principal.get(key, 0)
        if n >= self.limits.max_per_principal:
            raise _Refused(
                429,
                f"this token has {n} request bodies being read or worked on, as many as one "
                "token may: try again when one is answered",
            )
        self.by_principal[key] = n + 1
        return key

    def _reserve(self, held: _Held, n: int) -> None:
        if self.held + n > self.limits.max_held:
            raise _Refused(
                503, "the API holds as many request bodies as it may: try again in a moment"
            )
        self.held += n
        held.bytes += n

    def _release(self, held: _Held, key: str | None) -> None:
        self.held -= held.bytes
        held.bytes = 0
        if key is not None:
            left = self.by_principal.get(key, 1) - 1
            if left > 0:
                self.by_principal[key] = left
            else:
                self.by_principal.pop(key, None)

    async def _read(self, receive: Receive, limit: int, held: _Held) -> bytes:
        """The whole body within the deadline (step 4)."""
        parts: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.limits.timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _Gone
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise _Refused(413, f"request body larger than {limit} bytes")
                    if size > held.bytes:  # (no Content-Length, or more than it said)
                        self._reserve(held, size - held.bytes)
                    if chunk:
                        parts.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(parts)
        except TimeoutError:
            raise _Refused(
                408, f"the request body did not arrive within {self.limits.timeout:g} s"
            ) from None


class _Held:
    """The bytes one request's body has reserved."""

    __slots__ = ("bytes",)

    def __init__(self) -> None:
        self.bytes = 0


class _Gone(Exception):
    """The client went away while its body was read."""


def _carries_body(scope: Scope) -> bool:
    if scope.get("method") not in BODY_METHODS:
        return False
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            return value.strip() not in (b"", b"0")
        if name == b"transfer-encoding":
            return True
    return False


def _length(headers: dict[bytes, bytes]) -> int | None:
    value = headers.get(b"content-length")
    if value is None or not value.strip().isdigit():
        return None
    return int(value)
