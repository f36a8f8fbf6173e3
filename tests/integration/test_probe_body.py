"""HTTP(S) checks that read the body (``responseContains``) and checks that
are inverted (``invert``), against real servers on loopback, on both probe
paths (the batch prober and the coroutine prober), and scan_body's cases."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import pytest
import trustme

from healthgate.health.states import Outcome, ProbeResult, inverted
from healthgate.probes.http import scan_body
from healthgate.probes.prober import Prober, ProbeSettings
from tests.helpers import run_async
from tests.integration import servers
from tests.integration.servers import Server
from tests.integration.test_probes import PROBERS, both, probe_once, spec


def answer(head: bytes, *parts: bytes, pause: float = 0.0, close: bool = True) -> servers.Handler:
    """A response written in parts (``pause`` between them)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await servers.read_head(reader)
        writer.write(head)
        for part in parts:
            await writer.drain()
            if pause:
                await asyncio.sleep(pause)
            writer.write(part)
        await writer.drain()
        if close:
            writer.close()
        else:
            await asyncio.sleep(5)

    return handle


def length(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)


CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


@both
@pytest.mark.parametrize(
    ("handler", "found"),
    [
        (answer(length(b"status: ready"), b"status: ready"), True),
        (answer(length(b"status: draining"), b"status: draining"), False),
        # the body in pieces, the word in the second
        (answer(length(b"x" * 3000 + b"ready"), b"x" * 3000, b"ready", pause=0.05), True),
        # chunked, the word split across two chunks
        (answer(CHUNKED, b"4\r\nrea\r\n", b"3\r\ndy!\r\n0\r\n\r\n", pause=0.05), False),
        (answer(CHUNKED, b"3\r\nrea\r\n", b"3\r\ndy!\r\n0\r\n\r\n", pause=0.05), True),
        # no length, ended by the close
        (answer(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", b"al", b"l ready"), True),
        # beyond the first 5,120 bytes: not searched
        (answer(length(b"x" * 5200 + b"ready"), b"x" * 5200 + b"ready"), False),
        # a huge body that never ends: decided after 5,120 bytes, not at the deadline
        (servers.huge_body, False),
    ],
)
def test_response_contains(handler: Any, found: bool, prober_kind: str) -> None:
    needle = b"ready" if handler is not servers.huge_body else b"never there"
    result = probe_once(handler, "HTTP", prober_kind=prober_kind, timeout=2.0, contains=needle)
    if found:
        assert result.outcome is Outcome.OK, result
    else:
        assert result.outcome is Outcome.CONTENT, result
        assert result.status == 200 and "not in the first 5,120 bytes" in result.detail
        assert repr(needle.decode()) in result.describe()
    assert result.latency < 1.0  # (decided by the body, never by the deadline)


@both
def test_a_wrong_status_is_still_a_status_failure(prober_kind: str) -> None:
    result = probe_once(servers.respond(503, b"ready"), "HTTP", prober_kind=prober_kind,
                        contains=b"ready")  # fmt: skip
    assert result.outcome is Outcome.STATUS


@both
def test_kept_alive_checks_with_a_body_reuse_their_connection(prober_kind: str) -> None:
    accepted: list[int] = []

    async def keep(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        while True:
            await servers.read_head(reader)
            writer.write(length(b"ready") + b"ready")
            await writer.drain()

    async def go() -> list[ProbeResult]:
        prober = PROBERS[prober_kind](ProbeSettings(keepalive=True))
        try:
            async with Server(keep) as srv:
                s = spec("HTTP", srv.port, contains=b"ready")
                return [await prober.probe(s, "k") for _ in range(5)]
        finally:
            await prober.close()

    results = run_async(go())
    assert [r.outcome for r in results] == [Outcome.OK] * 5
    assert len(accepted) == 1


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.mark.parametrize(
    ("body", "outcome"), [(b"all ready", Outcome.OK), (b"no", Outcome.CONTENT)]
)
def test_https_response_contains(ca: trustme.CA, body: bytes, outcome: Outcome) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1").configure_cert(ctx)

    async def go() -> ProbeResult:
        prober = Prober()
        try:
            async with Server(servers.respond(200, body), tls=ctx) as srv:
                return await prober.probe(spec("HTTPS", srv.port, contains=b"ready"))
        finally:
            await prober.close()

    result = run_async(go())
    assert result.outcome is outcome, result


@pytest.mark.parametrize(
    ("raw", "status", "eof", "expected"),
    [
        (length(b"abc ready") + b"abc ready", 200, False, True),
        (length(b"abc ready") + b"abc re", 200, False, None),  # (read on)
        (length(b"abc") + b"abc", 200, False, False),
        (b"HTTP/1.1 204 No Content\r\n\r\n", 204, False, False),
        (b"HTTP/1.1 200 OK\r\n\r\nready", 200, False, True),
        (b"HTTP/1.1 200 OK\r\n\r\nrea", 200, False, None),
        (b"HTTP/1.1 200 OK\r\n\r\nrea", 200, True, False),
        (CHUNKED + b"5\r\nready\r\n0\r\n\r\n", 200, False, True),
        (CHUNKED + b"5;ext=1\r\nready\r\n0\r\n\r\n", 200, False, True),
        (CHUNKED + b"2\r\nre\r\n", 200, False, None),
        (CHUNKED + b"2\r\nre\r\n0\r\n\r\n", 200, False, False),
        (CHUNKED + b"zz\r\nready\r\n", 200, False, False),  # (a malformed size: the end)
        (CHUNKED + b"1\r\nx\r\n" * 1000, 200, False, None),
    ],
)
def test_scan_body(raw: bytes, status: int, eof: bool, expected: bool | None) -> None:
    end = raw.find(b"\r\n\r\n")
    assert scan_body(raw, end, status, b"ready", eof) is expected


def test_what_a_body_may_cost_is_bounded() -> None:
    # one data byte per 6 on the wire: decided (found or not) within 40 KiB
    raw = CHUNKED + b"1\r\nx\r\n" * 8000
    assert scan_body(raw, raw.find(b"\r\n\r\n"), 200, b"ready", False) is False


@pytest.mark.parametrize(
    ("result", "outcome", "describes"),
    [
        (ProbeResult(Outcome.OK, 0.002, 200), Outcome.INVERTED, "HTTP 200"),
        (ProbeResult(Outcome.REFUSED, 0.001), Outcome.OK, "inverted: connection refused"),
        (ProbeResult(Outcome.TIMEOUT, 1.0), Outcome.OK, "inverted: timeout"),
        (ProbeResult(Outcome.SUSPECT, 1.0), Outcome.SUSPECT, "no result"),  # no result stays so
    ],
)
def test_inverted(result: ProbeResult, outcome: Outcome, describes: str) -> None:
    flipped = inverted(result)
    assert flipped.outcome is outcome
    assert describes in flipped.describe()
