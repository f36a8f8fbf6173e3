"""Every probe type and every outcome, against real servers on loopback."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from typing import Any

import pytest
import trustme

from healthgate.health.states import Outcome, ProbeResult
from healthgate.probes.batch import BatchProber
from healthgate.probes.prober import Prober, ProbeSettings
from healthgate.probes.spec import ProbeSpec
from tests.helpers import run_async
from tests.integration import servers
from tests.integration.servers import FullBacklog, Server, free_port


def spec(kind: str, port: int, timeout: float = 1.0, **kw: Any) -> ProbeSpec:
    return ProbeSpec(type=kind, ip="127.0.0.1", port=port, timeout=timeout, interval=1.0, **kw)


class Batched:
    """The batch prober driven as the scheduler drives it (start, then a poll
    per tick; here a 2 ms tick), one probe at a time, behind the coroutine
    prober's interface so that the same tests run against both."""

    def __init__(self, settings: ProbeSettings | None = None) -> None:
        self.batch = BatchProber(settings)

    async def probe(self, spec: ProbeSpec, key: Any = None) -> ProbeResult:
        key = "k" if key is None else key
        started = self.batch.start(key, spec, asyncio.get_running_loop().time())
        return await batch_result(self.batch, key, spec, started)

    def forget(self, key: Any) -> None:
        self.batch.cancel(key)

    async def close(self) -> None:
        self.batch.close()


async def batch_result(
    batch: BatchProber, key: Any, spec: ProbeSpec, result: ProbeResult | None
) -> ProbeResult:
    """The result of the probe of ``key`` just started (``result``: what
    start returned), polling every 2 ms as a tick would."""
    loop = asyncio.get_running_loop()
    for _ in range(int(spec.timeout / 0.002) + 500):  # bounded: the deadline and then some
        if result is not None:
            return result
        await asyncio.sleep(0.002)
        for k, r in batch.poll(loop.time()):
            assert k == key
            result = r
    raise AssertionError(f"no result from the batch prober after {spec.timeout} s")


PROBERS: dict[str, Callable[[ProbeSettings | None], Prober | Batched]] = {
    "coroutine": Prober,
    "batch": Batched,
}
both = pytest.mark.parametrize("prober_kind", list(PROBERS))


def probe_once(
    handler: servers.Handler | None,
    kind: str = "HTTP",
    settings: ProbeSettings | None = None,
    prober_kind: str = "coroutine",
    **kw: Any,
) -> ProbeResult:
    async def go() -> ProbeResult:
        prober = PROBERS[prober_kind](settings)
        try:
            if handler is None:
                return await prober.probe(spec(kind, free_port(), **kw))
            async with Server(handler) as srv:
                return await prober.probe(spec(kind, srv.port, **kw))
        finally:
            await prober.close()

    result: ProbeResult = run_async(go())
    return result


