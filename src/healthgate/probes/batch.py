"""Plain TCP and HTTP probes in batches, on raw non-blocking sockets.

Why not one coroutine per probe
-------------------------------
On these machines (virtual, two cores) the cost of a health probe at a low
rate is dominated by *wake-ups*, not by work: every return from an idle
``epoll_wait`` costs 100-170 µs of CPU, more than the kernel's whole TCP
handshake. A probe run as a Task on the event loop wakes it three times (its
timer, the connect, the answer). HAProxy wakes about once per four checks.

So the scheduler drives this prober from one *tick* (16 ms at low rates): at
each tick it starts every probe that is due and calls :meth:`poll`, which
reads a private ``epoll`` set without blocking and finishes every probe whose
socket is ready or whose deadline has passed. A thousand probes a second then
cost ~60 wake-ups, not 3,000, and each wake-up does a batch of work with warm
caches. Times are measured at tick resolution: a response time or a timeout is
known to within one tick, which is far below the seconds the health windows
are made of.

What a probe does on the wire (HAProxy does the same):

* **TCP** (SPEC §2.1, seed 003): ``socket``; ``connect``, which completes
  the handshake - SYN, SYN+ACK, and the prober's ACK, sent by the kernel
  at once (its default, which a disconnect restores) - then close with
  ``SO_LINGER`` 0 (a reset: no TIME_WAIT on either side). The connection
  reaches the server's accept queue, as the seed's check does.
  With ``ProbeSettings.tcp_half_open`` (an option, never the default) the
  check is HAProxy's: ``TCP_QUICKACK`` off, so the final ACK is held back,
  and the reset follows the SYN+ACK - the server's kernel answered the SYN,
  but the connection never reaches its accept queue. Where the process
  may open a raw socket (root, ``CAP_NET_RAW``) and the endpoint is IPv4,
  the half-open check is a raw SYN instead (:mod:`healthgate.probes.syn`:
  no socket, connect or epoll entry per check; ``ProbeSettings.raw_syn``).
* **Sockets are reused.** Instead of ``close``, a finished probe's socket is
  disconnected with ``connect(AF_UNSPEC)`` (which sends the RST) and kept in
  a pool; the next probe connects it again. It stays in the epoll set
  (edge-triggered, registered once), so a probe costs ``connect`` and the
  disconnect instead of ``socket``, ``epoll_ctl``, ``connect`` and ``close``:
  half the CPU per TCP check, measured. Both are one call into C each
  (``_speedups.connect_fd`` / ``disconnect_fd``, with the endpoint's address
  packed once; without the module, ``connect_ex`` and ctypes), and a TCP
  check whose connect completes inside the call (loopback) makes no probe
  object: its result is returned at once, and the scheduler ends the tick's
  such results together.
* **HTTP**: the same connect, and the request is written at once (on a
  loopback or a fast network the handshake has completed by then; otherwise
  it waits for the socket to become writable), so the held-back ACK travels
  with the request. The status line and headers are read (at most
  ``max_head_bytes``), then the connection is reset. With ``keepalive`` the
  connection stays open between probes when the response allows it
  (:func:`~healthgate.probes.http.parse_head`), stays in the epoll set and
  the fd map with its probe state, which serves the key's next probe (a send,
  no allocation, no map moves); and a kept connection that turns out to be
  closed before any byte of the answer is retried once on a fresh connection
  within the same deadline.

HTTPS and gRPC are not here: they run as coroutines on the event loop
(:class:`~healthgate.probes.prober.Prober`), where TLS and grpcio live.
Failures are values, never exceptions: refused, reset, timeout, malformed,
or an error naming the system call's reason.
"""

from __future__ import annotations

import _socket
import ctypes
import errno
import heapq
import logging
import os
import select
import socket
import struct
import time
from collections.abc import Callable, Hashable
from typing import Any, Final, cast

from healthgate import http_scan
from healthgate.health.states import Outcome, ProbeResult, local_failure
from healthgate.http_scan import whole_response
from healthgate.probes.http import (
    BODY_SEARCHED,
    HttpHead,
    build_request,
    parse_head,
    scan_body,
)
from healthgate.probes.lane import KeptLane, laneable
from healthgate.probes.prober import ProbeSettings, expect_verdict, verdict
from healthgate.probes.spec import ProbeSpec
from healthgate.probes.stats import PROBE_BUCKETS
from healthgate.probes.syn import SynPacket, SynSocket

log = logging.getLogger("healthgate.probes")

