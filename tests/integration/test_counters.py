"""What counts as an error on a data-plane hop (SPEC §8), with real sockets
on loopback: L7 (the fast path and the general path alike), L4 and UDP each
count successes and errors per upstream, by kind, in the listener's one
named type (dataplane/counters.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import pytest

from healthgate.dataplane.counters import ListenerCounters, PyCounters
from healthgate.dataplane.http import HttpProxy
from healthgate.dataplane.http_limits import HttpSettings
from healthgate.dataplane.tcp import TcpProxy
from healthgate.dataplane.udp import UdpListener
from healthgate.dataplane.upstream import UpstreamPool
from tests.helpers import run_async
from tests.integration.servers import Server, close_at_once, free_port, hang, respond
from tests.integration.test_proxies import connect, exchange, get

Address = tuple[str, int]


def counts(c: PyCounters) -> tuple[int, int, int, dict[str, int]]:
    return c.served, c.errors, c.gateway, dict(c.kinds)


async def l7(
    upstreams: list[Address], counters: ListenerCounters, fast: bool, **kw: Any
) -> asyncio.Server:
    groups = [[u] for u in upstreams]
    pool = UpstreamPool(HttpSettings(**kw))
    first = (lambda _data: (groups[0][0], groups[0])) if fast else None
    return await asyncio.get_running_loop().create_server(
        lambda: HttpProxy(lambda: groups, pool, pool.settings, counters, first=first),
        "127.0.0.1",
        0,
    )


STATUSES = [
    # (status the upstream answers, counted as (served, errors, gateway))
    (200, (1, 0, 0)),
    (404, (1, 0, 0)),  # the client's error: a success of the upstream's
    (500, (0, 1, 0)),
    (501, (0, 1, 0)),
    (503, (0, 1, 1)),  # (retried; with no other region the client gets a 502)
    (504, (0, 1, 1)),
]


@pytest.mark.parametrize("fast", [True, False], ids=["fast path", "general path"])
@pytest.mark.parametrize(("status", "want"), STATUSES)
def test_an_answer_is_counted_by_its_status(
    status: int, want: tuple[int, int, int], fast: bool
) -> None:
    async def go() -> tuple[int, int, int, dict[str, int]]:
        async with Server(respond(status)) as up:
            counters = ListenerCounters()
            address = ("127.0.0.1", up.port)
            proxy = await l7([address], counters, fast)
            reader, writer = await connect(proxy)
            await exchange(reader, writer, get(b"/warm"))  # (pools a connection for the fast path)
            await exchange(reader, writer, get(b"/"))
            writer.close()
            proxy.close()
            return counts(counters.upstreams[address])

    served, errors, gateway, kinds = run_async(go())
    assert (served, errors, gateway) == tuple(2 * n for n in want)
    assert kinds == ({str(status): 2} if errors else {})


def test_timeouts_resets_and_refusals_are_errors_of_their_kind() -> None:
    async def go() -> dict[str, tuple[int, int, int, dict[str, int]]]:
        async with Server(hang) as hung, Server(close_at_once) as closing:
            refused = ("127.0.0.1", free_port())
            targets = {
                "timeout": ("127.0.0.1", hung.port),
                "reset": ("127.0.0.1", closing.port),
                "refused": refused,
            }
            out = {}
            for name, address in targets.items():
                counters = ListenerCounters()
                proxy = await l7([address], counters, False, per_try_timeout=0.2)
                reader, writer = await connect(proxy)
                answer = await exchange(reader, writer, get(b"/"))
                assert answer.startswith(b"HTTP/1.1 502"), answer
                writer.close()
                proxy.close()
                out[name] = counts(counters.upstreams[address])
            return out

    got = run_async(go())
    assert got["timeout"] == (0, 1, 0, {"timeout": 1})
    assert got["reset"] == (0, 1, 0, {"reset": 1})
    assert got["refused"] == (0, 1, 1, {"refused": 1})  # a connect failure: a gateway error


def test_runs_of_errors_and_their_kinds() -> None:
    """The longest run since the last take, with its kinds: the evidence of
    a consecutive-errors ejection; a success ends a run."""

    async def go() -> list[Any]:
        answers = iter([503, 503, 200, 500, 503, 504])

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    status = next(answers, 200)
                    writer.write(b"HTTP/1.1 %d X\r\nContent-Length: 0\r\n\r\n" % status)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass

        async with Server(handler) as up:
            counters = ListenerCounters()
            address = ("127.0.0.1", up.port)
            proxy = await l7([address], counters, False)
            reader, writer = await connect(proxy)
            for _ in range(4):  # four requests, one try each (one region, one endpoint)
                await exchange(reader, writer, get(b"/"))
            taken = counters.take()
            writer.close()
            proxy.close()
            return [taken[address], counters.upstreams[address].run]

    hops, run_now = run_async(go())
    # the answers: 503, 503 (each a 502 to the client: nowhere to retry), 200, 500
    assert (hops.served, hops.errors) == (1, 3)
    assert hops.peak == 2 and hops.peak_kinds == ("503", "503")
    assert run_now == 1


def test_l4_a_refused_connect_and_a_reset_before_the_first_byte_are_errors() -> None:
    async def go() -> dict[str, tuple[int, int, int, dict[str, int]]]:
        async def banner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"hello\n")
            await writer.drain()
            await reader.read()
            writer.close()

        async def rst(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            writer.transport.abort()

        out = {}
        async with Server(banner) as ok, Server(rst) as resetting:
            targets = {
                "ok": ("127.0.0.1", ok.port),
                "reset": ("127.0.0.1", resetting.port),
                "refused": ("127.0.0.1", free_port()),
            }
            loop = asyncio.get_running_loop()
            for name, address in targets.items():
                counters = ListenerCounters()
                server = await loop.create_server(
                    lambda a=address, c=counters: TcpProxy(lambda _ip: [a], 1.0, c),  # type: ignore[misc]
                    "127.0.0.1",
                    0,
                )
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", server.sockets[0].getsockname()[1]
                )
                with contextlib.suppress(ConnectionError):
                    await asyncio.wait_for(reader.read(100), 5)
                writer.close()
                for _ in range(100):  # (the hop is judged when the upstream speaks or goes)
                    if address in counters.upstreams and (
                        counters.upstreams[address].served or counters.upstreams[address].errors
                    ):
                        break
                    await asyncio.sleep(0.01)
                server.close()
                out[name] = counts(counters.upstreams[address])
        return out

    got = run_async(go())
    assert got["ok"] == (1, 0, 0, {})
    assert got["reset"] == (0, 1, 0, {"reset": 1})
    assert got["refused"] == (0, 1, 1, {"refused": 1})


def test_udp_an_icmp_error_is_an_error_of_the_session_upstream() -> None:
    async def go() -> tuple[int, int, int, dict[str, int]]:
        loop = asyncio.get_running_loop()
        upstream = ("127.0.0.1", free_port())  # nobody there: port unreachable
        counters = ListenerCounters()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: UdpListener(lambda: [upstream], 60.0, counters), local_addr=("127.0.0.1", 0)
        )
        port = transport.get_extra_info("sockname")[1]
        client, _ = await loop.create_datagram_endpoint(
            asyncio.DatagramProtocol, remote_addr=("127.0.0.1", port)
        )
        for _ in range(50):
            client.sendto(b"ping")
            await asyncio.sleep(0.02)
            c = counters.upstreams.get(upstream)
            if c is not None and c.errors:
                break
        client.close()
        transport.close()
        return counts(counters.upstreams[upstream])

    served, errors, gateway, kinds = run_async(go())
    assert served == 1 and errors >= 1 and gateway == errors and set(kinds) == {"unreachable"}