@pytest.mark.parametrize(
    ("handler", "kind", "kw", "outcome", "status", "detail"),
    [
        (servers.respond(200), "HTTP", {}, Outcome.OK, 200, ""),
        (servers.respond(200), "TCP", {}, Outcome.OK, 0, ""),
        (None, "HTTP", {}, Outcome.REFUSED, 0, ""),
        (None, "TCP", {}, Outcome.REFUSED, 0, ""),
        (servers.respond(503), "HTTP", {}, Outcome.STATUS, 503, "not in expectedStatusCodes"),
        (servers.respond(204), "HTTP", {"status_ranges": ((200, 299),)}, Outcome.OK, 204, ""),
        (
            servers.respond(302),
            "HTTP",
            {"status_ranges": ((200, 299), (301, 302))},
            Outcome.OK,
            302,
            "",
        ),
        (servers.respond(404), "HTTP", {"status_ranges": ((200, 299),)}, Outcome.STATUS, 404, ""),
        # SPEC §9: a degraded success (both probers, fresh; kept alive: below)
        (
            servers.respond(429),
            "HTTP",
            {"degraded_ranges": ((429, 429),)},
            Outcome.DEGRADED,
            429,
            "",
        ),
        (servers.respond(200), "HTTP", {"degraded_ranges": ((429, 429),)}, Outcome.OK, 200, ""),
        (servers.respond(429), "HTTP", {}, Outcome.STATUS, 429, "not in expectedStatusCodes"),
        (
            servers.respond(503),
            "HTTP",
            {"degraded_ranges": ((500, 503),), "contains": b"never there"},
            Outcome.DEGRADED,
            503,
            "",
        ),  # (a degraded answer is not searched for responseContains)
        (servers.reset_mid_response, "HTTP", {}, Outcome.RESET, 0, ""),
        (servers.not_http, "HTTP", {}, Outcome.MALFORMED, 0, "bad status line"),
        (servers.close_at_once, "HTTP", {}, Outcome.RESET, 0, ""),
        (servers.endless_headers, "HTTP", {}, Outcome.MALFORMED, 0, "larger than 8192 bytes"),
        (
            servers.huge_body,
            "HTTP",
            {},
            Outcome.OK,
            200,
            "",
        ),  # the head decides; the body is never read
    ],
)
@both
def test_http_and_tcp_outcomes(
    handler: Any,
    kind: str,
    kw: dict[str, Any],
    outcome: Outcome,
    status: int,
    detail: str,
    prober_kind: str,
) -> None:
    result = probe_once(handler, kind, prober_kind=prober_kind, **kw)
    assert result.outcome is outcome, result
    assert result.status == status
    assert detail in result.detail
    assert 0 <= result.latency < 1.0


@both
def test_accepts_and_never_answers_times_out_at_the_deadline(prober_kind: str) -> None:
    result = probe_once(servers.hang, "HTTP", prober_kind=prober_kind, timeout=0.3)
    assert result.outcome is Outcome.TIMEOUT
    assert 0.295 <= result.latency < 0.6  # timers fire to the millisecond


@both
def test_tcp_check_cannot_see_a_hung_server(prober_kind: str) -> None:
    # documented limitation: the kernel completes the handshake for a hung process
    result = probe_once(servers.hang, "TCP", prober_kind=prober_kind, timeout=0.3)
    assert result.outcome is Outcome.OK


@both
@pytest.mark.parametrize("kind", ["TCP", "HTTP"])
def test_handshake_that_never_completes_times_out(kind: str, prober_kind: str) -> None:
    async def go() -> ProbeResult:
        prober = PROBERS[prober_kind](None)
        with FullBacklog() as backlog:
            return await prober.probe(spec(kind, backlog.port, timeout=0.3))

    result = run_async(go())
    assert result.outcome is Outcome.TIMEOUT
    assert 0.295 <= result.latency < 0.6  # timers fire to the millisecond


@both
def test_endless_headers_do_not_hold_memory_or_time(prober_kind: str) -> None:
    result = probe_once(servers.endless_headers, "HTTP", prober_kind=prober_kind, timeout=2.0)
    assert result.outcome is Outcome.MALFORMED
    assert result.latency < 0.5


