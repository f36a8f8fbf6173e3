"""UDP front ends as a spoofer would try them (issue 38), on real loopback
sockets: sessions have a budget of their own (a flood never takes the TCP
and HTTP front ends' connections), are bounded per network, give way when
idle under pressure, and a wildcard listener answers from the address it
was asked at."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from healthgate.dataplane import guard as guard_module
from healthgate.dataplane.counters import ListenerCounters
from healthgate.dataplane.guard import ConnectionGuard, prefix_of
from healthgate.dataplane.listeners import Layer, ListenerSpec, close_listener, open_listener
from healthgate.dataplane.udp import UdpListener
from tests.helpers import run_async

Address = tuple[str, int]


class Echo(asyncio.DatagramProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.transport.sendto(b"echo " + data, addr)  # type: ignore[attr-defined]


class Client(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.got: asyncio.Queue[tuple[bytes, Any]] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.got.put_nowait((data, addr))


async def echo_upstream() -> tuple[asyncio.BaseTransport, Address]:
    loop = asyncio.get_running_loop()
    t, _ = await loop.create_datagram_endpoint(Echo, local_addr=("127.0.0.1", 0))
    return t, t.get_extra_info("sockname")[:2]


async def udp_front(
    guard: ConnectionGuard, upstream: Address, ip: str = "127.0.0.1"
) -> tuple[Any, int, dict[str, int], list[UdpListener]]:
    stats: dict[str, int] = {}
    made: list[UdpListener] = []

    def factory() -> UdpListener:
        made.append(UdpListener(lambda: [upstream], 60.0, ListenerCounters(stats), guard=guard))
        return made[-1]

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind((ip, 0))
        port = probe.getsockname()[1]
    listener = await open_listener(
        "udp", ListenerSpec(ip, (port,), Layer.UDP, False), factory, False
    )
    assert listener.error is None, listener.error
    return listener, port, stats, made


async def send_from(source: str, port: int, data: bytes, dest: str = "127.0.0.1") -> Client:
    loop = asyncio.get_running_loop()
    t, client = await loop.create_datagram_endpoint(Client, local_addr=(source, 0))
    t.sendto(data, (dest, port))
    client.transport = t  # type: ignore[attr-defined]
    return client


async def settle(condition: Any, what: str) -> None:
    for _ in range(300):  # (bounded: 3 s)
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what}: not reached")


def test_a_udp_flood_never_takes_the_connections_of_tcp_front_ends() -> None:
    async def go() -> None:
        guard = ConnectionGuard(20, max_per_source=200, max_udp_sessions=50)
        up_t, upstream = await echo_upstream()
        listener, port, _stats, _made = await udp_front(guard, upstream)
        clients = [await send_from(f"127.0.{i // 200 + 20}.{i % 200 + 1}", port, b"x")
                   for i in range(400)]  # fmt: skip
        await settle(lambda: guard.sessions_refused + guard.sessions >= 400, "every datagram seen")
        assert guard.sessions <= 50
        # a TCP front end's connection is still admitted: the cap is the connections'
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        _, w = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        transport = w.transport
        assert guard.admit(transport)
        guard.release(transport)
        w.close()
        server.close()
        for c in clients:
            c.transport.close()  # type: ignore[attr-defined]
        await close_listener(listener)
        up_t.close()

    run_async(go())


def test_sessions_are_bounded_per_network() -> None:
    async def go() -> None:
        guard = ConnectionGuard(1000, max_per_source=4, max_sessions_per_prefix=10)
        up_t, upstream = await echo_upstream()
        listener, port, _stats, made = await udp_front(guard, upstream)
        clients = [await send_from(f"127.0.9.{i + 1}", port, b"x") for i in range(30)]
        clients += [await send_from("127.0.10.1", port, b"x")]  # another /24
        await settle(lambda: guard.sessions + guard.sessions_refused >= 31, "every one seen")
        await settle(lambda: len(made[0].sessions) == 11, "sessions open")
        assert guard.sessions == 11 and guard.sessions_refused == 20
        for c in clients:
            c.transport.close()  # type: ignore[attr-defined]
        await close_listener(listener)
        up_t.close()

    run_async(go())
    assert prefix_of("10.1.2.3") == "10.1.2.0/24"
    assert prefix_of("2001:db8:1:2:3::4") == "2001:db8:1:2::/64"


@pytest.mark.serial  # (its idleness is timed: alone on the machine)
def test_under_pressure_the_idlest_session_gives_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(guard_module, "SESSION_EVICT_IDLE", 60.0)

    async def go() -> None:
        guard = ConnectionGuard(1000, max_per_source=100, max_udp_sessions=3)
        up_t, upstream = await echo_upstream()
        listener, port, stats, made = await udp_front(guard, upstream)
        old = [await send_from(f"127.0.11.{i}", port, b"old") for i in (1, 2)]
        await settle(lambda: guard.sessions == 2, "two sessions")
        sessions = made[0].sessions
        for i, session in enumerate(sessions.values()):  # idle two minutes (and three)
            session.last -= 120 + 60 * (1 - i)
        active = await send_from("127.0.11.3", port, b"a")
        await settle(lambda: guard.sessions == 3, "three sessions")
        newcomer = await send_from("127.0.11.4", port, b"new")  # the budget is full
        await settle(lambda: stats.get("evicted", 0) == 1, "one eviction")
        assert [c[0] for c in sessions] == ["127.0.11.2", "127.0.11.3", "127.0.11.4"]
        data, _ = await asyncio.wait_for(newcomer.got.get(), 5)
        assert data == b"echo new"
        late = await send_from("127.0.11.5", port, b"late")  # the other idle one gives way
        await settle(lambda: stats.get("evicted", 0) == 2, "two evictions")
        # with nobody idle long enough, a newcomer is refused
        later = await send_from("127.0.11.6", port, b"later")
        await settle(lambda: guard.sessions_refused == 1, "refused")
        assert [c[0] for c in sessions] == ["127.0.11.3", "127.0.11.4", "127.0.11.5"]
        for c in (*old, active, newcomer, late, later):
            c.transport.close()  # type: ignore[attr-defined]
        await close_listener(listener)
        up_t.close()

    run_async(go())


def test_a_wildcard_udp_listener_answers_from_the_address_it_was_asked_at() -> None:
    async def go() -> None:
        guard = ConnectionGuard(100)
        up_t, upstream = await echo_upstream()
        listener, port, _, _ = await udp_front(guard, upstream, ip="0.0.0.0")
        for dest in ("127.0.0.5", "127.0.0.77"):
            client = await send_from("127.0.0.1", port, b"hi", dest=dest)
            data, source = await asyncio.wait_for(client.got.get(), 5)
            assert data == b"echo hi"
            assert source == (dest, port)  # not 127.0.0.1, whatever the client asked
            client.transport.close()  # type: ignore[attr-defined]
        await close_listener(listener)
        up_t.close()

    run_async(go())


def test_a_udp_listener_on_an_ipv6_wildcard_takes_ipv6_only() -> None:
    async def go() -> None:
        from healthgate.dataplane.udp_socket import udp_socket

        sock = udp_socket("::", 0, False)
        try:
            assert sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
            port = sock.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as v4:
                v4.bind(("0.0.0.0", port))  # the IPv4 wildcard of that port is still free
        finally:
            sock.close()

    run_async(go())
