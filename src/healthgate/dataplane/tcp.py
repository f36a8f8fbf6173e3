"""Layer-4 TCP proxying: bytes both ways, with back-pressure and half-close.

A client connection is accepted with reading paused; an upstream is chosen
and connected (the next candidate is tried when one refuses or does not
answer within the connect timeout); then the two sides are linked:

* what one side reads is written to the other;
* when a side's write buffer passes the high-water mark, the *other* side
  stops reading until it drains (so a slow reader never makes us buffer
  unboundedly);
* an EOF from one side becomes a ``write_eof`` on the other (half-close), and
  the connection ends when both directions are done or either side resets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import cast

from healthgate.dataplane.counters import ListenerCounters, success
from healthgate.dataplane.guard import ConnectionGuard
from healthgate.health.evidence import CONNECT_TIMEOUT, REFUSED, RESET

log = logging.getLogger("healthgate.dataplane")

Address = tuple[str, int]
HIGH_WATER = 256 * 1024


def count_down(active: dict[Address, int], address: Address) -> None:
    """One connection or request to ``address`` fewer (least-connections)."""
    left = active.get(address, 1) - 1
    if left > 0:
        active[address] = left
    else:
        active.pop(address, None)


class Pipe(asyncio.Protocol):
    """One side of a proxied connection."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: Pipe | None = None
        self.eof = False
        self.closed = False
        self.on_close: Callable[[], None] | None = None
        self.early = bytearray()  # bytes read before the peer was linked (a server banner)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=HIGH_WATER)

    def link(self, peer: Pipe) -> None:
        """Connect this side to its peer, replaying what arrived before: data,
        and an EOF (a client may send its request and half-close at once)."""
        self.peer = peer
        if peer.transport is None or peer.closed:
            return
        if self.early:
            peer.transport.write(bytes(self.early))
            self.early.clear()
            if self.transport is not None:
                self.transport.resume_reading()
        if self.eof:
            self._forward_eof(peer)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is not None and peer.transport is not None and not peer.closed:
            peer.transport.write(data)
        elif peer is None:
            self.early += data
            if len(self.early) > HIGH_WATER and self.transport is not None:
                self.transport.pause_reading()  # until linked

    def eof_received(self) -> bool | None:
        self.eof = True
        peer = self.peer
        if peer is None:
            return True  # not linked yet: keep our side open, link() forwards the EOF
        if peer.transport is None or peer.closed:
            return False
        return self._forward_eof(peer)

    @staticmethod
    def _forward_eof(peer: Pipe) -> bool:
        assert peer.transport is not None
        if peer.eof:  # both directions are done
            peer.transport.close()
            return False
        if peer.transport.can_write_eof():
            peer.transport.write_eof()
            return True  # half-close: our write side stays open for the answer
        peer.transport.close()
        return False

    def pause_writing(self) -> None:  # our outgoing buffer is full: stop the peer reading
        if self.peer is not None and self.peer.transport is not None:
            with contextlib.suppress(RuntimeError):
                self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None and not self.peer.closed:
            with contextlib.suppress(RuntimeError):
                self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        peer = self.peer
        if peer is not None and peer.transport is not None and not peer.closed:
            if exc is not None:
                peer.transport.abort()
            else:
                peer.transport.close()
        if self.on_close is not None:
            self.on_close()


async def connect_first(
    candidates: Sequence[Address],
    timeout: float,
    factory: Callable[[], Pipe],
    counters: ListenerCounters | None = None,
) -> tuple[asyncio.Transport, Pipe, Address] | None:
    """Connect to the first candidate that accepts within ``timeout`` (each
    one that does not is an error of its, in ``counters``: a gateway error)."""
    loop = asyncio.get_running_loop()
    for address in candidates:
        try:
            async with asyncio.timeout(timeout):
                transport, proto = await loop.create_connection(factory, address[0], address[1])
            return transport, proto, address
        except (OSError, TimeoutError) as exc:
            log.debug("upstream %s:%d failed: %r", address[0], address[1], exc)
            if counters is not None:
                counters.error(
                    address, CONNECT_TIMEOUT if isinstance(exc, TimeoutError) else REFUSED, True
                )
    return None


