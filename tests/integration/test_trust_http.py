"""The L7 front end as an attacker (or a broken backend) would try it, on
real loopback sockets: one client's answer never reaches another, what a
client sends after its headers never becomes a header, and requests the
RFCs refuse are refused (issue 38, "High" and "Medium").

Every test runs twice: with a first-try chooser (the plain-request fast
path: in C when built) and without (the fast path's Python method and the
general path); ``make pure`` runs the file again without the C module.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from healthgate.dataplane.counters import ListenerCounters
from healthgate.dataplane.guard import ConnectionGuard
from healthgate.dataplane.http import HttpProxy
from healthgate.dataplane.http_limits import HttpSettings
from healthgate.dataplane.upstream import UpstreamPool
from tests.helpers import run_async
from tests.integration.servers import Server

Address = tuple[str, int]
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(head, body) of one request as the upstream receives it."""
    head = await reader.readuntil(b"\r\n\r\n")
    m = re.search(rb"(?im)^content-length: *(\d+)", head)
    body = await reader.readexactly(int(m[1])) if m else b""
    return head, body


def path_of(head: bytes) -> bytes:
    return head.split(b" ", 2)[1]


def answer(body: bytes, status: int = 200) -> bytes:
    return b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body)


class Front:
    """An L7 listener over ``regions`` (each a list of endpoints), with or
    without the first-try chooser, and clients for it."""

    def __init__(
        self,
        regions: list[list[Address]],
        fast: bool,
        guard: ConnectionGuard | None = None,
        **settings: Any,
    ) -> None:
        self.regions = regions
        self.fast = fast
        self.guard = guard
        self.pool = UpstreamPool(HttpSettings(**settings))
        self.counters = ListenerCounters()
        self.stats = self.counters.events
        self.server: asyncio.Server | None = None
        self.proxies: list[HttpProxy] = []

    def _first(self, _data: bytes) -> tuple[Address, list[Address]] | None:
        region = next((r for r in self.regions if r), None)
        return None if region is None else (region[0], region)

    async def __aenter__(self) -> Front:
        first = self._first if self.fast else None

        def proxy() -> HttpProxy:
            p = HttpProxy(
                lambda: self.regions,
                self.pool,
                self.pool.settings,
                self.counters,
                first=first,
                guard=self.guard,
            )
            self.proxies.append(p)
            return p

        self.server = await asyncio.get_running_loop().create_server(proxy, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        self.pool.close()

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def exchange(self, raw: bytes) -> bytes:
        """Send ``raw`` on a new connection; everything until it closes."""
        reader, writer = await self.open()
        writer.write(raw)
        async with asyncio.timeout(10):
            data = await reader.read()
        writer.close()
        return data


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One whole response (head, body) with a Content-Length."""
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
        m = re.search(rb"(?im)^content-length: *(\d+)", head)
        return head, await reader.readexactly(int(m[1]) if m else 0)


both = pytest.mark.parametrize("fast", [True, False], ids=["first-try", "general"])


def get(path: bytes, extra: bytes = b"") -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n"


# ---------------------------------------------------------------- interim answers


def early_hints_upstream(split: bool, hinted: asyncio.Event, final_status: int = 200) -> Handler:
    """Answers each request with ``103 Early Hints``, then (once the client
    saw the hint, when ``split``) the final answer naming the path."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head, _ = await read_request(reader)
                hint = b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
                final = answer(path_of(head), final_status)
                if split:
                    writer.write(hint)
                    await writer.drain()
                    async with asyncio.timeout(10):
                        await hinted.wait()
                    hinted.clear()
                    writer.write(final)
                else:
                    writer.write(hint + final)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return handler


@both
@pytest.mark.parametrize("split", [True, False], ids=["hint-then-answer", "one-read"])
def test_an_interim_answer_is_forwarded_and_the_final_one_reaches_its_own_client(
    fast: bool, split: bool
) -> None:
    async def go() -> None:
        hinted = asyncio.Event()
        async with (
            Server(early_hints_upstream(split, hinted)) as up,
            Front([[("127.0.0.1", up.port)]], fast) as front,
        ):
            for path in (b"/alice", b"/bob", b"/carol"):  # one pooled upstream connection
                reader, writer = await front.open()
                writer.write(get(path))
                async with asyncio.timeout(10):
                    hint = await reader.readuntil(b"\r\n\r\n")
                assert hint.startswith(b"HTTP/1.1 103 Early Hints\r\n")
                hinted.set()
                head, body = await read_response(reader)
                assert head.startswith(b"HTTP/1.1 200"), head
                assert body == path  # its own answer, not the previous client's
                writer.close()
            assert up.connections == 1  # pooled, and only between messages

    run_async(go())


@both
def test_the_final_status_decides_a_retry_not_the_interim_one(fast: bool) -> None:
    async def go() -> None:
        hinted = asyncio.Event()
        hinted.set()  # (nobody waits on the hint here)

        async def never_clear(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await early_hints_upstream(False, hinted, final_status=503)(reader, writer)

        async with Server(never_clear) as bad, Server(early_hints_upstream(False, hinted)) as ok:
            regions = [[("127.0.0.1", bad.port)], [("127.0.0.1", ok.port)]]
            async with Front(regions, fast) as front:
                data = await front.exchange(get(b"/x", b"Connection: close\r\n"))
        # the first region's 503 (after its hint) is retried in the next region
        assert b"HTTP/1.1 200 X\r\nContent-Length: 2\r\n\r\n/x" in data
        assert b"503" not in data

    run_async(go())


def test_an_http10_client_gets_no_interim_answer() -> None:
    async def go() -> bytes:
        hinted = asyncio.Event()
        hinted.set()
        async with (
            Server(early_hints_upstream(False, hinted)) as up,
            Front([[("127.0.0.1", up.port)]], fast=False) as front,
        ):
            return await front.exchange(b"GET /old HTTP/1.0\r\nHost: x\r\n\r\n")

    data = run_async(go())
    assert b"103" not in data
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"/old")


@both
def test_an_unasked_switching_protocols_fails_the_try(fast: bool) -> None:
    async def switch(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: evil\r\n\r\nraw bytes")
        await writer.drain()
        await asyncio.sleep(5)
        writer.close()

    async def go() -> bytes:
        async with Server(switch) as up, Front([[("127.0.0.1", up.port)]], fast) as front:
            return await front.exchange(get(b"/", b"Connection: close\r\n"))

    data = run_async(go())
    assert data.startswith(b"HTTP/1.1 502"), data
    assert b"raw bytes" not in data


# ---------------------------------------------------------------- unasked bytes


@both
@pytest.mark.parametrize("when", ["same-read", "while-idle"])
def test_a_second_answer_never_reaches_the_next_client(fast: bool, when: str) -> None:
    """An upstream that answers once more than asked - in the same write as
    the answer, or later while its connection sits in the pool."""
    answered = asyncio.Event()  # the client read its answer (while-idle: now answer again)
    dropped = asyncio.Event()  # the front end closed the upstream connection

    async def twice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head, _ = await read_request(reader)
                # (a head whose body never comes: whoever reads it next hangs or
                # takes the next answer as its body)
                stolen = b"HTTP/1.1 200 X\r\nContent-Length: 64\r\n\r\nstolen: " + path_of(head)
                if when == "same-read":
                    writer.write(answer(path_of(head)) + stolen)
                else:
                    writer.write(answer(path_of(head)))
                    await writer.drain()
                    async with asyncio.timeout(10):
                        await answered.wait()
                    answered.clear()
                    writer.write(stolen)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            dropped.set()
        finally:
            writer.close()

    async def go() -> list[bytes]:
        async with Server(twice) as up, Front([[("127.0.0.1", up.port)]], fast) as front:
            bodies = []
            for path in (b"/first", b"/second", b"/third"):
                reader, writer = await front.open()
                writer.write(get(path))
                _, body = await read_response(reader)
                bodies.append(body)
                writer.close()
                answered.set()
                # (bounded: a front end that keeps the connection fails below)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(2):
                        await dropped.wait()
                dropped.clear()
            assert up.connections == 3  # each connection closed after its double answer
            return bodies

    # (bytes in the same read as an answer reach that answer's client: the
    # connection is closed, and nothing is left for the next one)
    assert run_async(go()) == [b"/first", b"/second", b"/third"]


# ---------------------------------------------------------------- request heads


def recording_upstream(seen: list[tuple[bytes, bytes]]) -> Handler:
    """Keeps every request it receives; answers each with its path."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head, body = await read_request(reader)
                seen.append((head, body))
                writer.write(answer(path_of(head)))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return handler


async def through(fast: bool, raw: bytes, **settings: Any) -> tuple[bytes, list[bytes]]:
    """``raw`` sent through a front end: (what the client got, the heads and
    bodies the upstream received)."""
    seen: list[tuple[bytes, bytes]] = []
    async with (
        Server(recording_upstream(seen)) as up,
        Front([[("127.0.0.1", up.port)]], fast, **settings) as front,
    ):
        data = await front.exchange(raw)
    return data, [h + b for h, b in seen]


@both
def test_chunked_trailers_never_become_headers(fast: bool) -> None:
    raw = (
        b"POST /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n"
        b"5\r\nhello\r\n0\r\nVary: *\r\nAuthorization: Bearer stolen\r\nHost: evil\r\n\r\n"
    )
    data, seen = run_async(through(fast, raw))
    assert data.startswith(b"HTTP/1.1 200"), data
    (request,) = seen
    assert request.endswith(b"\r\n\r\nhello")
    assert b"Authorization" not in request and b"evil" not in request and b"Vary" not in request
    assert request.count(b"Host: x\r\n") == 1


@both
@pytest.mark.parametrize("coding", [b"deflate, chunked", b"gzip, chunked", b"identity"])
def test_a_transfer_coding_other_than_chunked_is_not_implemented(fast: bool, coding: bytes) -> None:
    raw = (
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: " + coding + b"\r\n\r\n"
        b"5\r\nhello\r\n0\r\n\r\n"
    )
    data, seen = run_async(through(fast, raw))
    assert data.startswith(b"HTTP/1.1 501"), data
    assert seen == []


@both
def test_a_complete_request_is_answered_before_the_bytes_behind_it_are_refused(fast: bool) -> None:
    raw = get(b"/complete") + b"\x16\x03\x01 not http at all\r\n\r\n"
    data, seen = run_async(through(fast, raw))
    first, _, rest = data.partition(b"/complete")
    assert first.startswith(b"HTTP/1.1 200"), data  # answered, then...
    assert rest.startswith(b"HTTP/1.1 400") and b"Connection: close" in rest  # ... refused, closed
    assert [path_of(r) for r in seen] == [b"/complete"]


@both
@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /nohost HTTP/1.1\r\n\r\n", b"400"),
        (b"GET /two HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", b"400"),
        (b"GET /two HTTP/1.1\r\nHost: x\r\nhost: x\r\n\r\n", b"400"),
        (b"GET http://a@b/ HTTP/1.1\r\nHost: x\r\n\r\n", b"400"),
        (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-A: 1\r\n" * 100 + b"\r\n", b"431"),
    ],
)
def test_heads_the_rfcs_refuse_are_not_forwarded(fast: bool, head: bytes, status: bytes) -> None:
    data, seen = run_async(through(fast, head))
    assert data.startswith(b"HTTP/1.1 " + status), data
    assert seen == []


def test_an_http10_request_without_host_is_forwarded() -> None:
    data, seen = run_async(through(False, b"GET /old HTTP/1.0\r\n\r\n"))
    assert data.startswith(b"HTTP/1.1 200")
    assert len(seen) == 1


@both
def test_an_absolute_form_target_is_forwarded_with_its_own_host(fast: bool) -> None:
    raw = b"GET http://shop.example/cart?x=1 HTTP/1.1\r\nHost: admin.internal\r\n\r\n"
    raw += b"GET HTTP://Other.example HTTP/1.1\r\nHost: y\r\nConnection: close\r\n\r\n"
    data, seen = run_async(through(fast, raw))
    assert data.count(b"HTTP/1.1 200") == 2, data
    assert seen[0].startswith(b"GET /cart?x=1 HTTP/1.1\r\nHost: shop.example\r\n")
    assert b"admin.internal" not in seen[0]
    assert seen[1].startswith(b"GET / HTTP/1.1\r\nHost: Other.example\r\n")


@both
def test_what_a_client_says_of_its_address_or_scheme_is_not_passed_on(fast: bool) -> None:
    spoofed = (
        b"X-Forwarded-Host: admin\r\nX-Forwarded-Proto: https\r\nTrue-Client-IP: 10.0.0.1\r\n"
        b"X-Real-IP: 10.0.0.2\r\nForwarded: for=10.0.0.3\r\nCF-Connecting-IP: 10.0.0.4\r\n"
        b"X_Forwarded_For: 10.0.0.5\r\nX_User: admin\r\nX-Kept: yes\r\n"
    )
    data, seen = run_async(through(fast, get(b"/", spoofed + b"Connection: close\r\n")))
    assert data.startswith(b"HTTP/1.1 200")
    (request,) = seen
    for name in (
        b"X-Forwarded-Host",
        b"X-Forwarded-Proto",
        b"True-Client-IP",
        b"X-Real-IP",
        b"Forwarded:",
        b"CF-Connecting-IP",
        b"X_Forwarded_For",
        b"X_User",
    ):
        assert name not in request, name
    assert b"X-Kept: yes\r\n" in request
    assert b"X-Forwarded-For: 127.0.0.1\r\n" in request


@both
def test_thousands_of_small_pipelined_requests_in_one_write_are_all_answered(fast: bool) -> None:
    n = 3000
    agent = b"User-Agent: pipelining-client/1.0\r\nAccept: */*\r\n"
    raw = b"".join(get(b"/%d" % i, agent) for i in range(n - 1)) + get(
        b"/%d" % (n - 1), b"Connection: close\r\n"
    )
    assert len(raw) > 3 * 64 * 1024  # (more than a head may be: each head is small)
    data, seen = run_async(through(fast, raw))
    assert data.count(b"HTTP/1.1 200") == n
    assert [path_of(r) for r in seen] == [b"/%d" % i for i in range(n)]


def test_queued_heads_are_bounded_while_the_client_reads_nothing() -> None:
    """A client that does not read a large answer and pipelines requests of
    a hundred tiny headers each: the front end parses no further than its
    queue, counts the heads it holds, stops reading, and holds the rest of
    what it read unparsed."""
    big = b"b" * (4 * 1024 * 1024)

    async def large(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await read_request(reader)
                writer.write(answer(big))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def go() -> None:
        async with (
            Server(large) as up,
            Front([[("127.0.0.1", up.port)]], fast=False) as front,
        ):
            _reader, writer = await front.open()
            head = get(b"/", b"".join(b"X-%d: y\r\n" % i for i in range(99)))
            raw = head * 2000  # ~1.6 MiB of heads, never answered as they are not read
            writer.write(raw)
            (proxy,) = front.proxies
            settings = front.pool.settings
            for _ in range(500):  # (bounded: until it stops reading)
                if proxy.paused and proxy.queue:
                    break
                await asyncio.sleep(0.01)
            assert proxy.paused
            assert len(proxy.queue) <= settings.max_pipelined + 8  # (one slice's worth more)
            assert proxy.heads_held <= len(head) * (settings.max_pipelined + 8)
            assert len(proxy._held) < 512 * 1024  # the rest of one read, unparsed
            writer.close()

    run_async(go())


def test_a_client_that_stops_reading_an_answer_is_disconnected() -> None:
    now = [1000.0]
    guard = ConnectionGuard(100, clock=lambda: now[0])
    big = b"b" * (16 * 1024 * 1024)

    async def large(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_request(reader)
            writer.write(answer(big))
            await writer.drain()
            await asyncio.sleep(30)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def go() -> None:
        async with (
            Server(large) as up,
            Front([[("127.0.0.1", up.port)]], False, guard, write_timeout=5) as front,
        ):
            _reader, writer = await front.open()
            writer.write(get(b"/"))
            (proxy,) = front.proxies
            for _ in range(500):  # (bounded: until the answer backs up)
                if proxy._stalled_since:
                    break
                await asyncio.sleep(0.01)
            assert proxy._stalled_since == 1000.0
            proxy.expire(1004.0, 10, 60)
            assert not proxy.closed  # (within its deadline)
            proxy.expire(1006.0, 10, 60)
            assert proxy.closed and front.stats["write_timeouts"] == 1
            writer.close()
        guard.close()

    run_async(go())
