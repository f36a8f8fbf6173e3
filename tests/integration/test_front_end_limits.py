"""Front ends under hostile clients (real sockets): heads bounded as they
arrive, heads that never complete timed out, idle connections closed, and a
cap on connections across listeners."""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import Awaitable, Callable

from healthgate.dataplane.counters import ListenerCounters
from healthgate.dataplane.guard import ConnectionGuard
from healthgate.dataplane.http import HttpProxy
from healthgate.dataplane.http_limits import HttpSettings
from healthgate.dataplane.tcp import TcpProxy
from healthgate.dataplane.upstream import UpstreamPool
from tests.helpers import run_async


async def front_end(
    guard: ConnectionGuard, stats: dict[str, int], max_head: int = 8192
) -> asyncio.Server:
    settings = HttpSettings(max_head_bytes=max_head)
    pool = UpstreamPool(settings)
    return await asyncio.get_running_loop().create_server(
        lambda: HttpProxy(list, pool, settings, ListenerCounters(stats), guard=guard),
        "127.0.0.1",
        0,
    )


def scenario(
    body: Callable[[int, dict[str, int], ConnectionGuard], Awaitable[None]], **kw: float
) -> dict[str, int]:
    stats: dict[str, int] = {}

    async def go() -> None:
        guard = ConnectionGuard(
            int(kw.get("cap", 100)),
            kw.get("header", 10.0),
            kw.get("idle", 60.0),
            max_per_source=int(kw.get("per_source", 0)),
        )
        server = await front_end(guard, stats)
        try:
            await body(server.sockets[0].getsockname()[1], stats, guard)
        finally:
            server.close()
            guard.close()

    run_async(go(), timeout=30)
    return stats


async def read_all(reader: asyncio.StreamReader, timeout: float = 5) -> bytes:
    """All the peer sent until it closed; b"reset" if it reset the connection
    (a server that closes with unread input resets it, and the client may then
    lose the answer that came before: what is asserted is that it ended)."""
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    except ConnectionResetError:
        return b"reset"


def test_a_header_streamed_without_a_line_end_is_refused_as_it_grows() -> None:
    async def body(port: int, stats: dict[str, int], guard: ConnectionGuard) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Long: ")
        sent = 0
        for _ in range(200):  # at most 200 x 4 KB; the proxy stops it long before
            try:
                writer.write(b"a" * 4096)
                await writer.drain()
            except ConnectionError:
                break
            sent += 4096
            if reader.at_eof() or writer.transport.is_closing():
                break
            await asyncio.sleep(0)
        answer = await read_all(reader)
        assert answer.startswith(b"HTTP/1.1 431") or answer == b"reset", answer[:100]
        assert sent < 8192 + 256 * 1024, sent  # the limit plus at most a read's worth

    scenario(body)


def test_a_url_streamed_without_end_is_refused() -> None:
    async def body(port: int, stats: dict[str, int], guard: ConnectionGuard) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /")
        for _ in range(100):
            try:
                writer.write(b"b" * 4096)
                await writer.drain()
            except ConnectionError:
                break
            await asyncio.sleep(0)
        answer = await read_all(reader)
        assert answer[:12] in (b"HTTP/1.1 431", b"HTTP/1.1 400") or answer == b"reset", answer[:99]

    scenario(body)


def test_a_head_that_never_completes_gets_408_and_an_idle_connection_is_closed() -> None:
    async def body(port: int, stats: dict[str, int], guard: ConnectionGuard) -> None:
        slow_r, slow_w = await asyncio.open_connection("127.0.0.1", port)
        slow_w.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        idle_r, _idle_w = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()
        assert (await read_all(slow_r)).startswith(b"HTTP/1.1 408")
        assert await read_all(idle_r) == b""  # closed, silently
        assert time.monotonic() - started < 5  # timeouts 0.5 s, swept every second
        assert stats["header_timeouts"] == 1 and stats["idle_closed"] == 1

    scenario(body, header=0.5, idle=0.5)


def test_connections_over_the_cap_are_closed_at_once_and_counted() -> None:
    async def body(port: int, stats: dict[str, int], guard: ConnectionGuard) -> None:
        kept = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert guard.open == 3
        reader, _ = await asyncio.open_connection("127.0.0.1", port)
        assert await read_all(reader) in (b"", b"reset")
        assert stats["refused_cap"] == 1 and guard.refused == 1
        for _, w in kept:
            w.close()
        for _ in range(100):  # bounded: until the closes are seen
            if guard.open == 0:
                break
            await asyncio.sleep(0.01)
        assert guard.open == 0
        _, again = await asyncio.open_connection("127.0.0.1", port)  # room again
        await asyncio.sleep(0.05)
        assert guard.open == 1
        again.close()

    scenario(body, cap=3)