@both
def test_request_carries_path_and_host(prober_kind: str) -> None:
    seen: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await servers.read_head(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        writer.close()

    assert (
        probe_once(
            record, "HTTP", prober_kind=prober_kind, path="/healthz?full=1", host="web.internal"
        ).outcome
        is Outcome.OK
    )
    assert seen[0].startswith(b"GET /healthz?full=1 HTTP/1.1\r\nHost: web.internal\r\n")
    seen.clear()
    assert probe_once(record, "HTTP", prober_kind=prober_kind).outcome is Outcome.OK
    assert b"\r\nHost: 127.0.0.1\r\n" in seen[0]


# ------------------------------------------------------------------ HTTPS


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def tls_server_context(
    ca: trustme.CA, names: list[str], sni_seen: list[str | None]
) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert(*names).configure_cert(ctx)

    def on_sni(sock: Any, name: str | None, _ctx: Any) -> None:
        sni_seen.append(name)

    ctx.sni_callback = on_sni
    return ctx


def https_probe(
    ctx: ssl.SSLContext, settings: ProbeSettings | None = None, **kw: Any
) -> ProbeResult:
    async def go() -> ProbeResult:
        prober = Prober(settings)
        try:
            async with Server(servers.respond(200), tls=ctx) as srv:
                return await prober.probe(spec("HTTPS", srv.port, **kw))
        finally:
            await prober.close()

    result: ProbeResult = run_async(go())
    return result


def test_https_self_signed_is_accepted_by_default_and_sni_is_the_host(ca: trustme.CA) -> None:
    sni: list[str | None] = []
    ctx = tls_server_context(ca, ["web.internal"], sni)
    result = https_probe(ctx, host="web.internal")
    assert result.outcome is Outcome.OK and result.status == 200
    assert sni == ["web.internal"]  # checked on the server side


def test_https_without_host_sends_no_sni(ca: trustme.CA) -> None:
    sni: list[str | None] = []
    assert https_probe(tls_server_context(ca, ["web.internal"], sni)).outcome is Outcome.OK
    assert sni == [None]


def test_https_verification_with_a_ca_bundle(ca: trustme.CA, tmp_path: Any) -> None:
    bundle = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(bundle))
    verify = ProbeSettings(verify_tls=True, ca_file=str(bundle))
    ok = https_probe(tls_server_context(ca, ["web.internal"], []), verify, host="web.internal")
    assert ok.outcome is Outcome.OK
    wrong_name = https_probe(
        tls_server_context(ca, ["other.internal"], []), verify, host="web.internal"
    )
    assert wrong_name.outcome is Outcome.TLS
    untrusted = https_probe(
        tls_server_context(trustme.CA(), ["web.internal"], []), verify, host="web.internal"
    )
    assert untrusted.outcome is Outcome.TLS and "CERTIFICATE_VERIFY_FAILED" in untrusted.detail


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
@pytest.mark.parametrize("resume", [True, False])
def test_fresh_https_checks_resume_the_endpoints_tls_session(
    ca: trustme.CA, version: ssl.TLSVersion, resume: bool
) -> None:
    """A fresh-connection HTTPS check offers its endpoint's last session: the
    server sees the first handshake in full and the next ones resumed (its
    own ``session_reused``), TLS 1.2 and 1.3; off, every one in full. A
    server that declines the session (another one: other ticket keys) gets
    a full handshake, and the session from it is resumed next."""
    reused: list[bool] = []

    async def go() -> tuple[list[Outcome], Prober]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            reused.append(writer.get_extra_info("ssl_object").session_reused)
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
            writer.close()

        prober = Prober(ProbeSettings(tls_resume=resume))
        outcomes = []
        try:
            for rounds in (4, 2):
                ctx = tls_server_context(ca, ["web.internal"], [])
                ctx.maximum_version = version
                server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
                port = server.sockets[0].getsockname()[1]
                check = spec("HTTPS", port, host="web.internal")
                try:
                    for _ in range(rounds):
                        outcomes.append((await prober.probe(check, key="k")).outcome)
                finally:
                    server.close()
        finally:
            await prober.close()
        return outcomes, prober

    outcomes, prober = run_async(go())
    assert outcomes == [Outcome.OK] * 6
    assert reused == ([False, True, True, True, False, True] if resume else [False] * 6)
    assert (prober.tls_handshakes, prober.tls_resumed) == (6, 4 if resume else 0)


def test_https_against_plain_http_is_a_tls_failure() -> None:
    async def bad_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)  # a TLS ClientHello is not HTTP: answer 400, as web servers do
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    result = probe_once(bad_request, "HTTPS")
    assert result.outcome is Outcome.TLS, result


# ------------------------------------------------------------------ keep-alive


@both
def test_keepalive_reuses_one_connection_and_survives_server_idle_close(prober_kind: str) -> None:
    async def go() -> tuple[list[ProbeResult], int, list[ProbeResult], int]:
        prober = PROBERS[prober_kind](ProbeSettings(keepalive=True))
        async with Server(servers.respond(200)) as srv:
            s = spec("HTTP", srv.port)
            results = [await prober.probe(s, key=1) for _ in range(5)]
            conns = srv.connections
        # the server went away and came back on another port: a new spec, a new connection
        async with Server(servers.respond(200)) as srv2:
            s2 = spec("HTTP", srv2.port)
            prober.forget(1)
            again = [await prober.probe(s2, key=1) for _ in range(3)]
            conns2 = srv2.connections
        await prober.close()
        return results, conns, again, conns2

    results, conns, again, conns2 = run_async(go())
    assert [r.outcome for r in results] == [Outcome.OK] * 5
    assert conns == 1
    assert [r.outcome for r in again] == [Outcome.OK] * 3 and conns2 == 1


