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

One sweep a second checks every HTTP connection (a timestamp compare each),
so nothing is added per request but a clock read.
"""

from __future__ import annotations

import asyncio
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
    ) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.idle_timeout = idle_timeout
        self.clock = clock
        self.open = 0
        self.refused = 0
        self._last_log = float("-inf")
        self._watched: set[Expiring] = set()
        self._sweeper: asyncio.TimerHandle | None = None

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        """A client connected: True to serve it, False (and it is closed) over the cap."""
        if self.open >= self.max_connections:
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
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1

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
