"""What one client may make an L7 front end hold (real sockets): request
bodies pipelined behind an upstream that reads and never answers - the
issue's 280 MiB from one connection - bounded per connection (back-pressure)
and for all connections together (503); bodies and whole requests that do
not arrive in time (408)."""

from __future__ import annotations

import asyncio
from typing import Any

from healthgate.dataplane.counters import ListenerCounters
from healthgate.dataplane.guard import ConnectionGuard
from healthgate.dataplane.http import HttpProxy
from healthgate.dataplane.http_limits import HttpSettings
from healthgate.dataplane.upstream import UpstreamPool
from tests.helpers import run_async

MiB = 1024 * 1024


async def hung_upstream() -> tuple[asyncio.Server, list[int]]:
    """Reads requests whole, never answers; counts the bytes it read."""
    read = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(1 << 16):
                read[0] += len(chunk)
        except ConnectionError:
            pass

    return await asyncio.start_server(handle, "127.0.0.1", 0), read


async def front(
    upstream: int, settings: HttpSettings, guard: ConnectionGuard, stats: dict[str, int]
) -> asyncio.Server:
    pool = UpstreamPool(settings)
    groups = lambda: [[("127.0.0.1", upstream)]]  # noqa: E731
    return await asyncio.get_running_loop().create_server(
        lambda: HttpProxy(groups, pool, settings, ListenerCounters(stats), guard=guard),
        "127.0.0.1",
        0,
    )


async def released(guard: ConnectionGuard) -> None:
    """Until the front end holds nothing: a client that left while it was not
    being read is noticed when its request in flight ends (the per-try
    timeout, 1 s here) and reading resumes."""
    for _ in range(100):
        if guard.buffered == 0:
            return
        await asyncio.sleep(0.05)


# (a read may end past a bound: the front end stops reading after it)
ONE_READ = 256 * 1024


def post(size: int) -> bytes:
    head = b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size
    return head + b"x" * size


async def push(port: int, requests: int, size: int, seconds: float) -> int:
    """Pipeline ``requests`` POSTs for ``seconds`` at most; how many bytes went out."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0
    one = post(size)
    try:
        async with asyncio.timeout(seconds):
            for _ in range(requests):
                writer.write(one)
                await writer.drain()  # (blocks once the front end stops reading)
                sent += len(one)
    except (TimeoutError, ConnectionError):
        pass
    writer.transport.abort()
    return sent


def test_one_connection_behind_a_hung_upstream_holds_a_bounded_amount() -> None:
    settings = HttpSettings(
        per_try_timeout=1.0, max_body_bytes=1 * MiB, max_buffered_per_connection=2 * MiB
    )

    async def go() -> dict[str, Any]:
        upstream, _ = await hung_upstream()
        guard = ConnectionGuard(100, max_buffered=64 * MiB)
        stats: dict[str, int] = {}
        server = await front(upstream.sockets[0].getsockname()[1], settings, guard, stats)
        port = server.sockets[0].getsockname()[1]
        peak = [0]

        async def watch() -> None:
            while True:
                peak[0] = max(peak[0], guard.buffered)
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        sent = await push(port, 33, 1 * MiB, seconds=3.0)
        watcher.cancel()
        await released(guard)
        server.close()
        upstream.close()
        return {"sent": sent, "peak": peak[0], "after": guard.buffered}

    out = run_async(go(), timeout=30)
    # 33 requests pipelined; the front end took the one in flight and what
    # fits its 2 MiB, then stopped reading (the rest waits in the client)
    assert out["peak"] <= 2 * MiB + ONE_READ, out
    assert out["sent"] < 33 * MiB, out  # the client was held back (TCP buffers aside)
    assert out["after"] == 0, out  # (and released it all when the client left)


def test_all_connections_together_are_bounded_and_the_rest_get_503() -> None:
    settings = HttpSettings(
        per_try_timeout=1.0, max_body_bytes=1 * MiB, max_buffered_per_connection=2 * MiB
    )

    async def go() -> dict[str, Any]:
        upstream, _ = await hung_upstream()
        guard = ConnectionGuard(100, max_buffered=4 * MiB)
        stats: dict[str, int] = {}
        server = await front(upstream.sockets[0].getsockname()[1], settings, guard, stats)
        port = server.sockets[0].getsockname()[1]
        peak = [0]

        async def watch() -> None:
            while True:
                peak[0] = max(peak[0], guard.buffered)
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(push(port, 4, 1 * MiB, seconds=3.0) for _ in range(8)))
        watcher.cancel()
        await released(guard)
        server.close()
        upstream.close()
        return {"peak": peak[0], "busy": stats.get("refused_busy", 0), "after": guard.buffered}

    out = run_async(go(), timeout=30)
    assert out["peak"] <= 4 * MiB, out
    assert out["busy"] > 0, out  # 8 connections x 2 MiB do not fit in 4 MiB: 503s
    assert out["after"] == 0, out


def test_a_body_that_does_not_arrive_in_time_gets_408() -> None:
    settings = HttpSettings(body_timeout=1.0, request_timeout=60.0)

    async def go() -> tuple[bytes, dict[str, int]]:
        upstream, _ = await hung_upstream()
        guard = ConnectionGuard(100, header_timeout=10.0)
        stats: dict[str, int] = {}
        server = await front(upstream.sockets[0].getsockname()[1], settings, guard, stats)
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", server.sockets[0].getsockname()[1]
        )
        writer.write(b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"y" * 10)
        await writer.drain()
        async with asyncio.timeout(5):
            answer = await reader.read()
        writer.close()
        server.close()
        upstream.close()
        guard.close()
        return answer, stats

    answer, stats = run_async(go(), timeout=20)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:80]
    assert b"body did not arrive in time" in answer
    assert stats.get("body_timeouts") == 1


def test_headers_a_client_names_in_connection_and_its_own_forwarding_claims_stop_here() -> None:
    """Hop-by-hop headers named in Connection are not passed on; Forwarded
    and X-Real-IP, which a client can forge, neither; X-Forwarded-For gets
    the client appended - on the fast path's requests and the general path's."""
    seen: list[bytes] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                seen.append(head)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async def go() -> None:
        upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
        guard = ConnectionGuard(100)
        server = await front(upstream.sockets[0].getsockname()[1], HttpSettings(), guard, {})
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", server.sockets[0].getsockname()[1]
        )
        for extra in (
            b"Connection: keep-alive, X-Secret\r\nX-Secret: 1\r\n",
            b"Forwarded: for=10.9.9.9\r\nX-Real-IP: 10.9.9.9\r\n",
            b"",
        ):
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n" + extra + b"\r\n")
            await writer.drain()
            async with asyncio.timeout(5):
                await reader.readuntil(b"ok")
        writer.close()
        server.close()
        upstream.close()
        guard.close()

    run_async(go(), timeout=20)
    assert len(seen) == 3
    for head in seen:
        low = head.lower()
        assert b"x-secret" not in low and b"forwarded:" not in low and b"x-real-ip" not in low
        assert b"x-forwarded-for: 127.0.0.1\r\n" in low, head