class UpstreamPipe(Pipe):
    """The upstream side of an L4 connection: the hop is a success at the
    upstream's first byte (or a clean close), an error when the upstream
    resets the connection before it (SPEC §8)."""

    def __init__(self) -> None:
        super().__init__()
        self.counted: ListenerCounters | None = None  # set when linked: where to count
        self.address: Address | None = None
        self.judged = False

    def judge(self, ok: bool) -> None:
        if self.judged or self.counted is None or self.address is None:
            return
        self.judged = True
        if ok:
            success(self.counted.of(self.address))
        else:
            self.counted.error(self.address, RESET, False)

    def data_received(self, data: bytes) -> None:
        if not self.judged:
            self.judge(True)
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        # (a reset by the upstream comes with an error; our own close, or
        # the client's, does not)
        self.judge(exc is None)
        super().connection_lost(exc)


class TcpProxy(Pipe):
    """The client side of an L4 listener."""

    def __init__(
        self,
        choose: Callable[[str], Sequence[Address]],
        connect_timeout: float,
        counters: ListenerCounters,
        live: set[TcpProxy] | None = None,
        active: dict[Address, int] | None = None,
        guard: ConnectionGuard | None = None,
    ) -> None:
        super().__init__()
        self.guard = guard  # the connection cap (dataplane/guard.py)
        self.admitted: asyncio.BaseTransport | None = None  # counted by the guard
        self.choose = choose  # (the client's address) -> candidates in order
        self.client_ip = ""
        self.connect_timeout = connect_timeout
        self.counters = counters
        self.stats = counters.events
        self.task: asyncio.Task[None] | None = None
        self.upstream_address: Address | None = None
        self.live = live  # the listener's open connections, for draining
        self.active = active  # open connections per upstream (least-connections)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.guard is not None:
            if not self.guard.admit(transport):
                self.stats["refused_cap"] = self.stats.get("refused_cap", 0) + 1
                return
            self.admitted = transport
        super().connection_made(transport)
        assert self.transport is not None
        self.transport.pause_reading()
        peer = self.transport.get_extra_info("peername")
        if peer:
            self.client_ip = str(peer[0])
        self.stats["connections"] = self.stats.get("connections", 0) + 1
        self.task = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        candidates = self.choose(self.client_ip)
        result = (
            await connect_first(candidates, self.connect_timeout, UpstreamPipe, self.counters)
            if candidates
            else None
        )
        if self.closed or self.transport is None:
            if result is not None:
                result[0].close()
            return
        if result is None:
            self.stats["no_upstream"] = self.stats.get("no_upstream", 0) + 1
            self.transport.abort()  # nobody to serve this connection: reset, as a balancer does
            return
        _transport, upstream, address = result
        self.upstream_address = address
        if self.live is not None:
            self.live.add(self)
        if self.active is not None:
            self.active[address] = self.active.get(address, 0) + 1
        if isinstance(upstream, UpstreamPipe):
            upstream.counted, upstream.address = self.counters, address
            if upstream.early or upstream.closed:  # (it spoke, or went, before being linked)
                upstream.judge(bool(upstream.early) or upstream.eof)
        self.link(upstream)  # replays what the client sent (and its EOF)
        upstream.link(self)  # replays what the upstream already sent
        if not self.eof:
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.guard is not None:
            if self.admitted is None:
                return  # refused over the cap: nothing was set up
            self.guard.release(self.admitted)
            self.admitted = None
        super().connection_lost(exc)
        if self.live is not None:
            self.live.discard(self)
        if self.active is not None and self.upstream_address is not None:
            count_down(self.active, self.upstream_address)
            self.upstream_address = None
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def drain(self) -> None:
        """Close this connection gracefully (a failover with drain_on_failover)."""
        if self.transport is not None and not self.closed:
            self.transport.close()