@both
def test_a_kept_alive_connection_carries_degraded_answers(prober_kind: str) -> None:
    """SPEC §9 on a kept-alive connection: each 429 a degraded success, one connection."""

    async def go() -> tuple[list[ProbeResult], int]:
        prober = PROBERS[prober_kind](ProbeSettings(keepalive=True))
        async with Server(servers.respond(429)) as srv:
            s = spec("HTTP", srv.port, degraded_ranges=((429, 429),))
            results = [await prober.probe(s, key=1) for _ in range(4)]
            conns = srv.connections
        await prober.close()
        return results, conns

    results, conns = run_async(go())
    assert [(r.outcome, r.status) for r in results] == [(Outcome.DEGRADED, 429)] * 4
    assert conns == 1


@both
def test_keepalive_retries_a_stale_connection_once(prober_kind: str) -> None:
    closing: list[asyncio.StreamWriter] = []

    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await servers.read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        closing.append(writer)  # idle timeout: the server closes after one answer
        writer.close()

    async def go() -> list[ProbeResult]:
        prober = PROBERS[prober_kind](ProbeSettings(keepalive=True))
        async with Server(answer_once) as srv:
            s = spec("HTTP", srv.port)
            out = []
            for _ in range(3):
                out.append(await prober.probe(s, key="k"))
                await asyncio.sleep(
                    0.05
                )  # let the server's FIN arrive: that is the scenario under test
        await prober.close()
        return out

    assert [r.outcome for r in run_async(go())] == [Outcome.OK] * 3


OK_KEPT = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def test_a_kept_connection_whose_server_went_away_ends_its_probe_once() -> None:
    """The server closed the kept connection and stopped listening before
    the next probe was sent on it: the one retry, on a fresh connection, is
    refused - one result, and nothing more when the probe's deadline passes
    (the retry ended the probe; its deadline entry must not end it again)."""
    conns: list[asyncio.StreamWriter] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await servers.read_head(reader)
        writer.write(OK_KEPT)
        await writer.drain()
        conns.append(writer)

    async def go() -> tuple[ProbeResult, ProbeResult, list[tuple[Any, ProbeResult]]]:
        loop = asyncio.get_running_loop()
        batch = BatchProber(ProbeSettings(keepalive=True))
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        s = spec("HTTP", server.sockets[0].getsockname()[1])
        first = await batch_result(batch, "k", s, batch.start("k", s, loop.time()))
        server.close()
        await server.wait_closed()
        for writer in conns:
            writer.close()
            await writer.wait_closed()
        started = loop.time()  # no poll since: the probe goes out on the closed connection
        second = await batch_result(batch, "k", s, batch.start("k", s, started))
        after = batch.poll(started + s.timeout + 0.1)
        batch.close()
        return first, second, after

    first, second, after = run_async(go())
    assert first.outcome is Outcome.OK
    assert second.outcome is Outcome.REFUSED, second
    assert after == []


def test_a_kept_probe_is_not_timed_out_by_the_deadline_of_the_one_before() -> None:
    """A kept-alive connection's probe state serves the key's next probe; the
    first probe's deadline, when it comes, must leave the second alone."""

    async def answer_then_hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await servers.read_head(reader)
        writer.write(OK_KEPT)
        await writer.drain()
        await servers.read_head(reader)
        await asyncio.Event().wait()  # the second request is never answered

    async def go() -> tuple[ProbeResult, list[Any], list[tuple[Any, Outcome]]]:
        loop = asyncio.get_running_loop()
        batch = BatchProber(ProbeSettings(keepalive=True))
        async with Server(answer_then_hang) as srv:
            s = spec("HTTP", srv.port, timeout=1.0)
            t0 = loop.time()
            first = await batch_result(batch, "k", s, batch.start("k", s, t0))
            # the next probe, as if 0.9 s later (the times are the caller's)
            assert batch.start("k", s, t0 + 0.9) is None
            at_first_deadline = batch.poll(t0 + 1.05)
            at_second = [(k, r.outcome) for k, r in batch.poll(t0 + 1.95)]
            assert srv.connections == 1  # the same connection both times
        batch.close()
        return first, at_first_deadline, at_second

    first, at_first_deadline, at_second = run_async(go())
    assert first.outcome is Outcome.OK
    assert at_first_deadline == []
    assert at_second == [("k", Outcome.TIMEOUT)]


