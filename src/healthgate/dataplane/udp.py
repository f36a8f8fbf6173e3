"""UDP forwarding: datagram sessions with an idle timeout.

A listener receives datagrams; each distinct client address is a *session*.
The first datagram of a session picks an upstream (the route's region for a
consumer rule, a healthy endpoint for a producer rule) and opens a connected
UDP socket to it; datagrams then flow both ways through that socket until the
session has been idle for ``idle_timeout`` seconds. A session keeps its
upstream for its lifetime (a failover moves *new* sessions), like a TCP
connection. When no upstream is available the datagram is dropped and counted.

Sessions are bounded by the guard's UDP budget, per source address and per
network (dataplane/guard.py); under pressure the session idle longest gives
way (they are kept in order of their last datagram, either way). A wildcard
listener answers from the address it was asked at (dataplane/udp_socket.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import cast

from healthgate.dataplane.counters import ListenerCounters, success
from healthgate.dataplane.guard import ConnectionGuard
from healthgate.health.evidence import UNREACHABLE

log = logging.getLogger("healthgate.dataplane")

Address = tuple[str, int]


class _Upstream(asyncio.DatagramProtocol):
    def __init__(self, listener: UdpListener, client: Address, address: Address) -> None:
        self.listener = listener
        self.client = client
        self.address = address  # the upstream's
        self.transport: asyncio.DatagramTransport | None = None
        self.last = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        self.listener.touch(self)
        self.listener.reply(data, self.client)

    def error_received(self, exc: Exception) -> None:
        # (an ICMP error: port unreachable, the UDP twin of a refused connection)
        counters = self.listener.counters
        counters.event("upstream_errors")
        counters.error(self.address, UNREACHABLE, True)


class UdpListener(asyncio.DatagramProtocol):
    def __init__(
        self,
        choose: Callable[[], Sequence[Address]],
        idle_timeout: float,
        counters: ListenerCounters,
        max_sessions: int = 65536,
        guard: ConnectionGuard | None = None,
    ) -> None:
        self.guard = guard  # sessions count against the cap and per source (dataplane/guard.py)
        self.choose = choose
        self.idle_timeout = idle_timeout
        self.counters = counters
        self.stats = counters.events
        self.max_sessions = max_sessions
        self.transport: asyncio.DatagramTransport | None = None
        # (idle longest first: under pressure the first gives way - dataplane/guard.py)
        self.sessions: OrderedDict[Address, _Upstream] = OrderedDict()
        self.pending: dict[Address, list[bytes]] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._opening: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)
        if self.guard is not None:
            self.guard.session_owners.add(self)
        self._schedule_sweep()

    def touch(self, session: _Upstream) -> None:
        """A datagram of ``session``'s, either way: it is the least idle now."""
        session.last = asyncio.get_running_loop().time()
        if self.sessions.get(session.client) is session:
            self.sessions.move_to_end(session.client)

    def idlest(self) -> float | None:
        for session in self.sessions.values():
            return session.last
        return None

    def evict_idlest(self) -> None:
        if self.sessions:
            client, session = self.sessions.popitem(last=False)
            if session.transport is not None:
                session.transport.close()
            self.stats["evicted"] = self.stats.get("evicted", 0) + 1
            self._ended(client)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        client = (str(addr[0]), int(addr[1]))
        session = self.sessions.get(client)
        loop = asyncio.get_running_loop()
        if session is not None and session.transport is not None:
            self.touch(session)
            session.transport.sendto(data)
            return
        if client in self.pending:  # the session's upstream socket is being opened
            self.pending[client].append(data)
            return
        if len(self.sessions) >= self.max_sessions or (
            self.guard is not None and not self.guard.admit_session(client[0])
        ):
            self.stats["dropped"] = self.stats.get("dropped", 0) + 1
            return
        self.pending[client] = [data]
        task = loop.create_task(self._open(client))
        self._opening.add(task)
        task.add_done_callback(self._opening.discard)

    async def _open(self, client: Address) -> None:
        loop = asyncio.get_running_loop()
        queued = self.pending.get(client, [])
        for address in self.choose():
            try:
                _, session = await loop.create_datagram_endpoint(
                    functools.partial(_Upstream, self, client, address), remote_addr=address
                )
            except OSError:
                continue
            session.last = loop.time()
            self.sessions[client] = session
            self.pending.pop(client, None)
            self.stats["sessions"] = self.stats.get("sessions", 0) + 1
            success(self.counters.of(address))
            assert session.transport is not None
            for data in queued:
                session.transport.sendto(data)
            return
        self.pending.pop(client, None)
        self._ended(client)
        self.stats["no_upstream"] = self.stats.get("no_upstream", 0) + len(queued)

    def _ended(self, client: Address) -> None:
        if self.guard is not None:
            self.guard.release_session(client[0])

    def reply(self, data: bytes, client: Address) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(data, client)

    def _schedule_sweep(self) -> None:
        loop = asyncio.get_running_loop()
        self._sweeper = loop.call_later(min(1.0, self.idle_timeout / 2), self._sweep)

    def _sweep(self) -> None:
        now = asyncio.get_running_loop().time()
        sessions = self.sessions
        while sessions:  # (idle longest first: only the expired are looked at)
            client, session = next(iter(sessions.items()))
            if now - session.last <= self.idle_timeout:
                break
            sessions.popitem(last=False)
            if session.transport is not None:
                session.transport.close()
            self._ended(client)
        if self.transport is not None and not self.transport.is_closing():
            self._schedule_sweep()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.guard is not None:
            self.guard.session_owners.discard(self)
        if self._sweeper is not None:
            self._sweeper.cancel()
        for client, session in self.sessions.items():
            if session.transport is not None:
                session.transport.close()
            self._ended(client)
        self.sessions.clear()
