"""One probe, start to finish, under one hard deadline.

:meth:`Prober.probe` runs connect, TLS handshake, request and response under a
single deadline of ``timeoutSec`` and always returns a
:class:`ProbeResult`; no socket error escapes. The mapping is:

=============================  =================
what happened                  outcome
=============================  =================
connected (TCP) / expected     OK
status (HTTP) / SERVING (gRPC)
deadline passed                TIMEOUT
RST on connect                 REFUSED
RST after connect              RESET
other status / not SERVING     STATUS
TLS handshake failed           TLS
not HTTP, head too large,      MALFORMED
closed mid-response
anything else (unreachable..)  ERROR
=============================  =================

HTTP(S) probes open a fresh connection per probe by default: each probe then
meets what a new client meets (accept queue, handshake). With
``keepalive=True`` the connection is kept between probes of the same key and
reused, as Envoy does; a reused connection that turns out to be closed before
any byte of the answer is retried once on a fresh connection within the same
deadline, so a server's idle timeout is never mistaken for a failure.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from dataclasses import dataclass
from typing import Any, Final

from healthgate.health.states import Outcome, ProbeResult, local_failure
from healthgate.probes.http import HttpHead, HttpProbeProtocol, TlsHttpProbeProtocol, build_request
from healthgate.probes.spec import ProbeSpec


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    keepalive: bool = False  # HTTP(S): reuse one connection per endpoint
    # TCP: reset right after the SYN+ACK instead of completing the handshake
    # (HAProxy's check; the server's accept queue never sees it). Not the
    # default: SPEC §2.1 completes the handshake.
    tcp_half_open: bool = False
    # half-open TCP checks as raw SYNs on one socket (probes/syn.py) where the
    # process may open one; off, or without the privilege: connect() and reset
    raw_syn: bool = True
    verify_tls: bool = False  # HTTPS: verify certificates (with ca_file, or the system store)
    ca_file: str | None = None
    max_head_bytes: int = 8192  # status line + headers
    max_body_bytes: int = 65536  # a kept-alive response's body must fit, or the connection closes
    # the local address probes leave from (firewalls that admit probers by
    # address, multi-homed hosts); None: the kernel's choice. TCP, HTTP and
    # HTTPS checks; gRPC checks leave from the kernel's choice.
    source: str | None = None
    # HTTPS: offer each endpoint's last TLS session on a fresh connection
    tls_resume: bool = True
    # SPEC §11: hours of each probed endpoint's outcome history kept, for
    # replay (health/history.py; 0: none) - by whichever process probes it
    history_hours: float = 24.0


# per-probe outcomes as globals (see the note on Outcome)
_OK: Final = Outcome.OK
_STATUS: Final = Outcome.STATUS


def verdict(spec: ProbeSpec, head: HttpHead, latency: float) -> ProbeResult:
    """The result of an HTTP(S) probe from what was read of the response."""
    error = head.error
    if not error:  # (the usual case first: this runs per probe)
        if spec.degraded_ranges and spec.degraded(head.status):
            # (a degraded answer - a 429 page - is not searched for responseContains)
            return ProbeResult(Outcome.DEGRADED, latency, head.status)
        if spec.expects(head.status):
            if spec.contains and not head.found:
                return ProbeResult(Outcome.CONTENT, latency, head.status, _missing(spec.contains))
            return ProbeResult(_OK, latency, head.status)
        return ProbeResult(_STATUS, latency, head.status, "not in expectedStatusCodes")
    if error == "reset":
        return ProbeResult(Outcome.RESET, latency)
    if error == "closed":
        return ProbeResult(Outcome.RESET, latency, 0, "closed without an answer")
    return ProbeResult(Outcome.MALFORMED, latency, 0, error)


def _missing(needle: bytes) -> str:
    text = needle.decode(errors="replace")
    shown = repr(text if len(text) <= 60 else text[:57] + "...")
    return f"{shown} not in the first 5,120 bytes of the body (responseContains)"


def tls_context(
    verify: bool, check_hostname: bool, ca: str | None, ca_file: str | None, client_cert: str
) -> ssl.SSLContext:
    """A client context: verifying (against ``ca``, PEM text, else
    ``ca_file``, else the system store) or not, with a client certificate
    and its key (PEM text: loaded from a memory file, never written to disk).
    A certificate that does not load raises ``ssl.SSLError``: the probe's
    result then says why (TLS)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if verify:
        ctx.check_hostname = check_hostname
        ctx.verify_mode = ssl.CERT_REQUIRED
        if ca:
            ctx.load_verify_locations(cadata=ca)
        elif ca_file:
            ctx.load_verify_locations(ca_file)
        else:
            ctx.load_default_certs()
    else:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if client_cert:
        fd = os.memfd_create("healthgate-client-cert", os.MFD_CLOEXEC)
        try:
            os.write(fd, client_cert.encode())
            # (never OpenSSL's own prompt for an encrypted key: a serve with
            # a terminal would wait on it; an empty password fails it as TLS)
            ctx.load_cert_chain(f"/proc/self/fd/{fd}", password=lambda: b"")
        finally:
            os.close(fd)
    return ctx