# ------------------------------------------------------------------ gRPC


def grpc_probe(service: str, status: Any) -> ProbeResult:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    async def go() -> ProbeResult:
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await servicer.set("shop.Web", status)
        await server.start()
        prober = Prober()
        try:
            return await prober.probe(
                spec("GRPC", port, timeout=2.0, grpc_service=service), key="g"
            )
        finally:
            await prober.close()
            await server.stop(None)

    _ = health_pb2
    result: ProbeResult = run_async(go())
    return result


def test_grpc_outcomes() -> None:
    from grpc_health.v1 import health_pb2

    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    assert grpc_probe("shop.Web", serving).outcome is Outcome.OK
    r = grpc_probe("shop.Web", not_serving)
    assert (r.outcome, r.detail) == (Outcome.STATUS, "NOT_SERVING")
    r = grpc_probe("shop.Unknown", serving)
    assert r.outcome is Outcome.STATUS and "unknown service" in r.detail


def test_grpc_refused() -> None:
    async def go() -> ProbeResult:
        prober = Prober()
        try:
            return await prober.probe(spec("GRPC", free_port(), timeout=1.0))
        finally:
            await prober.close()

    r = run_async(go())
    assert r.outcome in (Outcome.REFUSED, Outcome.ERROR) and "UNAVAILABLE" in r.detail


@both
@pytest.mark.parametrize("kind", ["TCP", "HTTP"])
def test_ipv6_loopback(kind: str, prober_kind: str) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")

    async def go() -> tuple[ProbeResult, ProbeResult]:
        prober = PROBERS[prober_kind](None)
        try:
            async with Server(servers.respond(200), host="::1") as srv:
                up = await prober.probe(
                    ProbeSpec(type=kind, ip="::1", port=srv.port, timeout=1.0, interval=1.0)
                )
            with socket.socket(socket.AF_INET6) as s:
                s.bind(("::1", 0))
                closed = s.getsockname()[1]
            down = await prober.probe(
                ProbeSpec(type=kind, ip="::1", port=closed, timeout=1.0, interval=1.0)
            )
            return up, down
        finally:
            await prober.close()

    up, down = run_async(go())
    assert up.outcome is Outcome.OK, up
    assert down.outcome is Outcome.REFUSED, down


def test_batch_prober_reuses_sockets_across_probes() -> None:
    """A finished probe's socket is disconnected and pooled, not closed: ten
    probes in a row open one socket."""

    async def go() -> tuple[list[Outcome], int]:
        prober = Batched()
        async with Server(servers.respond(200)) as srv:
            outcomes = [
                (await prober.probe(spec("HTTP", srv.port), key=i)).outcome for i in range(10)
            ]
        pooled = sum(len(p) for p in prober.batch._pool.values())
        await prober.close()
        return outcomes, pooled

    outcomes, pooled = run_async(go())
    assert outcomes == [Outcome.OK] * 10
    assert pooled == 1


def queued(listener: socket.socket) -> int:
    """Connections waiting in ``listener``'s accept queue (taken and closed);
    on loopback every completed handshake is queued by the time its check
    has ended."""
    listener.setblocking(False)
    seen = 0
    for _ in range(64):
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            break
        conn.close()
        seen += 1
    return seen


