"""Upstream connections of the L7 front end: pooled, kept alive, one
exchange at a time.

* :class:`UpstreamConnection` - one connection to an upstream (a region's
  producer rule or an endpoint); its httptools response parser finds where
  each response ends, and the response is streamed to the client as it
  arrives, byte for byte. An exchange reports either through futures (the
  general path) or by callbacks to its :class:`FastOwner` (the fast path:
  no task, no future). Its reads start in ``_speedups.FastUpstream`` (C)
  when built, else in :class:`_PyUpstreamEntry`.
* :class:`UpstreamPool` - idle kept-alive connections per address, and
  :class:`TryDeadlines`: the fast path's per-try deadlines, one timer for
  all of them.

**One exchange, one response, then nothing.** A connection is pooled only
between messages: bytes that arrive while no exchange is in flight (an
upstream that answers twice, or speaks unasked) close it, and so does a
second message that starts right behind the response in the same read -
else the next request on it, maybe another client's, would read the
previous client's answer. Interim answers (``1xx`` but ``101``) are not the
response: they are split off before the parser sees them
(:meth:`UpstreamConnection._interim`), forwarded to an HTTP/1.1 client as
they arrive (never to an HTTP/1.0 one, RFC 9110 §15.2), and the exchange
waits for the final status - which alone decides a retry. ``101`` is never
asked for (upgrades are refused): it fails the exchange. Only the first
read of an exchange may be taken whole by ``whole_response``: a read that
continues a head begun earlier is the parser's.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from time import monotonic
from typing import TYPE_CHECKING, Protocol, cast

import httptools

from healthgate import http_scan
from healthgate.dataplane.http_limits import HttpSettings
from healthgate.http_scan import whole_response

Address = tuple[str, int]

# interim answers before the final one: at most this many, each at most this long
MAX_INTERIM = 16
MAX_INTERIM_BYTES = 64 * 1024
_INTERIM_PREFIXES = (b"HTTP/1.1 1", b"HTTP/1.0 1")


class FastOwner(Protocol):
    """The client side of a fast-path exchange (dataplane/http.py), told
    what happens to it by callbacks."""

    def fast_head(self, conn: UpstreamConnection, status: int) -> None: ...

    def fast_whole(self, conn: UpstreamConnection, data: bytes, status: int) -> None: ...

    def fast_done(self, conn: UpstreamConnection, reusable: bool) -> None: ...

    def fast_failed(self, conn: UpstreamConnection, exc: Exception) -> None: ...

    def fast_expired(self) -> None: ...

    def fast_interim(self, conn: UpstreamConnection, head: bytes) -> None:
        """An interim (1xx) head arrived before the final answer."""


class _PyUpstreamEntry(asyncio.Protocol):
    """Where every read from an upstream starts, in Python: a whole answer
    to a fast-path request is handed to its owner in one callback, anything
    else goes to :meth:`UpstreamConnection._parse`. ``_speedups.FastUpstream``
    does the same in C (and, for an :class:`~healthgate.dataplane.http.HttpProxy`
    owner, the owner's part too); this class is its fallback."""

    got_bytes: bool
    owner: FastOwner | None
    head_only: bool
    sink: asyncio.Transport | None
    status: int
    t0: float  # when the exchange's request was sent (time.monotonic())

    def data_received(self, data: bytes) -> None:
        first = not self.got_bytes  # (only an exchange's first read may be whole)
        self.got_bytes = True
        owner = self.owner
        if (
            first
            and whole_response is not None
            and owner is not None
            and not self.head_only
            and self.sink is None
        ):
            # the usual answer to a fast-path request: one whole response in
            # one read (http_scan.py), handed over in one callback
            status = whole_response(data)
            if status:
                self.status = status
                self.owner = None
                owner.fast_whole(cast(UpstreamConnection, self), data, status)
                return
        self._parse(data)

    def _parse(self, data: bytes) -> None:
        raise NotImplementedError


if TYPE_CHECKING or http_scan.speedups is None:
    _UpstreamEntry = _PyUpstreamEntry
else:

    class _UpstreamEntry(http_scan.speedups.FastUpstream, asyncio.Protocol):
        __slots__ = ()


class UpstreamConnection(_UpstreamEntry):
    """One pooled connection to an upstream; answers one request at a time."""

    def __init__(self, address: Address) -> None:
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.t0 = 0.0
        self.parser = httptools.HttpResponseParser(self)  # parses message after message
        self._reset_exchange()

    def _reset_exchange(self) -> None:
        self.head: asyncio.Future[int] | None = None
        self.done: asyncio.Future[bool] | None = None
        self.owner: FastOwner | None = None  # a fast-path exchange: callbacks, no futures
        self.buffer: list[bytes] = []  # what came before the commit (usually one read)
        self.sink: asyncio.Transport | None = None  # the client, once committed
        self.head_only = False
        self.got_bytes = False
        self.status = 0  # the response's status, once its head is in
        # interim answers: where they go (the general path's client, when
        # HTTP/1.1; the fast path's go to the owner), what of a head is held
        # until it is known to be one, how many came, and whether the final
        # head has begun (from then on every byte is the parser's)
        self.interim_to: asyncio.Transport | None = None
        self.held = b""
        self.interims = 0
        self.final_begun = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def start(self, request: bytes, head_only: bool) -> None:
        loop = asyncio.get_running_loop()
        self._reset_exchange()
        self.head_only = head_only
        self.head = loop.create_future()
        self.done = loop.create_future()
        assert self.transport is not None
        self.t0 = monotonic()
        self.transport.write(request)

    def start_fast(self, request: bytes, head_only: bool, owner: FastOwner) -> None:
        """Send ``request``; report to ``owner`` by callbacks (``_fast_*``).
        (The exchange's fields set here and not by _reset_exchange: this runs
        per request, and a pooled connection is only ever idle between
        exchanges, with no future, buffer or sink left over.)"""
        self.owner = owner
        self.head_only = head_only
        self.got_bytes = False
        self.status = 0
        self.t0 = monotonic()
        assert self.transport is not None
        self.transport.write(request)

    def idle_now(self) -> bool:
        """No exchange in flight: the connection is between messages."""
        return self.owner is None and (self.done is None or self.done.done())

    def _unasked(self) -> None:
        """Bytes no request asked for: never pooled again, never read on."""
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def commit(self, client: asyncio.Transport, extra: bytes = b"") -> None:
        """Send what was buffered to the client; stream the rest directly.
        ``extra``: header lines (CRLF-ended) to add to the answer's head,
        right after its status line (the head is whole in the buffer once
        its status is known)."""
        self.sink = client
        buffer = self.buffer
        if buffer:
            if not client.is_closing():
                data = buffer[0] if len(buffer) == 1 else b"".join(buffer)
                if extra:
                    line = data.find(b"\r\n") + 2
                    data = data[:line] + extra + data[line:] if line > 1 else data
                client.write(data)
            buffer.clear()

    def _interim(self, data: bytes) -> bytes | None:
        """Split interim heads off the front of ``data`` (what came before
        is in ``held``): what is left for the parser, or None while a head
        may still be an interim one (or after the exchange failed)."""
        buf = self.held + data if self.held else data
        while True:
            n = min(len(buf), 10)
            if not any(buf[:n] == p[:n] for p in _INTERIM_PREFIXES):
                break  # the final head: the parser's from here on
            end = buf.find(b"\r\n\r\n", 0, MAX_INTERIM_BYTES)
            if n < 10 or end < 0:
                if len(buf) >= MAX_INTERIM_BYTES:
                    self._broken("an interim answer's head too large")
                    return None
                self.held = buf  # (wait for the rest of it)
                return None
            status = buf[9:12]
            if not status.isdigit() or status == b"101" or buf[12:13] not in (b" ", b"\r"):
                self._broken(
                    "an unasked 101 Switching Protocols"
                    if status == b"101"
                    else "a malformed interim answer"
                )
                return None
            self.interims += 1
            if self.interims > MAX_INTERIM:
                self._broken(f"more than {MAX_INTERIM} interim answers")
                return None
            head, buf = buf[: end + 4], buf[end + 4 :]
            owner = self.owner
            if owner is not None:
                owner.fast_interim(self, head)
            elif self.interim_to is not None and not self.interim_to.is_closing():
                self.interim_to.write(head)
        self.held = b""
        self.final_begun = True
        return buf

    def _broken(self, why: str) -> None:
        self.held = b""
        self._fail(ConnectionError(f"malformed response from upstream: {why}"))
        self._unasked()

    def _parse(self, data: bytes) -> None:
        """A read that is not a whole answer to a fast-path request."""
        if self.idle_now():  # unasked bytes: the next request would read them
            self._unasked()
            return
        if not self.final_begun:
            rest = self._interim(data)
            if not rest:
                return
            data = rest
        sink = self.sink
        if sink is not None:
            if not sink.is_closing():  # a client that left mid-response: read on, drop
                sink.write(data)
        else:
            self.buffer.append(data)
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):
            self._fail(ConnectionError("malformed response from upstream"))
            self._unasked()

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.idle_now():  # a second answer right behind the first one
            self._unasked()

    def on_headers_complete(self) -> None:
        self.status = status = self.parser.get_status_code()
        if self.owner is not None:
            self.owner.fast_head(self, status)
        elif self.head is not None and not self.head.done():
            self.head.set_result(status)
        if self.head_only:
            self._complete(reusable=False)

    def on_message_complete(self) -> None:
        self._complete(reusable=self.parser.should_keep_alive())

    def _complete(self, reusable: bool) -> None:
        # the next exchange starts with its interim answers unread (the C
        # first try sets only what start_fast sets)
        self.final_begun = False
        self.interims = 0
        owner = self.owner
        if owner is not None:
            self.owner = None
            owner.fast_done(self, reusable)
        elif self.done is not None and not self.done.done():
            self.done.set_result(reusable)

    def _fail(self, exc: Exception) -> None:
        owner = self.owner
        if owner is not None:
            self.owner = None
            owner.fast_failed(self, exc)
        for fut in (self.head, self.done):
            if fut is not None and not fut.done():
                fut.set_exception(exc)
                fut.exception()  # may never be awaited (a timed-out try): not an error

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.status and (
            self.owner is not None or (self.done is not None and not self.done.done())
        ):
            # a response without length ends with the connection
            with contextlib.suppress(httptools.HttpParserError):
                self.parser.feed_data(b"")
        self._fail(
            exc
            if isinstance(exc, Exception)
            else ConnectionResetError("upstream closed the connection")
        )

    # back-pressure from the client
    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()