_EPOLLDOWN: Final = select.EPOLLERR | select.EPOLLHUP
_READABLE: Final = select.EPOLLIN | select.EPOLLRDHUP | _EPOLLDOWN
# Every socket is registered once, edge-triggered, for everything: no epoll_ctl per probe.
_MASK: Final = select.EPOLLIN | select.EPOLLOUT | select.EPOLLRDHUP | select.EPOLLET
_LINGER_RST: Final = struct.pack("ii", 1, 0)
_SOL_SOCKET: Final = socket.SOL_SOCKET
_SO_LINGER: Final = socket.SO_LINGER
_SO_ERROR: Final = socket.SO_ERROR
_QUICKACK: Final = getattr(socket, "TCP_QUICKACK", 0)
_STREAM: Final = socket.SOCK_STREAM | socket.SOCK_NONBLOCK
_NOT_YET: Final = frozenset({errno.EAGAIN, errno.ENOTCONN, errno.EINPROGRESS})
# A socket's address family as a plain int: socket.family converts it to an
# enum member each time, ~1.5 us, once per probe.
_family: Final = cast(Callable[[socket.socket], int], _socket.socket.family.__get__)

# per-probe outcomes as globals (see the note on Outcome)
_OK: Final = Outcome.OK
_TIMEOUT: Final = Outcome.TIMEOUT
_REFUSED: Final = Outcome.REFUSED
# a TCP check whose connect completed inside the call (immutable: one for all)
_OK_AT_ONCE: Final = ProbeResult(Outcome.OK, 0.0)

_SLOTS_PER_S: Final = 100  # deadline wheel: 10 ms slots
_EVENTS: Final = 64  # epoll events read at a time (poll checks its time budget between reads)
_POOL_MAX: Final = 1024  # disconnected sockets kept for reuse, per address family

try:  # connect(AF_UNSPEC) dissolves a TCP association and leaves the socket reusable
    # (no argtypes, no errno: the call then costs ~1 us less, once per probe; an
    # int and a buffer convert to int and pointer by themselves)
    _libc_connect = ctypes.CDLL(None).connect
    _libc_connect.restype = ctypes.c_int
    _UNSPEC: ctypes.Array[ctypes.c_char] | None = ctypes.create_string_buffer(
        struct.pack("=HH12x", socket.AF_UNSPEC, 0), 16
    )
except (OSError, AttributeError):
    _UNSPEC = None

# The connect and the disconnect of a check as one system call each, in C
# (_speedups.c), when built; else connect_ex and ctypes (above).
_connect_fd: Callable[[int, bytes], int] | None = None
_disconnect_fd: Callable[[int], int] | None = None
if http_scan.speedups is not None:
    _connect_fd = http_scan.speedups.connect_fd
    _disconnect_fd = http_scan.speedups.disconnect_fd


def pack_sockaddr(ip: str, port: int) -> bytes | None:
    """``ip``:``port`` as the kernel's sockaddr_in / sockaddr_in6 (what
    connect_fd takes), or None for an address with a scope (``%eth0``),
    which is left to Python's own parsing. OSError for no IP address."""
    # family (host order), port (network order), then the address: IPv6's
    # between a zero flow label and a zero scope, IPv4's before 8 zero bytes
    if ":" in ip:
        if "%" in ip:
            return None
        head = struct.pack("=H", socket.AF_INET6) + struct.pack("!HI", port, 0)
        return head + socket.inet_pton(socket.AF_INET6, ip) + bytes(4)
    head = struct.pack("=H", socket.AF_INET) + struct.pack("!H", port)
    return head + socket.inet_pton(socket.AF_INET, ip) + bytes(8)


# A probe waits for its socket to become writable (the connect, or the rest of the
# request), then for the answer (HTTP); a kept-alive connection between probes is idle.
_CONNECTING: Final = 0
_SENT: Final = 1
_IDLE: Final = 2

# what the lane hands back (_kept.c: HANDBACK_*)
LANE_ANSWER: Final = 0  # an answer that is not a steady success, to read here
LANE_TIMEOUT: Final = 1
LANE_IDLE: Final = 2  # the idle connection spoke or closed: dropped, due again at its time
LANE_UNSENT: Final = 3  # the request could not be sent: dropped, due again at once
LANE_FAILED: Final = 4  # a TCP or fresh HTTP check's connection failed (its errno; 0: closed)
LANE_HANDED: Final = 5  # a fresh HTTP check's answer, to read on here on the lane's socket
LANE_SENDING: Final = 6  # a fresh HTTP check's request, part sent, to send on here (its socket)

# a key the lane handed back: (key, what, started, due, its result if it ended)
LaneHandback = tuple[Hashable, int, float, float, ProbeResult | None]


def errno_result(err: int, latency: float) -> ProbeResult:
    if err == errno.ECONNREFUSED:
        return ProbeResult(Outcome.REFUSED, latency)
    if err in (errno.ECONNRESET, errno.EPIPE):
        return ProbeResult(Outcome.RESET, latency)
    if err == errno.ETIMEDOUT:
        return ProbeResult(Outcome.TIMEOUT, latency)
    return ProbeResult(Outcome.ERROR, latency, 0, os.strerror(err))