class _ExpectProtocol(asyncio.Protocol):
    """A TCP check's answer: its first ``want`` bytes (None: closed first)."""

    def __init__(self, fut: asyncio.Future[bytes | None], want: int) -> None:
        self.fut = fut
        self.want = want
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        if self.fut.done():
            return  # (decided: the rest is not read)
        self.buf += data
        if len(self.buf) >= self.want:
            self.fut.set_result(self.buf[: self.want])

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.fut.done():
            if isinstance(exc, ConnectionResetError):
                self.fut.set_exception(exc)
            else:
                self.fut.set_result(self.buf or None)


def expect_verdict(spec: ProbeSpec, got: bytes | None, latency: float) -> ProbeResult:
    """A TCP check's result from the first bytes of its answer (``got``:
    what came before the connection closed, or None for nothing)."""
    if got is None:
        return ProbeResult(Outcome.RESET, latency, 0, "closed without an answer")
    if got[: len(spec.expect)] == spec.expect:
        return ProbeResult(_OK, latency)
    return ProbeResult(
        Outcome.CONTENT, latency, 0, f"expected {_shown(spec.expect)}, got {_shown(got)}"
    )


def _shown(data: bytes) -> str:
    return repr(data[:40]) + ("..." if len(data) > 40 else "")


class _TcpConnectProtocol(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


def _tcp_factory() -> asyncio.Protocol:
    return _TcpConnectProtocol()


class _Deadline:
    __slots__ = ("expired", "task")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.expired = False

    def expire(self) -> None:
        self.expired = True
        self.task.cancel()


class Prober:
    def __init__(self, settings: ProbeSettings | None = None) -> None:
        self.settings = settings or ProbeSettings()
        self._idle: dict[Any, tuple[asyncio.Transport, HttpProbeProtocol]] = {}
        self._tls_plain = self._tls_context(verify=False, check_hostname=False)
        self._tls_verify_host = self._tls_context(verify=True, check_hostname=True)
        self._tls_verify = self._tls_context(verify=True, check_hostname=False)
        self._grpc: Any = None  # created on first gRPC probe (grpcio is heavy to import)
        # one per endpoint and request (path, host, keep-alive, method, headers, body)
        self._requests: dict[tuple[str, str, bool, str, tuple[tuple[str, str], ...], bytes], bytes]
        self._requests = {}
        # per-check TLS contexts (verify, a CA, a client certificate): by what they hold
        self._tls_custom: dict[tuple[bool, bool, str, str], ssl.SSLContext] = {}
        self._sessions: dict[Any, ssl.SSLSession] = {}  # HTTPS: each key's last TLS session
        self.tls_handshakes = 0
        self.tls_resumed = 0  # of which abbreviated (a session resumed)

    def _tls_context(self, verify: bool, check_hostname: bool) -> ssl.SSLContext:
        return tls_context(verify, check_hostname, None, self.settings.ca_file, "")

    async def probe(self, spec: ProbeSpec, key: Any = None) -> ProbeResult:
        loop = asyncio.get_running_loop()
        start = loop.time()
        # One hard deadline for the whole probe. A bare timer that cancels this
        # task costs a fraction of asyncio.timeout() (which reschedules its
        # handle), and this runs for every probe.
        task = asyncio.current_task()
        assert task is not None
        deadline = _Deadline(task)
        handle = loop.call_at(start + spec.timeout, deadline.expire)
        try:
            return await self._probe(loop, spec, key, start)
        except asyncio.CancelledError:
            if not deadline.expired:
                raise
            task.uncancel()
            self.forget(key)
            return ProbeResult(Outcome.TIMEOUT, loop.time() - start)
        finally:
            handle.cancel()

    def _local(self, ip: str) -> tuple[str, int] | None:
        """Where a probe of ``ip`` leaves from (None: the kernel's choice, and
        always for an address family the source is not of)."""
        source = self.settings.source
        if source is None or (":" in source) != (":" in ip):
            return None
        return (source, 0)

    async def _probe(
        self, loop: asyncio.AbstractEventLoop, spec: ProbeSpec, key: Any, start: float
    ) -> ProbeResult:
        try:
            if spec.type == "TCP":
                if not spec.plain_tcp:
                    return await self._tcp_exchange(loop, spec, start)
                transport, _ = await loop.create_connection(
                    _tcp_factory, spec.ip, spec.port, local_addr=self._local(spec.ip)
                )
                transport.close()
                return ProbeResult(Outcome.OK, loop.time() - start)
            if spec.type in ("HTTP", "HTTPS"):
                return await self._http(loop, spec, key, start)
            if spec.type == "GRPC":
                return await self._grpc_probe(spec, key, start)
            return ProbeResult(Outcome.ERROR, 0.0, 0, f"unknown check type {spec.type}")
        except TimeoutError:  # e.g. the TLS handshake's own timeout
            return ProbeResult(Outcome.TIMEOUT, loop.time() - start)
        except ConnectionRefusedError:
            return ProbeResult(Outcome.REFUSED, loop.time() - start)
        except ConnectionResetError:
            return ProbeResult(Outcome.RESET, loop.time() - start)
        except ssl.SSLError as exc:
            return ProbeResult(Outcome.TLS, loop.time() - start, 0, exc.reason or str(exc))
        except OSError as exc:
            latency = loop.time() - start
            return local_failure(exc, latency) or ProbeResult(
                Outcome.ERROR, latency, 0, exc.strerror or str(exc)
            )

    async def _tcp_exchange(
        self, loop: asyncio.AbstractEventLoop, spec: ProbeSpec, start: float
    ) -> ProbeResult:
        """A TCP check that writes (the PROXY preamble, ``send``) and, with
        ``expect``, reads the answer's first bytes."""
        fut: asyncio.Future[bytes | None] = loop.create_future()
        transport, _ = await loop.create_connection(
            lambda: _ExpectProtocol(fut, len(spec.expect)),
            spec.ip,
            spec.port,
            local_addr=self._local(spec.ip),
        )
        try:
            transport.write(spec.preamble + spec.send)
            if not spec.expect:
                return ProbeResult(Outcome.OK, loop.time() - start)
            got = await fut
        finally:
            transport.close()
        return expect_verdict(spec, got, loop.time() - start)

    async def _http(
        self, loop: asyncio.AbstractEventLoop, spec: ProbeSpec, key: Any, start: float
    ) -> ProbeResult:
        settings = self.settings
        keepalive = settings.keepalive and key is not None
        request_key = (
            spec.path, spec.host or spec.ip, keepalive, spec.method, spec.headers, spec.body
        )  # fmt: skip
        request = self._requests.get(request_key)
        if request is None:
            if len(self._requests) > 200_000:
                self._requests.clear()
            request = self._requests[request_key] = build_request(*request_key)
        idle = self._idle.pop(key, None) if keepalive else None
        if idle is not None:
            transport, proto = idle
            if not proto.closed and not transport.is_closing():
                fut: asyncio.Future[HttpHead] = loop.create_future()
                proto.contains = spec.contains
                proto.bodiless = spec.method == "HEAD"
                proto.restart(fut, request)
                try:
                    head = await fut
                except BaseException:
                    transport.close()
                    raise
                if head.error not in ("closed", "reset") or proto.got_bytes:
                    return self._finish(spec, key, head, transport, proto, loop.time() - start)
                transport.close()  # stale kept-alive connection: retry once, fresh
            else:
                transport.close()
        fut = loop.create_future()
        max_head, max_body = settings.max_head_bytes, settings.max_body_bytes
        if spec.type == "HTTPS":
            tls = self._tls_for(spec)
            session = self._sessions.get(key) if key is not None else None
            hostname = spec.host
            transport, proto = await loop.create_connection(
                lambda: TlsHttpProbeProtocol(
                    fut,
                    max_head,
                    max_body,
                    tls,
                    hostname,
                    session,
                    request,
                    spec.contains,
                    spec.preamble,
                ),
                spec.ip,
                spec.port,
                local_addr=self._local(spec.ip),
            )
        else:
            transport, proto = await loop.create_connection(
                lambda: HttpProbeProtocol(fut, max_head, max_body, spec.contains),
                spec.ip,
                spec.port,
                local_addr=self._local(spec.ip),
            )
            transport.write(spec.preamble + request if spec.preamble else request)
        try:
            proto.bodiless = spec.method == "HEAD"
            proto.transport = transport
            head = await fut
        except BaseException:
            transport.close()
            self._sessions.pop(key, None)  # (a failed handshake: a full one next time)
            raise
        if isinstance(proto, TlsHttpProbeProtocol):
            self._tls_done(key, proto)
        return self._finish(
            spec, key if keepalive else None, head, transport, proto, loop.time() - start
        )

    def _tls_for(self, spec: ProbeSpec) -> ssl.SSLContext:
        """The TLS context of an HTTPS probe: the prober's own three, or one
        made for a check's verify, CA and client certificate (SPEC §10),
        kept while a check holds the same."""
        verify = spec.verify or self.settings.verify_tls
        if not spec.ca and not spec.client_cert:
            if not verify:
                return self._tls_plain
            return self._tls_verify_host if spec.host else self._tls_verify
        key = (verify, bool(spec.host), spec.ca, spec.client_cert)
        ctx = self._tls_custom.get(key)
        if ctx is None:
            if len(self._tls_custom) > 1000:
                self._tls_custom.clear()
            ctx = self._tls_custom[key] = tls_context(
                verify, bool(spec.host), spec.ca or None, self.settings.ca_file, spec.client_cert
            )
        return ctx

    def _tls_done(self, key: Any, proto: TlsHttpProbeProtocol) -> None:
        """Count the handshake, and keep the endpoint's session for the next
        fresh connection (TLS session resumption, as HAProxy's checks do).

        A session is taken from a full handshake only, and offered until the
        server declines it (expired, its ticket keys rotated): taking one
        costs more than it saves under TLS 1.3 (the interpreter copies it
        through its encoding, certificate and all: measured, reading it
        after every probe made resumed checks dearer than full ones)."""
        self.tls_handshakes += 1
        if proto.resumed:
            self.tls_resumed += 1
        elif key is not None and self.settings.tls_resume:
            session = proto.session
            if session is not None:
                self._sessions[key] = session
            else:
                self._sessions.pop(key, None)

    def _finish(
        self,
        spec: ProbeSpec,
        key: Any,
        head: HttpHead,
        transport: asyncio.Transport,
        proto: HttpProbeProtocol,
        latency: float,
    ) -> ProbeResult:
        if key is not None and head.reusable and not proto.closed:
            self._idle[key] = (transport, proto)
        else:
            transport.close()
        return verdict(spec, head, latency)

    async def _grpc_probe(self, spec: ProbeSpec, key: Any, start: float) -> ProbeResult:
        if self._grpc is None:
            from healthgate.probes.grpc import GrpcHealthProber

            self._grpc = GrpcHealthProber(self.settings.ca_file)
        result: ProbeResult = await self._grpc.probe(spec, key, start)
        return result

    def forget(self, key: Any) -> None:
        """Drop any state kept for ``key`` (a kept-alive connection, a gRPC channel)."""
        if key is None:
            return
        idle = self._idle.pop(key, None)
        if idle is not None:
            idle[0].close()
        self._sessions.pop(key, None)
        if self._grpc is not None:
            self._grpc.forget(key)

    async def close(self) -> None:
        for transport, _ in self._idle.values():
            transport.close()
        self._idle.clear()
        if self._grpc is not None:
            await self._grpc.close()