def test_the_tcp_front_end_counts_against_the_same_cap() -> None:
    async def go() -> tuple[int, int]:
        guard = ConnectionGuard(1)
        stats: dict[str, int] = {}

        async def hold(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.read()  # keeps the first connection open until the client goes

        upstream = await asyncio.start_server(hold, "127.0.0.1", 0)
        target = [("127.0.0.1", upstream.sockets[0].getsockname()[1])]
        server = await asyncio.get_running_loop().create_server(
            lambda: TcpProxy(lambda _ip: target, 1.0, ListenerCounters(stats), None, None, guard),
            "127.0.0.1",
            0,
        )
        port = server.sockets[0].getsockname()[1]
        await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.05)
        await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.05)
        server.close()
        upstream.close()
        return guard.refused, stats.get("refused_cap", 0)

    assert run_async(go(), timeout=10) == (1, 1)


def test_the_default_cap_leaves_descriptors_for_the_rest() -> None:
    from healthgate.dataplane.manager import DataPlaneSettings

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = DataPlaneSettings().connection_cap()
    assert cap == max(256, (soft - 4096) // 2)
    assert DataPlaneSettings(max_connections=50).connection_cap() == 50


def test_a_connection_that_keeps_sending_requests_is_not_idle() -> None:
    async def body(port: int, stats: dict[str, int], guard: ConnectionGuard) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(8):  # 2.4 s of requests every 0.3 s, with an idle timeout of 0.5 s
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            await asyncio.sleep(0.3)
        assert "idle_closed" not in stats
        writer.close()

    scenario(body, idle=0.5)


def test_one_source_cannot_take_every_slot_of_the_cap() -> None:
    """The issue's experiment, scaled down: one address holds as many idle
    connections as it can; another address's requests are still served."""

    async def body(port: int, stats: dict[str, int], guard: ConnectionGuard) -> None:
        hog = []
        for _ in range(40):  # more than the cap (20); the source limit (10) stops it first
            try:
                hog.append(
                    await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.5", 0))
                )
            except OSError:
                break
        await asyncio.sleep(0.2)
        assert guard.open == 10, guard.open  # its share, not the cap
        assert guard.refused_source >= 30
        served = 0
        for _ in range(5):  # a normal client, from another address
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, local_addr=("127.0.0.6", 0)
            )
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            async with asyncio.timeout(2):
                answer = await reader.readuntil(b"\r\n\r\n")
            served += answer.startswith(b"HTTP/1.1 ")  # (503: no route here, but served)
            writer.close()
        assert served == 5
        for _, w in hog:
            w.close()

    stats = scenario(body, cap=20, per_source=10)
    assert stats["refused_cap"] >= 30


def test_udp_sessions_count_against_the_cap_and_their_source() -> None:
    """A flood of source ports from one address used to open a socket per
    port, outside any cap, until descriptors ran out."""
    from healthgate.dataplane.udp import UdpListener

    async def go() -> tuple[int, int, dict[str, int]]:
        loop = asyncio.get_running_loop()
        echo_t, _ = await loop.create_datagram_endpoint(
            asyncio.DatagramProtocol, local_addr=("127.0.0.1", 0)
        )
        upstream = echo_t.get_extra_info("sockname")[:2]
        guard = ConnectionGuard(100, max_per_source=8)
        stats: dict[str, int] = {}
        listen_t, listener = await loop.create_datagram_endpoint(
            lambda: UdpListener(lambda: [upstream], 60.0, ListenerCounters(stats), guard=guard),
            local_addr=("127.0.0.1", 0),
        )
        port = listen_t.get_extra_info("sockname")[1]
        senders = []
        for source in ["127.0.0.7"] * 30 + ["127.0.0.8"] * 3:  # 30 source ports, then 3 more
            t, _ = await loop.create_datagram_endpoint(
                asyncio.DatagramProtocol, local_addr=(source, 0)
            )
            t.sendto(b"x", ("127.0.0.1", port))
            senders.append(t)
        await asyncio.sleep(0.3)
        sessions, held = len(listener.sessions), guard.sessions
        for t in (*senders, listen_t, echo_t):
            t.close()
        await asyncio.sleep(0.05)
        return sessions, held, stats

    sessions, held, stats = run_async(go(), timeout=20)
    assert sessions == 8 + 3 and held == 11, (sessions, held)  # 8 of the flood, all 3 others
    assert stats["dropped"] == 30 - 8
