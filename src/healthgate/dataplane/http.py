"""Layer-7 HTTP/1.1 proxying with per-try timeouts and cross-region retries.

Requests are parsed with httptools (the llhttp parser uvicorn uses). Each
request is sent to the first upstream of the route (the chosen region's
published service) over a pooled keep-alive connection; the response is
streamed back as it arrives. The request body is buffered (up to
``max_body_bytes``) so that a request can be *retried*:

* the upstream refused or reset the connection, or did not start answering
  within ``per_try_timeout``, or answered 502/503/504 - and nothing has been
  sent to the client yet - then an idempotent request (GET, HEAD, OPTIONS,
  PUT, DELETE, TRACE) is tried again in the next region of the route's
  failover order. A non-idempotent request is retried only when it was never
  sent (the connection could not be opened).

So while a region refuses, hangs or fails, and before its health checks have
declared it down, idempotent requests still succeed. Once the response has
started to flow to the client it is never retried. Responses are forwarded
byte for byte (the parser only finds where each one ends).

**The plain-request fast path.** Most requests are a GET or HEAD with a few
headers and no body. When such a request arrives whole in one read, on a
connection with nothing else in flight, and a pooled connection to the chosen
upstream is open, it is forwarded without the request parser, without a
task and without a future: one pass checks the head
(:func:`~healthgate.http_scan.plain_request`: request line, header syntax,
no hop-by-hop or framing header, no X-Forwarded-For to merge), one line
(``X-Forwarded-For``) is appended, and the answer comes back by one
callback: :meth:`HttpProxy.fast_whole` when the whole response arrives in
one read (:func:`~healthgate.http_scan.whole_response`, the usual case),
else the upstream's response parser calls back into the proxy. Every
failure of that first try - refused, reset, no answer within the per-try timeout, 502/503/504 - hands the
request to the general path, which goes on with the next try exactly as if
it had made the first one itself. Anything else (other methods, bodies,
``Connection`` headers, HTTP/1.0, pipelined or partial reads, no pooled
connection yet) takes the general path from the start.

Where every read starts - the plain-request check and the first try - is
``_speedups.FastProxy.data_received`` in C when the module is built (and
``FastUpstream`` forwards the whole answer), else :class:`_PyFastEntry`; the
C mirrors :meth:`HttpProxy._fast` and :meth:`HttpProxy.fast_whole` step by
step and calls them for anything off its path (docs/dataplane.md, "The C
speedups").
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from time import monotonic
from typing import TYPE_CHECKING, Protocol, cast

import httptools

from healthgate import http_scan
from healthgate.dataplane.counters import ListenerCounters, success
from healthgate.dataplane.guard import ConnectionGuard
from healthgate.dataplane.http_limits import HttpSettings
from healthgate.dataplane.http_message import (
    IDEMPOTENT,
    RETRY_STATUSES,
    Request,
    check_head,
    simple_response,
)
from healthgate.dataplane.retry import NextTry, RetryBudget, next_try
from healthgate.dataplane.tcp import count_down
from healthgate.dataplane.upstream import UpstreamConnection, UpstreamPool, expire_head
from healthgate.health.evidence import CONNECT_TIMEOUT, GATEWAY_STATUSES, REFUSED, RESET, TIMEOUT
from healthgate.http_scan import plain_request

log = logging.getLogger("healthgate.dataplane")

Address = tuple[str, int]


# how much of a read the parser is fed at once: while heads are read (so
# that a read of many pipelined requests is parsed no further than the queue
# may grow), and within a body
HEAD_SLICE = 2048
BODY_SLICE = 64 * 1024


class Affine(Protocol):
    """A front end's session affinity (SPEC §9, dataplane/affinity.py)."""

    def on(self) -> bool:
        """Has the front end affinity now (then no request takes the fast path)."""

    def groups(
        self, client_ip: str, headers: Sequence[tuple[bytes, bytes]]
    ) -> tuple[list[list[Address]], bytes] | None:
        """The request's regions in order and a ``Set-Cookie`` line (b""),
        or None when the front end has no affinity."""