class _Probe:
    """One probe in flight - and, kept alive, its connection between probes:
    the same object serves the key's next probe (see :meth:`BatchProber.start`)."""

    __slots__ = (
        "active",
        "buf",
        "deadline",
        "fd",
        "key",
        "local_port",
        "pending",
        "request",
        "reused",
        "seq",
        "sock",
        "spec",
        "start",
        "state",
    )

    def __init__(self, key: Hashable, spec: ProbeSpec, start: float) -> None:
        self.key = key
        self.spec = spec
        self.start = start
        self.deadline = start + spec.timeout
        self.sock: socket.socket | None = None
        self.fd = -1
        self.state = _CONNECTING
        self.request = b""  # HTTP: the whole request
        self.pending = b""  # request bytes still to write
        self.buf = b""
        self.reused = False
        self.active = True
        self.seq = -1  # a raw SYN's sequence number (probes/syn.py)
        self.local_port = 0  # ... and the port it left from


class BatchProber:
    """TCP and HTTP probes without coroutines; see the module docstring.

    The caller guarantees at most one probe per key at a time (the scheduler
    does), calls :meth:`start` for a due probe and :meth:`poll` once per tick.
    """

    def __init__(self, settings: ProbeSettings | None = None) -> None:
        self.settings = settings or ProbeSettings()
        self._ep = select.epoll()
        self._fds: dict[int, _Probe] = {}
        self._running: dict[Hashable, _Probe] = {}
        # kept-alive connections between probes, by key (their fds stay in _fds)
        self._idle: dict[Hashable, _Probe] = {}
        # deadlines on a wheel of 10 ms slots (a probe times out up to one slot
        # late): appending is O(1), a heap of occupied slot numbers finds the next
        self._expiry: dict[int, list[_Probe]] = {}
        self._expiry_slots: list[int] = []
        self._expiry_count = 0
        self._requests: dict[Hashable, tuple[ProbeSpec, bytes]] = {}  # by key
        # by key: its spec and endpoint as a packed sockaddr (for _connect_fd)
        self._addresses: dict[Hashable, tuple[ProbeSpec, bytes | None]] = {}
        self._pool: dict[int, list[socket.socket]] = {socket.AF_INET: [], socket.AF_INET6: []}
        self.backlog = False  # the last poll stopped with events still ready
        # half-open TCP checks on a raw socket (probes/syn.py), opened at the first one
        self._syn: SynSocket | None = None
        self._syn_tried = False
        self._by_seq: dict[int, _Probe] = {}  # raw SYNs in flight
        # by key: its spec, SYN and probe object (reused)
        self._packets: dict[Hashable, tuple[ProbeSpec, SynPacket, _Probe]] = {}
        # the lane (probes/lane.py), once opened, and the probe objects of its
        # keys (their sockets: out of _fds and the epoll set; None for a TCP
        # or fresh HTTP check, whose sockets are the lane's own)
        self.lane: Any = None
        self._laned: dict[Hashable, _Probe | None] = {}

    @staticmethod
    def handles(spec: ProbeSpec) -> bool:
        return spec.type in ("TCP", "HTTP")

    @property
    def in_flight(self) -> int:
        return len(self._running)

    # ------------------------------------------------------------------ start

    def start(self, key: Hashable, spec: ProbeSpec, now: float) -> ProbeResult | None:
        """Begin a probe of ``key``. Returns its result when it is already
        known (a synchronous refusal, a local error), else None: the result
        comes from a later :meth:`poll`."""
        if spec.type == "HTTP" and self._idle:
            kept = self._idle.pop(key, None)
            if kept is not None:
                if kept.spec is spec and self._reuse(kept, now):
                    self._expire_at(kept)
                    return None
                self._drop_idle(kept)
        tcp = spec.type == "TCP"
        if tcp and spec.plain_tcp:
            if self.settings.tcp_half_open and ":" not in spec.ip:
                syn = self._syn if self._syn_tried else self._open_syn()
                if syn is not None:
                    return self._send_syn(syn, key, spec, now)
            return self._start_tcp(key, spec, now)
        p = _Probe(key, spec, now)
        if tcp:  # SPEC §10: the PROXY preamble and send, and perhaps an expected answer
            p.request = spec.preamble + spec.send
            p.pending = p.request
        else:
            cached = self._requests.get(key)
            if cached is not None and cached[0] is spec:
                p.request = cached[1]
            else:  # a new key, or its spec changed
                p.request = build_request(
                    spec.path,
                    spec.host or spec.ip,
                    self.settings.keepalive,
                    spec.method,
                    spec.headers,
                    spec.body,
                )
                self._requests[key] = (spec, p.request)
            # (the PROXY preamble opens a connection: a kept one's next requests go alone)
            p.pending = spec.preamble + p.request if spec.preamble else p.request
        result = self._connect(p, now)
        if result is None:
            self._expire_at(p)
        return result

    def _start_tcp(self, key: Hashable, spec: ProbeSpec, now: float) -> ProbeResult | None:
        """A TCP check. Where the connect completes within the call, the
        check is over before a probe object would be made, so none is.
        (Linux on loopback says EINPROGRESS even so, measured 2026-12-06:
        the SYN+ACK waits for the socket's lock, which connect holds.)"""
        dialed = self._dial(key, spec, now, now)
        if isinstance(dialed, ProbeResult):
            return dialed
        sock, err = dialed
        if err == 0:
            self._release(sock)
            return _OK_AT_ONCE
        p = _Probe(key, spec, now)
        p.sock = sock
        p.fd = fd = sock.fileno()
        self._fds[fd] = p
        self._running[key] = p
        self._expire_at(p)
        return None

    def _open_syn(self) -> SynSocket | None:
        self._syn_tried = True
        if self.settings.raw_syn:
            self._syn = SynSocket.open(self.settings.source)
        if self._syn is None:
            log.info(
                "half-open TCP checks connect() and reset: %s",
                "raw SYNs are off"
                if not self.settings.raw_syn
                else "this process cannot open a raw socket (that needs root or CAP_NET_RAW)",
            )
        else:
            log.info("half-open TCP checks send raw SYNs (random sequence numbers and ports)")
        return self._syn

    def _send_syn(
        self, syn: SynSocket, key: Hashable, spec: ProbeSpec, now: float
    ) -> ProbeResult | None:
        """A raw SYN. The key's packet and probe object are kept and serve
        its next probes (as a kept-alive connection's do: an expiry entry of
        an earlier probe finds it active again, but not yet due)."""
        cached = self._packets.get(key)
        if cached is not None and cached[0] is spec:
            packet, p = cached[1], cached[2]
            p.start, p.deadline, p.active = now, now + spec.timeout, True
        else:
            try:
                packet = syn.packet(spec.ip, spec.port)
            except OSError as exc:  # no route to the address, say
                return ProbeResult(Outcome.ERROR, 0.0, 0, exc.strerror or str(exc))
            p = _Probe(key, spec, now)
            self._packets[key] = (spec, packet, p)
        try:
            seq, p.local_port = syn.send(packet, spec.ip, self._by_seq)
        except OSError as exc:
            p.active = False
            return errno_result(exc.errno or 0, now - p.start)
        p.seq = seq
        self._by_seq[seq] = p
        self._running[p.key] = p
        self._expire_at(p)
        return None

    def _answers(
        self, syn: SynSocket, now: float, until: float, done: list[tuple[Hashable, ProbeResult]]
    ) -> bool:
        """Finish the raw SYNs answered; False when reading stopped for the
        time budget with answers perhaps still waiting."""
        by_seq = self._by_seq
        while True:
            answers, more = syn.answers()
            for seq, src, sport, dport, up in answers:
                p = by_seq.get(seq)
                if p is None or src != p.spec.ip or sport != p.spec.port or dport != p.local_port:
                    continue  # late (the probe timed out), or not an answer to it
                self._finish(p, False)
                done.append((p.key, ProbeResult(_OK if up else _REFUSED, now - p.start)))
            if not more:
                return True
            if time.perf_counter() > until:
                return False

    def _expire_at(self, p: _Probe) -> None:
        slot = int(p.deadline * _SLOTS_PER_S) + 1  # the first slot wholly after the deadline
        probes = self._expiry.get(slot)
        if probes is None:
            probes = self._expiry[slot] = []
            heapq.heappush(self._expiry_slots, slot)
        probes.append(p)
        self._expiry_count += 1

    def _reuse(self, p: _Probe, now: float) -> bool:
        """The next probe of a kept-alive connection (``p``, idle): send the
        request again. False when the connection is gone (then dropped)."""
        sock = p.sock
        assert sock is not None
        try:
            sent = sock.send(p.request)
        except OSError:
            self._drop_idle(p)
            return False
        p.start, p.deadline, p.active, p.reused, p.buf = now, now + p.spec.timeout, True, True, b""
        if sent == len(p.request):
            p.state = _SENT
        else:  # a full send buffer on a health check: wait until writable
            p.state, p.pending = _CONNECTING, p.request[sent:]
        self._running[p.key] = p
        return True

    def _drop_idle(self, p: _Probe) -> None:
        """Close a kept-alive connection that is idle (no longer in ``_idle``)."""
        self._fds.pop(p.fd, None)
        if p.sock is not None:
            self._release(p.sock)
            p.sock = None

    def _dial(
        self, key: Hashable, spec: ProbeSpec, started: float, now: float
    ) -> tuple[socket.socket, int] | ProbeResult:
        """A pooled (or new) socket connecting to ``spec``'s endpoint: the
        socket and 0 (connected) or EINPROGRESS; or the check's result when
        it ended there (refused at once, an error)."""
        family = socket.AF_INET6 if ":" in spec.ip else socket.AF_INET
        pool = self._pool[family]
        try:
            sock = pool.pop() if pool else self._socket(family)
        except OSError as exc:  # out of file descriptors, say: no result, not a failure
            return local_failure(exc, now - started) or ProbeResult(
                Outcome.ERROR, now - started, 0, exc.strerror or str(exc)
            )
        try:
            if _QUICKACK and (
                spec.type == "HTTP" or self.settings.tcp_half_open or spec.send or spec.preamble
            ):
                # held back: HTTP's ACK travels with the request (as a TCP
                # check's with what it sends), and a half-open TCP check
                # resets before it. A full TCP check wants the kernel's
                # default (the ACK sent at once), which a new socket has and
                # the disconnect restores (Linux's tcp_disconnect clears the
                # delayed-ACK state, inet_csk_delack_init): one system call
                # less per check (1.3 % of a full check's CPU under perf)
                sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 0)
            address = None
            if _connect_fd is not None:
                cached = self._addresses.get(key)
                if cached is None or cached[0] is not spec:
                    cached = self._addresses[key] = (spec, pack_sockaddr(spec.ip, spec.port))
                address = cached[1]
            if _connect_fd is not None and address is not None:
                err = _connect_fd(sock.fileno(), address)
            else:  # (no C, or an address left to Python's parsing: a scoped IPv6 one)
                err = sock.connect_ex((spec.ip, spec.port))
        except OSError as exc:
            sock.close()
            return ProbeResult(Outcome.ERROR, now - started, 0, exc.strerror or str(exc))
        if err not in (0, errno.EINPROGRESS):
            self._release(sock)
            return errno_result(err, now - started)
        return sock, err

    def _connect(self, p: _Probe, now: float) -> ProbeResult | None:
        """An HTTP probe's connection, and its request written at once."""
        dialed = self._dial(p.key, p.spec, p.start, now)
        if isinstance(dialed, ProbeResult):
            return dialed
        sock = dialed[0]
        fd = sock.fileno()
        p.sock, p.fd, p.reused, p.buf = sock, fd, False, b""
        if not p.pending:  # a TCP check that reads a banner: wait for it
            p.state = _SENT
        else:
            try:
                sent = sock.send(p.pending)
            except OSError as exc:
                if exc.errno not in _NOT_YET:
                    self._release(sock)
                    return errno_result(exc.errno or 0, now - p.start)
            else:
                p.pending = p.pending[sent:]
                if not p.pending:
                    if p.spec.type == "TCP" and not p.spec.expect:  # sent: that was all
                        self._release(sock)
                        return ProbeResult(_OK, now - p.start)
                    p.state = _SENT
        self._fds[fd] = p
        self._running[p.key] = p
        return None

    # ------------------------------------------------------------------ poll

    def poll(self, now: float, until: float = float("inf")) -> list[tuple[Hashable, ProbeResult]]:
        """Finish what is ready and what has run out of time, without blocking.

        Stops early once ``time.perf_counter()`` passes ``until`` with events
        still waiting; ``backlog`` then says to call again soon (and timeouts
        wait for that call: a probe whose answer is in but not yet read must
        not be expired)."""
        done: list[tuple[Hashable, ProbeResult]] = []
        fds = self._fds
        self.backlog = False
        while True:
            events = self._ep.poll(0, _EVENTS)
            for fd, ev in events:
                p = fds.get(fd)
                if p is None:
                    continue  # a pooled socket's own disconnect
                if p.state == _IDLE:
                    if ev & _READABLE:  # a kept connection spoke or closed while idle
                        if self._idle.get(p.key) is p:
                            del self._idle[p.key]
                        self._drop_idle(p)
                    continue  # (writable only: a late ACK of the last request)
                result = self._event(p, ev, now)
                if result is not None:
                    done.append((p.key, result))
            if len(events) < _EVENTS:
                break
            if time.perf_counter() > until:
                self.backlog = True
                return done
        if (
            self._by_seq
            and self._syn is not None
            and not self._answers(self._syn, now, until, done)
        ):
            self.backlog = True
            return done
        slots, expiry = self._expiry_slots, self._expiry
        last = int(now * _SLOTS_PER_S)
        while slots and slots[0] <= last:
            probes = expiry.pop(heapq.heappop(slots))
            self._expiry_count -= len(probes)
            for p in probes:
                # (a kept-alive probe object serves its key's next probes
                # too: an entry of an earlier one finds it active again, but
                # not yet due)
                if p.active and p.deadline <= now:
                    self._finish(p, False)
                    done.append((p.key, ProbeResult(_TIMEOUT, now - p.start)))
        if self._expiry_count > 4 * len(self._running) + 4096:
            # finished probes stay on the wheel until their slot passes; with
            # long timeouts they would pile up, so drop them now and then
            for slot in list(expiry):
                expiry[slot] = [p for p in expiry[slot] if p.active]
            self._expiry_count = sum(len(v) for v in expiry.values())
        return done

    def _event(self, p: _Probe, ev: int, now: float) -> ProbeResult | None:
        if p.state == _CONNECTING:
            return self._connected(p, ev, now)
        if not ev & _READABLE:
            return None  # only the ACK of the request freed send space
        return self._read(p, ev, now)

    def _connected(self, p: _Probe, ev: int, now: float) -> ProbeResult | None:
        """The connect finished (or failed): TCP is done, HTTP sends its request."""
        sock = p.sock
        assert sock is not None
        if ev & _EPOLLDOWN:
            err = sock.getsockopt(_SOL_SOCKET, _SO_ERROR)
            self._finish(p, False)
            if err:
                return errno_result(err, now - p.start)
            return ProbeResult(Outcome.RESET, now - p.start, 0, "connection closed")
        tcp = p.spec.type == "TCP"
        if tcp and not p.pending:
            self._finish(p, False)
            return ProbeResult(_OK, now - p.start)
        try:
            sent = sock.send(p.pending)
        except OSError as exc:
            if exc.errno in _NOT_YET:
                return None
            self._finish(p, False)
            return errno_result(exc.errno or 0, now - p.start)
        p.pending = p.pending[sent:]
        if not p.pending:
            if tcp and not p.spec.expect:  # sent: that was all
                self._finish(p, False)
                return ProbeResult(_OK, now - p.start)
            p.state = _SENT
        return None

    def _read_expected(self, p: _Probe, now: float) -> ProbeResult | None:
        """A TCP check's answer: its first ``expect`` bytes (SPEC §10)."""
        sock = p.sock
        assert sock is not None
        want = len(p.spec.expect)
        while True:
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                return None
            except OSError as exc:
                self._finish(p, False)
                return errno_result(exc.errno or 0, now - p.start)
            if data:
                p.buf += data
                if len(p.buf) < want:
                    continue
            self._finish(p, False)
            return expect_verdict(p.spec, p.buf[:want] if p.buf else None, now - p.start)

    def _read(self, p: _Probe, ev: int, now: float, first: bytes = b"") -> ProbeResult | None:
        """The answer, as it arrives: the head (and, for responseContains, the
        body); ``first``: what was read of it already (the lane's)."""
        sock = p.sock
        assert sock is not None
        spec = p.spec
        if spec.type == "TCP":
            return self._read_expected(p, now)
        max_head = self.settings.max_head_bytes
        while True:  # edge-triggered: read until the head is complete or nothing is left
            if first:
                data, first = first, b""
            else:
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    return None
                except OSError as exc:
                    if p.reused and not p.buf:
                        return self._retry(p, now)
                    self._finish(p, False)
                    return errno_result(exc.errno or 0, now - p.start)
            if not data:
                if p.reused and not p.buf:
                    return self._retry(p, now)
                self._finish(p, False)
                end = p.buf.find(b"\r\n\r\n") if p.spec.contains else -1
                if end >= 0:  # (a body that ends with the connection: search what came)
                    head = self._body(p, end, eof=True)
                    assert head is not None
                    return verdict(p.spec, head, now - p.start)
                error = "connection closed mid-response" if p.buf else "closed"
                return verdict(p.spec, HttpHead(error=error), now - p.start)
            buf = p.buf = p.buf + data
            if whole_response is not None and not spec.contains and spec.method != "HEAD":
                # the usual answer, one whole reusable response, read in C
                # (http_scan.py): what parse_head would say of it, at
                # a twentieth of its cost (its body, within len(buf), fits)
                status = whole_response(buf)
                if status and len(buf) <= self.settings.max_body_bytes:
                    head = HttpHead(status, reusable=True)
                    break
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                if p.spec.contains:  # responseContains: the body decides
                    body_head = self._body(p, end, eof=False)
                    if body_head is None:
                        continue  # (more of the body to read)
                    head = body_head
                    break
                head = parse_head(buf, end, self.settings.max_body_bytes, spec.method == "HEAD")
                break
            if len(buf) > max_head:
                head = HttpHead(error=f"response head larger than {max_head} bytes")
                break
        keep = self.settings.keepalive and head.reusable and not ev & select.EPOLLRDHUP
        self._finish(p, keep)
        return verdict(p.spec, head, now - p.start)

    def _body(self, p: _Probe, end: int, eof: bool) -> HttpHead | None:
        """A responseContains check's verdict once its body has said enough
        (None: read on; http.py's scan_body says how much)."""
        buf = p.buf
        if whole_response is not None and len(buf) <= self.settings.max_body_bytes:
            status = whole_response(buf)
            if status:  # one whole response (see _read): its body is the rest of buf
                head = HttpHead(status, reusable=True)
                head.found = p.spec.contains in buf[end + 4 : end + 4 + BODY_SEARCHED]
                return head
        head = parse_head(p.buf, end, self.settings.max_body_bytes)
        if head.error:
            return head
        found = scan_body(p.buf, end, head.status, p.spec.contains, eof)
        if found is None:
            return None
        head.found = found
        return head

    def _retry(self, p: _Probe, now: float) -> ProbeResult | None:
        """A kept connection was closed before any byte of the answer: the
        server's idle timeout, not a failure. Once more, fresh, same deadline."""
        self._finish(p, False)
        p.active = True
        p.state = _CONNECTING
        p.pending = p.spec.preamble + p.request
        result = self._connect(p, now)
        if result is not None:  # (refused at once, say): ended here, not at its deadline
            p.active = False
        return result

    def _finish(self, p: _Probe, keep: bool) -> None:
        p.active = False
        if p.seq >= 0:
            self._by_seq.pop(p.seq, None)
            p.seq = -1
        if self._running.get(p.key) is p:
            del self._running[p.key]
        if keep:  # idle until the key's next probe; it stays in the epoll set and _fds
            p.state = _IDLE
            self._idle[p.key] = p
            return
        self._fds.pop(p.fd, None)
        sock = p.sock
        if sock is not None:
            p.sock = None
            self._release(sock)

    def _socket(self, family: int) -> socket.socket:
        sock = socket.socket(family, _STREAM)
        try:
            # Closing and disconnecting then send RST: no FIN exchange, no TIME_WAIT.
            sock.setsockopt(_SOL_SOCKET, _SO_LINGER, _LINGER_RST)
            source = self.settings.source
            if source is not None and (":" in source) == (family == socket.AF_INET6):
                # an explicit address survives the disconnect of a pooled socket
                # (the kernel keeps a bound address; the port is chosen anew)
                sock.bind((source, 0))
            self._ep.register(sock.fileno(), _MASK)
        except OSError:
            sock.close()
            raise
        return sock

    def _release(self, sock: socket.socket) -> None:
        """Disconnect ``sock`` (RST) and keep it for the next probe, or close it."""
        pool = self._pool[_family(sock)]
        if len(pool) < _POOL_MAX:
            if _disconnect_fd is not None:
                if _disconnect_fd(sock.fileno()) == 0:
                    pool.append(sock)
                    return
            elif _UNSPEC is not None and _libc_connect(sock.fileno(), _UNSPEC, 16) == 0:
                pool.append(sock)
                return
        sock.close()

    # ------------------------------------------------------------------ the lane

    def open_lane(self, late_threshold: float, seed: Callable[[], int]) -> bool:
        """Hold steady checks in the lane (probes/lane.py): True when there
        is one (the C speedups are built). ``seed``: its random spreads' seed."""
        if self.lane is None and KeptLane is not None:
            self.lane = KeptLane(
                late_threshold, self.settings.max_body_bytes, PROBE_BUCKETS, seed(), BODY_SEARCHED
            )
        return self.lane is not None

    def enter_lane(self, key: Hashable, spec: ProbeSpec, due: float) -> bool:
        """The probe of ``key`` just ended with a success: its kept
        connection (idle) joins the lane - or, for a plain TCP check or an
        HTTP check on fresh connections, the key -, its next probe due at
        ``due``. False when it cannot (no lane, no kept connection, a check
        that is not plain): the caller arms it as before."""
        lane = self.lane
        if lane is None or type(key) is not int or not laneable(spec, self.settings):
            return False
        if spec.type == "TCP":
            return self._enter_tcp(key, spec, due)
        if not self.settings.keepalive:
            return self._enter_fresh(key, spec, due)
        p = self._idle.get(key)
        if p is None or p.spec is not spec:
            return False
        lo, hi = spec.status_ranges[0]
        self._ep.unregister(p.fd)
        try:
            lane.enter(
                key, p.fd, p.request, spec.interval, spec.timeout, due, lo, hi, spec.contains
            )
        except (OSError, ValueError) as exc:  # (a key out of its range, say)
            log.debug("a kept connection could not join the lane: %s", exc)
            self._ep.register(p.fd, _MASK)
            return False
        del self._idle[key]
        del self._fds[p.fd]
        self._laned[key] = p
        return True

    def _address(self, key: Hashable, spec: ProbeSpec) -> bytes | None:
        """``key``'s endpoint as a packed sockaddr (None: a scoped IPv6
        address, left to Python's parsing)."""
        cached = self._addresses.get(key)
        if cached is None or cached[0] is not spec:
            cached = self._addresses[key] = (spec, pack_sockaddr(spec.ip, spec.port))
        return cached[1]

    def _enter_tcp(self, key: int, spec: ProbeSpec, due: float) -> bool:
        address = self._address(key, spec)
        if address is None:
            return False
        try:
            self.lane.enter_tcp(
                key, address, spec.interval, spec.timeout, due, spec.send, spec.expect
            )
        except (OSError, ValueError) as exc:
            log.debug("a TCP check could not join the lane: %s", exc)
            return False
        self._laned[key] = None
        return True

    def _enter_fresh(self, key: int, spec: ProbeSpec, due: float) -> bool:
        cached = self._requests.get(key)
        address = self._address(key, spec)
        if cached is None or cached[0] is not spec or address is None:
            return False
        lo, hi = spec.status_ranges[0]
        try:
            self.lane.enter_fresh(
                key, address, cached[1], spec.interval, spec.timeout, due, lo, hi, spec.contains
            )
        except (OSError, ValueError) as exc:
            log.debug("an HTTP check could not join the lane: %s", exc)
            return False
        self._laned[key] = None
        return True

    def _go_on(
        self, key: Hashable, what: int, started: float, data: bytes, ev: int, fd: int, now: float
    ) -> ProbeResult | None:
        """A fresh HTTP check, or a TCP check with send or expect, that the
        lane handed over with its socket: it goes on here, as if it had begun
        here - reading on from what the lane read (``LANE_HANDED``), or
        sending the rest of its request (``LANE_SENDING``: ``ev`` bytes of it
        went out)."""
        if key in self._requests:
            spec, request = self._requests[key]
        else:  # a TCP check (no PROXY preamble in the lane: what it sends is all)
            spec = self._addresses[key][0]
            request = spec.send
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        p = _Probe(key, spec, started)
        p.request, p.sock, p.fd = request, sock, fd
        self._ep.register(fd, _MASK)
        self._fds[fd] = p
        self._running[key] = p
        self._expire_at(p)
        if what == LANE_SENDING:
            p.pending = request[ev:]  # (state _CONNECTING: the rest goes when writable)
            return None
        p.state = _SENT
        if spec.type == "TCP":  # fewer bytes than expected, others, or none (closed)
            p.buf = data
            if data and len(data) >= len(spec.expect):
                self._finish(p, False)
                return expect_verdict(spec, data[: len(spec.expect)], now - started)
            return self._read_expected(p, now)
        return self._read(p, ev, now, data)

    def _from_lane(self, key: Hashable) -> _Probe | None:
        """A key's probe object back from the lane, its socket in the epoll
        set again (None: a TCP or fresh HTTP check, which has none)."""
        p = self._laned.pop(key)
        if p is not None:
            self._ep.register(p.fd, _MASK)
            self._fds[p.fd] = p
        return p

    def lane_start(
        self, now: float, horizon: float, budget_end: float, room: int
    ) -> tuple[list[LaneHandback], bool]:
        """Send the lane's requests (and connect its TCP and fresh HTTP
        checks) due before ``horizon``, with at most ``room`` connections of
        its own under way: the keys it handed back - a send that failed (the
        connection dropped), a check that could not begin (both
        ``LANE_UNSENT``, due again at once), one that failed at once (ended:
        its result) or went on here -, and whether the budget ran out first."""
        handed, deferred = self.lane.start(now, horizon, budget_end, room)
        return self._taken_back(handed, now), deferred

    def lane_poll(self, now: float, budget_end: float) -> tuple[bytes, list[LaneHandback], bool]:
        """The lane's answers and timeouts: its steady records, the keys
        it handed back (an answer read here - perhaps still under way: the
        probe is in flight here then -, a timeout, an idle connection that
        spoke or closed), and whether events wait still (the budget ran out)."""
        records, handed, backlog = self.lane.poll(now, budget_end)
        return records, self._taken_back(handed, now), backlog

    def _taken_back(
        self, handed: list[tuple[int, int, float, float, bytes, int, int]] | None, now: float
    ) -> list[LaneHandback]:
        """What the lane handed back, taken up: a timeout or a failed
        connection ended (its result); an answer read on here, or a fresh
        check gone on here on the lane's socket (under way still perhaps: in
        flight here then); an idle or unsent key's connection dropped (no
        result)."""
        back: list[LaneHandback] = []
        for key, what, started, due, data, ev, fd in handed or ():
            p = self._from_lane(key)
            result: ProbeResult | None = None
            if fd >= 0:  # (LANE_HANDED, LANE_SENDING)
                result = self._go_on(key, what, started, data, ev, fd, now)
            elif p is None:  # a TCP or fresh check: the lane has reset its socket
                if what == LANE_TIMEOUT:
                    result = ProbeResult(_TIMEOUT, now - started)
                elif what == LANE_FAILED:
                    result = (
                        errno_result(ev, now - started)
                        if ev
                        else ProbeResult(Outcome.RESET, now - started, 0, "connection closed")
                    )
            elif what == LANE_ANSWER:
                p.start, p.deadline, p.active, p.reused = (
                    started,
                    started + p.spec.timeout,
                    True,
                    True,
                )
                p.state, p.buf = _SENT, b""
                self._running[key] = p
                self._expire_at(p)
                result = self._read(p, ev, now, data)
            else:
                self._drop_idle(p)
                if what == LANE_TIMEOUT:
                    result = ProbeResult(_TIMEOUT, now - started)
            back.append((key, what, started, due, result))
        return back

    # ------------------------------------------------------------------ control

    def cancel(self, key: Hashable) -> bool:
        """Stop a probe of ``key`` in flight and drop its kept connection;
        True when it was in the lane with its request out."""
        sent = False
        if key in self._laned:
            sent = bool(self.lane.leave(key))
            p = self._from_lane(key)
            if p is not None:
                self._drop_idle(p)
        self._requests.pop(key, None)
        self._addresses.pop(key, None)
        self._packets.pop(key, None)
        p = self._running.get(key)
        if p is not None:
            p.state = _CONNECTING
            self._finish(p, False)
        kept = self._idle.pop(key, None)
        if kept is not None:
            self._drop_idle(kept)
        return sent

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()
        for p in self._laned.values():
            if p is not None and p.sock is not None:
                p.sock.close()
        self._laned.clear()
        for key in list(self._running):
            self.cancel(key)
        for kept in self._idle.values():
            if kept.sock is not None:
                kept.sock.close()
        self._idle.clear()
        self._expiry.clear()
        self._expiry_slots.clear()
        self._expiry_count = 0
        for pool in self._pool.values():
            for sock in pool:
                sock.close()
            pool.clear()
        if self._syn is not None:
            self._syn.close()
            self._syn = None
        self._ep.close()