class TryDeadlines:
    """The per-try deadlines of fast-path exchanges, checked by one timer.

    A timer per request (``call_later`` + ``cancel``) costs more than the
    rest of a plain request's Python, and so does a clock read: instead an
    exchange records the current *tick* here (a count of sweeps), and one
    sweep every ``timeout / 8`` (kept within 10-250 ms, and always a whole
    fraction of the timeout) advances it and expires the
    exchanges that have seen more than ``timeout`` worth of ticks, so a try
    gives up between ``timeout`` and ``timeout`` plus one sweep. The timer
    runs only while exchanges are in flight.
    """

    def __init__(self, timeout: float) -> None:
        if not 0 < timeout <= 3600:  # (0 would sweep without a pause; NaN never)
            raise ValueError(f"per_try_timeout must be within (0, 3600] seconds, got {timeout}")
        self.timeout = timeout
        # `ticks` sweeps make exactly the timeout: 8 of them, or as many as
        # keep a sweep within 10-250 ms (a rounded-up count would let a try
        # wait up to two sweeps past its timeout)
        ticks = 8
        if timeout / ticks > 0.25:
            ticks = math.ceil(timeout / 0.25)
        elif timeout / ticks < 0.01:
            ticks = max(1, int(timeout / 0.01))
        self.ticks = ticks
        self.every = timeout / ticks
        self.tick = 0
        self.pending: dict[FastOwner, int] = {}  # exchange -> the tick it started in
        self._timer: asyncio.TimerHandle | None = None

    def add(self, proxy: FastOwner, loop: asyncio.AbstractEventLoop) -> None:
        self.pending[proxy] = self.tick
        if self._timer is None:
            self._timer = loop.call_later(self.every, self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        # (an exchange that started during tick t, before sweep t + 1, has
        # waited more than now - t - 1 sweeps: `ticks` of them is the timeout)
        self.tick = now = self.tick + 1
        oldest = now - self.ticks
        late = [proxy for proxy, started in self.pending.items() if started < oldest]
        for proxy in late:
            del self.pending[proxy]
            proxy.fast_expired()
        self._timer = loop.call_later(self.every, self._sweep, loop) if self.pending else None

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.pending.clear()


class UpstreamPool:
    def __init__(self, settings: HttpSettings) -> None:
        self.settings = settings
        # idle kept-alive connections per address (the C fast path reads and
        # writes this dict too: _speedups.c's pool_idle, pool_release)
        self.idle_connections: dict[Address, list[UpstreamConnection]] = {}
        self.deadlines = TryDeadlines(settings.per_try_timeout)

    def idle(self, address: Address) -> UpstreamConnection | None:
        """A pooled connection to ``address``, if one is open."""
        idle = self.idle_connections.get(address)
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                conn.reused = True
                return conn
        return None

    async def acquire(self, address: Address) -> UpstreamConnection:
        conn = self.idle(address)
        if conn is not None:
            return conn
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.settings.connect_timeout):
            _, conn = await loop.create_connection(
                lambda: UpstreamConnection(address), address[0], address[1]
            )
        return conn

    def release(self, conn: UpstreamConnection) -> None:
        idle = self.idle_connections.get(conn.address)
        if idle is None:
            idle = self.idle_connections[conn.address] = []
        if conn.closed or not conn.idle_now() or len(idle) >= self.settings.max_idle_per_upstream:
            self.discard(conn)
        else:
            conn.sink = None
            idle.append(conn)

    @staticmethod
    def discard(conn: UpstreamConnection) -> None:
        if conn.transport is not None:
            conn.transport.close()

    def close(self) -> None:
        self.deadlines.close()
        for conns in self.idle_connections.values():
            for conn in conns:
                self.discard(conn)
        self.idle_connections.clear()


def expire_head(head: asyncio.Future[int]) -> None:
    if not head.done():
        head.set_exception(TimeoutError())