@pytest.mark.parametrize(("half_open", "accepted"), [(False, 5), (True, 0)])
def test_a_tcp_check_completes_the_handshake_unless_half_open(
    half_open: bool, accepted: int
) -> None:
    """SPEC §2.1: SYN, SYN+ACK, the checker's ACK - the connection reaches the
    server's accept queue. Half-open (an option) resets after the SYN+ACK:
    the server's kernel answers, its accept queue never sees a connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]

    async def go() -> list[ProbeResult]:
        prober = Batched(ProbeSettings(tcp_half_open=half_open))
        try:
            return [await prober.probe(spec("TCP", port), key=i) for i in range(5)]
        finally:
            await prober.close()

    try:
        results = run_async(go(), timeout=30)
        assert [r.outcome for r in results] == [Outcome.OK] * 5
        assert queued(listener) == accepted
    finally:
        listener.close()


def test_a_pooled_socket_that_held_its_ack_back_completes_the_next_tcp_handshake() -> None:
    """Sockets are pooled across check types: one that just made an HTTP
    check (its ACK held back) still completes a TCP check's handshake."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    tcp_port = listener.getsockname()[1]

    async def go() -> list[Outcome]:
        prober = Batched()
        outcomes = []
        try:
            async with Server(servers.respond(200)) as srv:
                for i in range(5):
                    outcomes.append((await prober.probe(spec("HTTP", srv.port), key=i)).outcome)
                    outcomes.append((await prober.probe(spec("TCP", tcp_port), key=i)).outcome)
            assert sum(len(p) for p in prober.batch._pool.values()) == 1  # one socket, reused
        finally:
            await prober.close()
        return outcomes

    try:
        assert run_async(go(), timeout=30) == [Outcome.OK] * 10
        assert queued(listener) == 5  # every TCP check reached the accept queue
    finally:
        listener.close()


@both
@pytest.mark.parametrize("kind", ["TCP", "HTTP"])
def test_probes_leave_from_the_source_address(prober_kind: str, kind: str) -> None:
    """--probe-source: every probe, a pooled socket's second one too, comes
    from the given address."""
    peers: list[str] = []

    async def go() -> list[Outcome]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peers.append(writer.get_extra_info("peername")[0])
            if kind == "HTTP":
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        prober = PROBERS[prober_kind](ProbeSettings(source="127.0.0.9"))
        try:
            return [(await prober.probe(spec(kind, port))).outcome for _ in range(3)]
        finally:
            await prober.close()
            server.close()

    outcomes = run_async(go())
    assert outcomes == [Outcome.OK] * 3
    assert peers and set(peers) == {"127.0.0.9"}


def test_a_prober_out_of_descriptors_makes_no_result_counts_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """EMFILE is the prober's own trouble, never the endpoint's: the probe
    is SUSPECT (no evidence either way), counted as skipped in the
    scheduler's stats (healthgate_probes_skipped_total) and logged - so a
    prober starved of descriptors neither fails a region over nor hides."""
    import errno
    import logging

    from healthgate.health.states import NO_DESCRIPTOR
    from healthgate.probes.scheduler import ProbeScheduler

    class Starved(BatchProber):
        def _socket(self, family: int) -> socket.socket:
            raise OSError(errno.EMFILE, "Too many open files")

    async def go() -> tuple[list[ProbeResult], int]:
        got: list[ProbeResult] = []
        done = asyncio.Event()

        def sink(_now: float, results: list[tuple[object, ProbeResult]]) -> None:
            got.extend(r for _, r in results)
            if len(got) >= 3:
                done.set()

        sched = ProbeScheduler(Prober(), sink, batch=Starved())
        sched.start()
        for key in range(3):
            sched.upsert(key, spec("TCP", free_port()))
        async with asyncio.timeout(10):
            await done.wait()
        await sched.close()
        return got, sched.stats.skipped

    with caplog.at_level(logging.WARNING, logger="healthgate.probes"):
        results, skipped = run_async(go(), timeout=20)
    assert {r.outcome for r in results} == {Outcome.SUSPECT}
    assert {r.detail for r in results} == {NO_DESCRIPTOR}
    assert skipped >= 3
    lines = [r.getMessage() for r in caplog.records if "could not start" in r.getMessage()]
    assert len(lines) == 1  # (once per 10 s, however many)
    assert "open-file limit" in lines[0]
