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
* **A limit per source address** (``max_per_source``, by default an eighth
  of the cap, at least 64): one client address holding thousands of idle
  connections used to take every slot of the cap (40 of 49 requests of a
  normal client were refused meanwhile); now it takes its share, and the
  others keep theirs - as nginx's ``limit_conn`` or HAProxy's
  ``src_conn_cur`` would have it.
* **UDP sessions have a budget of their own** (``max_udp_sessions``): each
  holds an upstream socket, so they are bounded (a flood of source ports
  used to run the process out of descriptors, and probes failed) - but
  apart from the connections' cap, which a few hundred spoofed datagrams
  used to fill for every TCP and HTTP front end of every tenant. A
  session is admitted within its source address's limit and its prefix's
  (``max_sessions_per_prefix``, by /24 for IPv4 and /64 for IPv6: a
  spoofer has many addresses of one network); when the budget is full the
  session idle longest (at least ``SESSION_EVICT_IDLE`` seconds) gives
  way, else the new one is refused.
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
import ipaddress
import logging
import time
from collections.abc import Callable
from typing import Protocol, cast

log = logging.getLogger("healthgate.dataplane")

SWEEP_EVERY = 1.0
SESSION_EVICT_IDLE = 1.0  # a UDP session idle this long may give way under pressure


def prefix_of(source: str) -> str:
    """The network a source address is counted in: its /24 (IPv4) or /64 (IPv6)."""
    try:
        addr = ipaddress.ip_address(source)
    except ValueError:
        return source
    bits = 24 if addr.version == 4 else 64
    return str(ipaddress.ip_network(f"{addr}/{bits}", strict=False))


class SessionOwner(Protocol):
    """A UDP listener, whose idlest session may give way (dataplane/udp.py)."""

    def idlest(self) -> float | None:
        """When its session idle longest was last active (None: it has none)."""

    def evict_idlest(self) -> None: ...


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
        max_per_source: int = 0,
        max_udp_sessions: int = 0,
        max_sessions_per_prefix: int = 0,
    ) -> None:
        self.max_connections = max_connections
        self.max_per_source = max_per_source or max(64, max_connections // 8)
        self.max_udp_sessions = max_udp_sessions or max(256, max_connections // 4)
        self.max_sessions_per_prefix = max_sessions_per_prefix or 4 * self.max_per_source
        self.max_buffered = max_buffered
        self.buffered = 0  # request-body bytes held by every connection together
        self.header_timeout = header_timeout
        self.idle_timeout = idle_timeout
        self.clock = clock
        self.refused = 0
        self.refused_source = 0
        self._open: dict[asyncio.BaseTransport, str] = {}  # connection -> its source address
        self._by_source: dict[str, int] = {}  # source -> its connections
        self.sessions = 0  # UDP sessions (each holds an upstream socket)
        self._sessions_by_source: dict[str, int] = {}
        self._sessions_by_prefix: dict[str, int] = {}
        self.session_owners: set[SessionOwner] = set()
        self.sessions_refused = 0
        self.sessions_evicted = 0
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

    def _room(self, source: str) -> str | None:
        """Why one more connection of ``source`` may not come in (None: it may)."""
        if len(self._open) >= self.max_connections:
            self.refused += 1
            return (
                f"front ends hold {len(self._open)} connections, the cap: new ones are "
                f"refused ({self.refused} so far)"
            )
        if self._by_source.get(source, 0) >= self.max_per_source:
            self.refused_source += 1
            return (
                f"{source} holds {self.max_per_source} connections, as many as one "
                f"source may: its new ones are refused ({self.refused_source} so far)"
            )
        return None

    def _say(self, why: str) -> None:
        now = self.clock()
        if now - self._last_log >= 10.0:
            self._last_log = now
            log.warning("%s", why)

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        """A client connected: True to serve it, False (and it is closed)
        over the cap or its source's limit."""
        peer = transport.get_extra_info("peername")
        source = str(peer[0]) if peer else ""
        why = self._room(source)
        if why is not None:
            self._say(why)
            cast(asyncio.Transport, transport).abort()
            return False
        self._open[transport] = source
        self._by_source[source] = self._by_source.get(source, 0) + 1
        return True

    def release(self, transport: asyncio.BaseTransport) -> None:
        source = self._open.pop(transport, None)
        if source is not None:
            self._count_down(source)
        if not self._open and self._emptied is not None:
            self._emptied.set()

    def admit_session(self, source: str) -> bool:
        """A new UDP session of ``source``: within its address's and its
        prefix's limits, and the sessions' budget (see the module doc)?"""
        prefix = prefix_of(source)
        why = None
        if self._sessions_by_source.get(source, 0) >= self.max_per_source:
            why = f"{source} holds {self.max_per_source} UDP sessions, as many as one source may"
        elif self._sessions_by_prefix.get(prefix, 0) >= self.max_sessions_per_prefix:
            why = (
                f"{prefix} holds {self.max_sessions_per_prefix} UDP sessions, as many as one "
                "network may"
            )
        elif self.sessions >= self.max_udp_sessions and not self._evict_idlest():
            why = f"front ends hold {self.sessions} UDP sessions, all active: the budget"
        if why is not None:
            self.sessions_refused += 1
            self._say(f"{why}: new ones are refused ({self.sessions_refused} so far)")
            return False
        self.sessions += 1
        self._sessions_by_source[source] = self._sessions_by_source.get(source, 0) + 1
        self._sessions_by_prefix[prefix] = self._sessions_by_prefix.get(prefix, 0) + 1
        return True

    def _evict_idlest(self) -> bool:
        """The budget is full: the session idle longest gives way, if it has
        been idle long enough. True when one did."""
        idlest: tuple[float, SessionOwner] | None = None
        for owner in self.session_owners:
            last = owner.idlest()
            if last is not None and (idlest is None or last < idlest[0]):
                idlest = (last, owner)
        if idlest is None or asyncio.get_running_loop().time() - idlest[0] < SESSION_EVICT_IDLE:
            return False
        idlest[1].evict_idlest()  # (which releases its session here)
        self.sessions_evicted += 1
        return self.sessions < self.max_udp_sessions

    def release_session(self, source: str) -> None:
        self.sessions = max(0, self.sessions - 1)
        _count_down(self._sessions_by_source, source)
        _count_down(self._sessions_by_prefix, prefix_of(source))

    def _count_down(self, source: str) -> None:
        _count_down(self._by_source, source)

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
        self._by_source.clear()
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


def _count_down(counts: dict[str, int], key: str) -> None:
    left = counts.get(key, 1) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)
