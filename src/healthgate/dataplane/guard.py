"""Client connections kept within bounds: a cap across every listener, and
timeouts for HTTP heads that never complete and for idle keep-alive
connections.

Without them one client holding ~20,000 idle connections exhausted the
process's file descriptors, and the API and the probes stopped with the
data plane. So:

* **A cap** (``max_connections``) on open client connections of all front
  ends together, below the descriptor limit, so that descriptors remain for
  upstream connections, probes, the store and the API. A connection over the
  cap is closed at once; that is counted (``refused_cap``) and logged at most
  once every 10 s.
* **A header timeout** (``header_timeout``): an HTTP request head must be
  whole within this long of its first byte, or the connection gets 408 and is
  closed (a slowloris holds nothing for long).
* **An idle timeout** (``idle_timeout``): a keep-alive HTTP connection with no
  request for this long is closed.
* **Buffered request bodies, all connections together** (``max_buffered``):
  a body that would pass it gets 503 (dataplane/http_limits.py has the
  per-connection bound and the body timeouts).

One sweep a second checks every HTTP connection (a timestamp compare each),
so nothing is added per request but a clock read.

The guard also knows every admitted connection, so that a stop can give
them a few seconds to finish and then close what is left (:meth:`drain`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol, cast

log = logging.getLogger("healthgate.dataplane")

SWEEP_EVERY = 1.0


class Expiring(Protocol):
    def expire(self, now: float, header_timeout: float, idle_timeout: float) -> None:
        """Close the connection if its head or its idleness is overdue."""


class ConnectionGuard:
    def __init__(
        self,
        max_connections: int,
        header_timeout: float = 10.0,
        idle_timeout: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        max_buffered: int = 256 * 1024 * 1024,
    ) -> None:
        self.max_connections = max_connections
        self.max_buffered = max_buffered
        self.buffered = 0  # request-body bytes held by every connection together
        self.header_timeout = header_timeout
        self.idle_timeout = idle_timeout
        self.clock = clock
        self.refused = 0
        self._open: set[asyncio.BaseTransport] = set()
        self._emptied: asyncio.Event | None = None
        self._last_log = float("-inf")
        self._watched: set[Expiring] = set()
        self._sweeper: asyncio.TimerHandle | None = None

    def take_buffer(self, n: int) -> bool:
        """``n`` more bytes of request bodies held: False (nothing taken) past the bound."""
        if self.buffered + n > self.max_buffered:
            return False
        self.buffered += n
        return True

    def release_buffer(self, n: int) -> None:
        self.buffered = max(0, self.buffered - n)

    @property
    def open(self) -> int:
        return len(self._open)

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        """A client connected: True to serve it, False (and it is closed) over the cap."""
        if len(self._open) >= self.max_connections:
            self.refused += 1
            now = self.clock()
            if now - self._last_log >= 10.0:
                self._last_log = now
                log.warning(
                    "front ends hold %d connections, the cap (--max-connections): "
                    "new ones are closed at once (%d so far)",
                    self.open,
                    self.refused,
                )
            cast(asyncio.Transport, transport).abort()
            return False
        self._open.add(transport)
        return True

    def release(self, transport: asyncio.BaseTransport) -> None:
        self._open.discard(transport)
        if not self._open and self._emptied is not None:
            self._emptied.set()

    async def drain(self, grace: float) -> int:
        """Wait up to ``grace`` seconds for the open connections to end, then
        close the rest at once; how many were closed."""
        if self._open and grace > 0:
            self._emptied = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._emptied.wait()
        left = list(self._open)
        for transport in left:
            cast(asyncio.Transport, transport).abort()
        self._open.clear()
        return len(left)

    def watch(self, conn: Expiring) -> None:
        self._watched.add(conn)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_EVERY, self._sweep)

    def unwatch(self, conn: Expiring) -> None:
        self._watched.discard(conn)

    def _sweep(self) -> None:
        self._sweeper = None
        now = self.clock()
        for conn in list(self._watched):
            conn.expire(now, self.header_timeout, self.idle_timeout)
        if self._watched:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_EVERY, self._sweep)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