class _Retry(Exception):
    """A try failed; what happened decides the next (dataplane/retry.py),
    and its ``kind`` is the upstream's error (health/evidence.py)."""

    def __init__(
        self,
        message: str,
        kind: str,
        gateway: bool = False,
        sent: bool = True,
        timed_out: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.gateway = gateway
        self.sent = sent
        self.timed_out = timed_out


class _PyFastEntry(asyncio.Protocol):
    """Where every read from a client starts, in Python: a plain request's
    first try (:meth:`HttpProxy._fast`), else the parser
    (:meth:`HttpProxy._parse`). ``_speedups.FastProxy`` does the same in C,
    and its first try too; this class is its fallback (and what mypy reads)."""

    touched: bool
    inflight: bool
    current: Request | None
    queue: deque[Request]
    _max_head: int
    _max_headers: int

    def data_received(self, data: bytes) -> None:
        self.touched = True  # (the idle timeout counts from the next sweep: see expire)
        if (
            not self.inflight
            and self.current is None
            and not self.queue
            and len(data) <= self._max_head
            and (plain := plain_request(data, self._max_headers))
            and self._fast(data, plain == 2)
        ):
            return
        self._parse(data)

    def _fast(self, data: bytes, head_only: bool) -> bool:
        raise NotImplementedError

    def _parse(self, data: bytes) -> None:
        raise NotImplementedError


if TYPE_CHECKING or http_scan.speedups is None:
    _FastEntry = _PyFastEntry
else:

    class _FastEntry(http_scan.speedups.FastProxy, asyncio.Protocol):
        __slots__ = ()


class HttpProxy(_FastEntry):
    """The client side of an L7 listener."""

    def __init__(
        self,
        choose: Callable[[], Sequence[Sequence[Address]]],
        pool: UpstreamPool,
        settings: HttpSettings,
        counters: ListenerCounters,
        on_route_used: Callable[[], None] | None = None,
        active: dict[Address, int] | None = None,
        first: Callable[[bytes], tuple[Address, Sequence[Address]] | None] | None = None,
        guard: ConnectionGuard | None = None,
        budget: RetryBudget | None = None,
        affine: Affine | None = None,
    ) -> None:
        self.choose = choose
        # session affinity (SPEC §9): (client address, request headers) ->
        # (groups, a Set-Cookie line), or None when the front end has none
        self.affine = affine
        # a consumer front end's retry budget (SPEC §8), and the count of its
        # requests in flight, which the C fast path keeps too
        self.budget = budget
        self._gauge = budget.requests if budget is not None else None
        self.guard = guard  # the connection cap and the header / idle timeouts
        self.admitted: asyncio.BaseTransport | None = None  # counted by the guard
        # the head of the request being read: open from its first byte to its
        # last, its size so far (bounded as it arrives) and when it began
        self._head_open = False
        self._head_bytes = 0
        self._head_since = 0.0
        self.last_active = 0.0
        self.touched = False  # data arrived since the guard's last sweep
        # the first try alone, cheaper than choose() (else choose()[0][0]):
        # (its endpoint, every candidate of its region); it calls
        # on_route_used itself when the route it reads has changed
        self.first = first
        self.active = active  # requests in flight per upstream (least-connections)
        self.pool = pool
        self._deadlines = pool.deadlines
        self._pending = pool.deadlines.pending
        self._idle = pool.idle_connections  # (what the C first try reads of the pool)
        self._max_idle = pool.settings.max_idle_per_upstream
        self.settings = settings
        self._max_head = settings.max_head_bytes
        self.counters = counters
        self.stats = counters.events  # (what the C fast path counts requests in)
        self.upstreams = counters.upstreams  # (... and a success of an upstream's)
        self.on_route_used = on_route_used
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.current: Request | None = None
        self.queue: deque[Request] = deque()
        self.wake = asyncio.Event()
        self.client_ip = "unknown"
        self.closed = False
        self._stopped = False  # a refusal is queued: nothing after it is read
        self._held = b""  # a read's rest, not parsed while the queue is full
        self._stalled_since = 0.0  # the client stopped reading our answer at (0: it reads)
        self._max_headers = settings.max_headers  # (what the C fast path reads)
        self.paused = False  # not read: too much waiting behind the request in flight
        self.buffered = 0  # bytes of request bodies held (being read and queued)
        self.heads_held = 0  # bytes of the heads queued behind the request in flight
        self._paused_at = 0.0
        self._body_since = 0.0
        self.upstream: UpstreamConnection | None = None
        self.worker: asyncio.Task[None] | None = None  # the general path, started when needed
        self.inflight = False  # a request is being forwarded (either path)
        # the fast path's exchange in flight
        self._xff = b""
        self._fast_request = b""
        self._fast_groups: Sequence[Sequence[Address]] | None = None
        self._fast_region: Sequence[Address] = ()  # the candidates of the try's region
        self._fast_counted: Address | None = None
        # the endpoint the fast path chose but had no pooled connection to:
        # the general path tries it first (and pools a connection to it), or
        # that endpoint would never get one while its neighbours do
        self._pin: Address | None = None
        self.loop = asyncio.get_running_loop()

    # ---- client side
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        guard = self.guard
        if guard is not None:
            if not guard.admit(transport):
                self.closed = True
                self.stats["refused_cap"] = self.stats.get("refused_cap", 0) + 1
                return
            self.admitted = transport
            self.last_active = guard.clock()
            guard.watch(self)
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=256 * 1024)
        peer = self.transport.get_extra_info("peername")
        if peer:
            self.client_ip = str(peer[0])
        self._xff = b"X-Forwarded-For: " + self.client_ip.encode() + b"\r\n\r\n"
        self.stats["connections"] = self.stats.get("connections", 0) + 1

    def _parse(self, data: bytes) -> None:
        """A read that is not a plain request's first try: the parser's.

        Fed in slices (:data:`HEAD_SLICE` while heads are read, larger
        within a body), and no further while ``max_pipelined`` requests or
        ``max_buffered_per_connection`` bytes wait: the rest of the read is
        held, unparsed, until they drain. So a read of thousands of tiny
        pipelined requests queues a few dozen, not thousands, and a head is
        bounded by what arrived since it began (not by the whole read)."""
        if self.closed or self._stopped:
            return
        if self._held:  # (what an earlier read left unparsed comes first)
            data = self._held + data
            self._held = b""
        view = memoryview(data)
        pos, end = 0, len(data)
        s = self.settings
        while pos < end:
            if (
                len(self.queue) >= s.max_pipelined
                or self._holding() > s.max_buffered_per_connection
            ):
                self._held = bytes(view[pos:])
                self._pause()
                return
            step = HEAD_SLICE if self.current is None or self._head_open else BODY_SLICE
            chunk = view[pos : pos + step]
            pos += len(chunk)
            try:
                self.parser.feed_data(chunk)
            except httptools.HttpParserUpgrade:
                self._refuse(501, "Not Implemented", "protocol upgrades are not proxied")
            except httptools.HttpParserError:
                self._refuse(400, "Bad Request", "malformed HTTP request")
            if self.closed or self._stopped:
                return
            if self._head_open:  # a head still incomplete: bound it as it arrives
                self._head_bytes += len(chunk)  # (at most one slice more than its own)
                if self._head_bytes > s.max_head_bytes:
                    self._refuse(
                        431,
                        "Request Header Fields Too Large",
                        f"request heads are limited to {s.max_head_bytes} bytes",
                    )
                    return

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """A request that may not be forwarded: the requests before it on
        the connection are answered first, then this answer, then the
        connection closes (nothing after it is read)."""
        if self.closed or self._stopped:
            return
        if not self.queue and not self.inflight:
            self._reject(status, reason, message)
            return
        self._stopped = True
        self._held = b""
        if self.transport is not None:
            self.transport.pause_reading()
        refusal = Request()
        refusal.refusal = simple_response(status, reason, message, close=True)
        self.current = None
        self.queue.append(refusal)
        self._wake_worker()

    def expire(self, now: float, header_timeout: float, idle_timeout: float) -> None:
        """Called about once a second (dataplane/guard.py)."""
        if self.closed:
            return
        if self.touched:  # read since the last sweep: active now (no clock per read)
            self.touched = False
            self.last_active = now
        if self._stalled_since and now - self._stalled_since > self.settings.write_timeout:
            # an answer the client does not read: what it holds is freed
            self.stats["write_timeouts"] = self.stats.get("write_timeouts", 0) + 1
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
            return
        if self._head_open:
            if now - self._head_since > header_timeout:
                self.stats["header_timeouts"] = self.stats.get("header_timeouts", 0) + 1
                self._reject(408, "Request Timeout", "the request head did not arrive in time")
        elif self.current is not None and not self.paused:  # a body on its way
            s = self.settings
            if (
                now - self._body_since > s.body_timeout
                or now - self._head_since > s.request_timeout
            ):
                self.stats["body_timeouts"] = self.stats.get("body_timeouts", 0) + 1
                self._reject(408, "Request Timeout", "the request body did not arrive in time")
        elif self.inflight or self.queue:
            self.last_active = now
        elif now - self.last_active > idle_timeout and self.transport is not None:
            self.stats["idle_closed"] = self.stats.get("idle_closed", 0) + 1
            self.closed = True
            self.transport.close()

    def _reject(self, status: int, reason: str, message: str) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(simple_response(status, reason, message, close=True))
            self.transport.close()
        self.closed = True

    def on_message_begin(self) -> None:
        self.current = Request()
        self._head_open = True
        self._head_bytes = 0
        if self.guard is not None:
            self._head_since = self.guard.clock()

    def _too_large(self) -> None:
        """(Raised from a callback: the parser stops.)"""
        self._refuse(
            431,
            "Request Header Fields Too Large",
            f"request heads are limited to {self.settings.max_head_bytes} bytes and "
            f"{self.settings.max_headers} header lines",
        )
        raise httptools.HttpParserError("request head too large")

    def on_url(self, url: bytes) -> None:
        assert self.current is not None
        self.current.url += url
        self.current.head_bytes += len(url)
        if self.current.head_bytes > self.settings.max_head_bytes:
            self._too_large()

    def on_header(self, name: bytes, value: bytes) -> None:
        req = self.current
        assert req is not None
        req.head_bytes += len(name) + len(value) + 4
        if req.head_bytes > self.settings.max_head_bytes:
            self._too_large()
        if not self._head_open:
            # a chunked body's trailer: never a header of the request (RFC
            # 9110 §6.5.1: a Host or Authorization after the body would pass
            # every check made on the head); dropped, bounded as the head
            return
        if len(req.headers) >= self.settings.max_headers:
            self._too_large()
        req.headers.append((name, value))

    def on_headers_complete(self) -> None:
        req = self.current
        assert req is not None
        self._head_open = False
        if self.guard is not None:
            self._body_since = self.guard.clock()
        req.method = self.parser.get_method().decode("ascii", "replace")
        req.keep_alive = self.parser.should_keep_alive()
        req.http11 = self.parser.get_http_version() != "1.0"
        refusal = check_head(req)
        if refusal is not None:
            self._refuse(*refusal)
            raise httptools.HttpParserError(refusal[2])

    def on_body(self, body: bytes) -> None:
        req = self.current
        assert req is not None
        req.body += body
        if len(req.body) > self.settings.max_body_bytes:
            self._reject(
                413,
                "Payload Too Large",
                f"request bodies are limited to {self.settings.max_body_bytes} bytes",
            )
            raise httptools.HttpParserError("body too large")
        n = len(body)
        guard = self.guard
        if guard is not None and not guard.take_buffer(n):
            self.stats["refused_busy"] = self.stats.get("refused_busy", 0) + 1
            self._reject(
                503,
                "Service Unavailable",
                "the front end holds as many request bodies as it may; try again",
            )
            raise httptools.HttpParserError("buffers full")
        self.buffered += n
        if self._holding() > self.settings.max_buffered_per_connection:
            self._pause()

    def _holding(self) -> int:
        return self.buffered + self.heads_held

    def _pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
            self._paused_at = self.guard.clock() if self.guard is not None else 0.0

    def _maybe_resume(self) -> None:
        """Read again once what waits has drained to half of both bounds
        (what the last read left unparsed first)."""
        s = self.settings
        if (
            self.paused
            and not self._stopped
            and self.transport is not None
            and len(self.queue) < s.max_pipelined // 2
            and self._holding() <= s.max_buffered_per_connection // 2
        ):
            self.transport.resume_reading()
            self.paused = False
            if self.guard is not None:  # (time not read by us does not count against it)
                waited = self.guard.clock() - self._paused_at
                self._head_since += waited
                self._body_since += waited
            if self._held:
                self._parse(b"")

    def _release(self, req: Request) -> None:
        """A request's body (and head) is no longer held."""
        self.heads_held -= req.held_head
        req.held_head = 0
        n = len(req.body) + req.size  # (the body, or its bytes moved into data)
        if n:
            self.buffered -= n
            if self.guard is not None:
                self.guard.release_buffer(n)

    def on_message_complete(self) -> None:
        req = self.current
        assert req is not None
        # a queued head is held too: its bytes count with the bodies
        # (thousands of tiny headers once held ~31 MiB for 1.8 MiB sent)
        req.held_head = req.head_bytes
        self.heads_held += req.head_bytes
        self.queue.append(req)
        self.current = None
        if self._holding() > self.settings.max_buffered_per_connection:
            self._pause()
        self._wake_worker()
        if len(self.queue) >= self.settings.max_pipelined:
            self._pause()

    def pause_writing(self) -> None:
        self._stalled_since = self.guard.clock() if self.guard is not None else 0.0
        if self.upstream is not None:
            self.upstream.pause_reading()

    def resume_writing(self) -> None:
        self._stalled_since = 0.0
        if self.upstream is not None:
            self.upstream.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.wake.set()
        if self.buffered and self.guard is not None:
            self.guard.release_buffer(self.buffered)  # (what it held, it holds no more)
        self.buffered = 0
        if self.admitted is not None and self.guard is not None:
            self.guard.release(self.admitted)
            self.admitted = None
            self.guard.unwatch(self)
        conn = self.upstream
        if conn is not None:
            if conn.owner is self:  # a fast exchange: nobody is left to answer
                conn.owner = None
                self._fast_end()
            self.pool.discard(conn)

    # ---- the fast path: a plain request, forwarded by callbacks
    def _fast(self, data: bytes, head_only: bool) -> bool:
        """Make the first try of a plain request; False when it must take the
        general path instead (no route, or no pooled connection yet)."""
        groups: Sequence[Sequence[Address]] | None = None
        if self.first is None and self.affine is not None and self.affine.on():
            return False  # (the client's region depends on its request: the general path)
        if self.first is not None:  # (which observes the route's use itself)
            choice = self.first(data)
            if choice is None:
                return False
            address, region = choice
        else:
            groups = self.choose()
            if not groups or not groups[0]:
                return False
            region = groups[0]
            address = region[0]
            if self.on_route_used is not None:
                self.on_route_used()
        conn = self.pool.idle(address)
        if conn is None:
            self._pin = address
            return False
        stats = self.stats
        stats["requests"] = stats.get("requests", 0) + 1
        stats["fast_path"] = stats.get("fast_path", 0) + 1
        request = data[:-2] + self._xff
        self.inflight = True
        if self._gauge is not None:
            self._gauge.n += 1
        self.upstream = conn
        self._fast_request = request
        self._fast_groups = groups
        self._fast_region = region
        active = self.active
        if active is not None:
            active[address] = active.get(address, 0) + 1
            self._fast_counted = address
        conn.start_fast(request, head_only, self)
        self._deadlines.add(self, self.loop)
        return True

    def _fast_end(self) -> None:
        """The fast exchange is over, however it ended."""
        self._pending.pop(self, None)
        if self._fast_counted is not None and self.active is not None:
            count_down(self.active, self._fast_counted)
            self._fast_counted = None
        self.upstream = None
        if self.inflight and self._gauge is not None:
            self._gauge.n -= 1
        self.inflight = False

    def fast_head(self, conn: UpstreamConnection, status: int) -> None:
        self._pending.pop(self, None)
        if status in RETRY_STATUSES:  # GET and HEAD are idempotent: the next try
            conn.owner = None
            self.pool.discard(conn)
            address = conn.address
            self._fast_fallback(
                f"{address[0]}:{address[1]}: answered {status}", address, str(status), True
            )
            return
        client = self.transport
        if self.closed or client is None or client.is_closing():
            conn.owner = None
            self.pool.discard(conn)
            self._fast_end()
            return
        conn.commit(client)

    def fast_interim(self, conn: UpstreamConnection, head: bytes) -> None:
        """An interim answer to a plain request (always HTTP/1.1): forwarded."""
        client = self.transport
        if not self.closed and client is not None and not client.is_closing():
            client.write(head)

    def fast_whole(self, conn: UpstreamConnection, data: bytes, status: int) -> None:
        """The whole response arrived in one read: what fast_head, commit and
        fast_done would do, in one call (the connection stays reusable)."""
        self.pool.release(conn)
        if status in RETRY_STATUSES:  # GET and HEAD are idempotent: the next try
            address = conn.address
            self._fast_fallback(
                f"{address[0]}:{address[1]}: answered {status}", address, str(status), True
            )
            return
        client = self.transport
        if not self.closed and client is not None and not client.is_closing():
            client.write(data)
            self.counters.latency(conn.address, monotonic() - conn.t0)
            self.counters.answered(conn.address, status)  # (500, 501...: errors)
        self._fast_end()
        if self.queue:  # requests that came in behind this one
            self._wake_worker()

    def _served(self, address: Address) -> None:
        """A success of ``address`` (the C fast path's, when it has no
        counters of that upstream yet)."""
        success(self.counters.of(address))

    def fast_done(self, conn: UpstreamConnection, reusable: bool) -> None:
        self.counters.latency(conn.address, monotonic() - conn.t0)
        self.counters.answered(conn.address, conn.status)
        if reusable:
            self.pool.release(conn)
        else:
            self.pool.discard(conn)
        self._fast_end()
        if self.queue:  # requests that came in behind this one
            self._wake_worker()

    def fast_failed(self, conn: UpstreamConnection, exc: Exception) -> None:
        self.pool.discard(conn)
        if conn.sink is not None:  # the response broke after it started: its status counts
            self.counters.answered(conn.address, conn.status)
            self._fast_end()
            if self.transport is not None:
                self.transport.abort()
            self.closed = True
            return
        address = conn.address
        stale = conn.reused and not conn.got_bytes  # a pooled connection the server had closed
        self._fast_fallback(f"{address[0]}:{address[1]}: {exc}", None if stale else address, RESET)

    def fast_expired(self) -> None:
        conn = self.upstream
        if conn is None or conn.owner is not self:
            return
        conn.owner = None
        self.pool.discard(conn)
        address = conn.address
        self._fast_fallback(
            f"{address[0]}:{address[1]}: no answer within {self.settings.per_try_timeout:g} s",
            address,
            TIMEOUT,
            hung=self._fast_region,  # a region that hangs: do not wait on its other endpoints
        )

    def _fast_fallback(
        self,
        why: str,
        failed: Address | None,
        kind: str,
        gateway: bool = False,
        hung: Sequence[Address] | None = None,
    ) -> None:
        """The first try failed before anything reached the client: the
        general path makes the next tries, ahead of anything queued. It
        skips ``failed`` (None: a stale pooled connection, worth a fresh
        one) and, when given, every region with an endpoint in ``hung``."""
        req = Request()
        req.data = self._fast_request
        req.method = "HEAD" if req.data.startswith(b"HEAD") else "GET"
        req.groups = self._fast_groups
        req.failed = failed
        req.hung = hung
        req.last_error = why
        tried = failed or (hung[0] if hung else None)
        if tried is not None:  # (a stale pooled connection is nobody's error)
            self.counters.error(tried, kind, gateway)
        self._fast_end()
        if self.closed:
            return
        self.queue.appendleft(req)
        self._wake_worker()

    # ---- the general path: one request at a time, in order, in a task
    def _wake_worker(self) -> None:
        if self.worker is None:
            self.worker = self.loop.create_task(self._work())
        self.wake.set()

    async def _work(self) -> None:
        try:
            while not self.closed:
                if not self.queue or self.inflight:
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                req = self.queue.popleft()
                if req.refusal is not None:  # (dataplane: _refuse) answered, then closed
                    if self.transport is not None:
                        self.transport.write(req.refusal)
                        self.transport.close()
                    self.closed = True
                    return
                self._maybe_resume()
                self.inflight = True
                try:
                    await self._forward(req)
                finally:
                    self.inflight = False
                    if not self.closed:
                        self._release(req)
                        self._maybe_resume()
                if not req.keep_alive and self.transport is not None:
                    self.transport.close()
                    return
        except Exception:
            log.exception("HTTP proxy worker failed")
            if self.transport is not None:
                self.transport.abort()

    async def _forward(self, req: Request) -> None:
        client = self.transport
        assert client is not None
        if not req.last_error:  # (a request the fast path began is counted already)
            self.stats["requests"] = self.stats.get("requests", 0) + 1
        groups = req.groups
        extra = b""
        picked = (
            self.affine.groups(self.client_ip, req.headers)
            if groups is None and self.affine is not None
            else None
        )
        if picked is not None:
            groups, extra = picked
        elif groups is None:
            groups = self.choose()
            if self.on_route_used is not None:
                self.on_route_used()
            pin, self._pin = self._pin, None
            if pin is not None and groups and groups[0] and groups[0][0] != pin:
                groups = [[pin, *(a for a in groups[0] if a != pin)], *groups[1:]]
        if not any(groups):
            self.stats["refused"] = self.stats.get("refused", 0) + 1
            client.write(
                simple_response(
                    503,
                    "Service Unavailable",
                    "no region may receive traffic (FAIL_CLOSED or no route)",
                )
            )
            return
        gauge = self._gauge
        if gauge is not None:
            gauge.n += 1
        retrying = [False]  # (in another region, within the retry budget)
        try:
            refusal = await self._tries(req, groups, client, retrying, extra)
        finally:
            if gauge is not None:
                gauge.n -= 1
            if retrying[0] and self.budget is not None:
                self.budget.done()
        if refusal is not None:
            self.stats["failed"] = self.stats.get("failed", 0) + 1
            client.write(refusal)

    async def _tries(
        self,
        req: Request,
        groups: Sequence[Sequence[Address]],
        client: asyncio.Transport,
        retrying: list[bool],
        extra: bytes = b"",
    ) -> bytes | None:
        """Try ``req`` region by region, endpoint by endpoint (dataplane/retry.py);
        None once answered (or the client left), else the answer it gets."""
        data = req.serialize(self.client_ip)
        idempotent = req.method in IDEMPOTENT
        last_error = req.last_error or "no upstream answered"
        tries = 1 if req.last_error else 0  # the fast path made the first one
        hung = req.hung
        for i, group in enumerate(groups):  # regions in failover order
            if hung is not None and any(address in hung for address in group):
                continue  # the region whose first try hung, wherever the route now has it
            if i > 0 and tries > 0 and self.budget is not None and not retrying[0]:
                refused = self.budget.admit()  # (a retry into another region)
                if refused is not None:
                    self.stats["retry_budget_exhausted"] = (
                        self.stats.get("retry_budget_exhausted", 0) + 1
                    )
                    return simple_response(503, "Service Unavailable", refused)
                retrying[0] = True
            for address in group:  # endpoints of one region
                if address == req.failed:
                    continue
                if tries > 0:
                    self.stats["retries"] = self.stats.get("retries", 0) + 1
                tries += 1
                active = self.active
                if active is not None:
                    active[address] = active.get(address, 0) + 1
                try:
                    status = await self._try(
                        address, data, req.method == "HEAD", idempotent, client, req.http11, extra
                    )
                    if status:
                        self.counters.answered(address, status)
                    return None
                except _Retry as exc:
                    self.counters.error(address, exc.kind, exc.gateway)
                    last_error = exc.message
                    step = next_try(idempotent, exc.sent, exc.timed_out)
                    if step is NextTry.GIVE_UP:
                        return _bad_gateway(last_error)
                    if step is NextTry.NEXT_REGION:
                        break
                finally:
                    if active is not None:
                        count_down(active, address)
                if self.closed:
                    return None
        return _bad_gateway(last_error)

    async def _try(
        self,
        address: Address,
        data: bytes,
        head_only: bool,
        idempotent: bool,
        client: asyncio.Transport,
        http11: bool = True,
        extra: bytes = b"",
    ) -> int:
        """One try; the status it was answered with (0: the client left first)."""
        loop = asyncio.get_running_loop()
        for attempt in range(2):  # a stale pooled connection gets one fresh retry, same address
            conn = self.pool.idle(address) if attempt == 0 else None
            if conn is None:
                try:
                    conn = await self.pool.acquire(address)
                except (OSError, TimeoutError) as exc:
                    raise _Retry(
                        f"{address[0]}:{address[1]}: connect failed ({type(exc).__name__}); request not sent",
                        CONNECT_TIMEOUT if isinstance(exc, TimeoutError) else REFUSED,
                        gateway=True,
                        sent=False,
                    ) from None
            reused = conn.reused
            conn.start(data, head_only)
            if http11:  # (an HTTP/1.0 client never gets an interim answer)
                conn.interim_to = client
            self.upstream = conn
            head = conn.head
            assert head is not None and conn.done is not None
            # the per-try deadline: a bare timer failing the head future costs far
            # less than asyncio.timeout + shield on every request
            timer = loop.call_later(self.settings.per_try_timeout, expire_head, head)
            try:
                status = await head
            except TimeoutError:
                self.pool.discard(conn)
                self.upstream = None
                raise _Retry(
                    f"{address[0]}:{address[1]}: no answer within {self.settings.per_try_timeout:g} s",
                    TIMEOUT,
                    timed_out=True,
                ) from None
            except (ConnectionError, OSError) as exc:
                self.pool.discard(conn)
                self.upstream = None
                if reused and not conn.got_bytes and attempt == 0:
                    continue
                raise _Retry(f"{address[0]}:{address[1]}: {exc}", RESET) from None
            finally:
                timer.cancel()
            if self.closed or client.is_closing():  # the client left while we waited
                self.pool.discard(conn)
                self.upstream = None
                return 0
            if status in RETRY_STATUSES and idempotent:
                self.pool.discard(conn)
                self.upstream = None
                raise _Retry(
                    f"{address[0]}:{address[1]}: answered {status}",
                    str(status),
                    gateway=status in GATEWAY_STATUSES,
                )
            conn.commit(client, extra)
            try:
                reusable = await conn.done
            except (ConnectionError, OSError):
                client.abort()  # the response broke after it started: nothing else is honest
                self.closed = True
                return status
            finally:
                self.upstream = None
            self.counters.latency(address, monotonic() - conn.t0)
            if reusable:
                self.pool.release(conn)
            else:
                self.pool.discard(conn)
            return status
        return 0


def _bad_gateway(why: str) -> bytes:
    return simple_response(502, "Bad Gateway", f"upstream failed: {why}")
