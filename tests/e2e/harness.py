"""Region backends in a background thread, driven from synchronous tests."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop

from healthgate.fixtures.regions import RegionBackends
from tests.helpers import example_world
from tests.integration.servers import free_port


class Backends:
    def __init__(self, port: int) -> None:
        self.port = port
        self.backends = RegionBackends()
        for i in range(1, 5):
            self.backends.add("us-east1", f"127.0.1.{i}", port)
        for i in range(1, 3):
            self.backends.add("europe-west1", f"127.0.2.{i}", port)
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def __enter__(self) -> Backends:
        self.thread.start()
        self.run(self.backends.start())
        return self

    def __exit__(self, *exc: Any) -> None:
        self.run(self.backends.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def set_mode(self, region: str, mode: str, count: int | None = None) -> None:
        """Break (or heal) a region's endpoints: its first ``count`` (None: all)."""
        self.run(self.backends.set_mode(region, mode, count))


def e2e_world(
    port: int, front_port: int, producer_ports: tuple[int, int], **policy: Any
) -> list[dict[str, Any]]:
    """The shared example with fast checks (1 s, thresholds 2), free ports, and
    the consumer's failover policy overridden by ``policy``."""
    prod_port = {"us-east1": producer_ports[0], "europe-west1": producer_ports[1]}
    out = example_world(port=port, fast=True)
    for d in out:
        if d["kind"] == "ForwardingRule" and d["project"] == "shop":
            d["ports"] = [prod_port[d["region"]]]
        if d["kind"] == "ForwardingRule" and d["project"] == "web":
            d["portRange"] = str(front_port)
        if d["kind"] == "BackendService" and d["project"] == "web" and policy:
            d["failoverPolicy"] = {**d.get("failoverPolicy", {}), **policy}
    return out


def one_port_on(*hosts: str) -> int:
    """A port that is free on every one of ``hosts`` (for rules that must
    share a port: a DNS answer carries an address, not a port)."""
    import socket

    for _ in range(50):
        port = free_port(hosts[0])
        try:
            for host in hosts[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {hosts}")


def ports() -> tuple[int, int, tuple[int, int]]:
    return free_port(), free_port(), (free_port("127.0.1.100"), free_port("127.0.2.100"))


class UdpEcho(asyncio.DatagramProtocol):
    """Answers each datagram with ``region=R <datagram>`` unless the region is broken."""

    def __init__(self, backends: RegionBackends, region: str) -> None:
        self.backends = backends
        self.region = region
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        if self.backends.regions().get(self.region) == "ok" and self.transport is not None:
            self.transport.sendto(f"region={self.region} ".encode() + data, addr)


def start_udp_echo(b: Backends) -> list[asyncio.BaseTransport]:
    async def go() -> list[asyncio.BaseTransport]:
        loop = asyncio.get_running_loop()
        out: list[asyncio.BaseTransport] = []
        for ep in b.backends.endpoints:

            def echo(region: str = ep.region) -> UdpEcho:
                return UdpEcho(b.backends, region)

            transport, _ = await loop.create_datagram_endpoint(echo, local_addr=(ep.ip, ep.port))
            out.append(transport)
        return out

    result: list[asyncio.BaseTransport] = b.run(go())
    return result


def region_at(url: str) -> str | None:
    """Which region answers a new request to ``url`` (None: no answer)."""
    import httpx

    try:
        body = httpx.get(url, timeout=2, headers={"Connection": "close"}).text
    except httpx.HTTPError:
        return None
    return body.split()[0].removeprefix("region=") if body.startswith("region=") else None


def break_and_time(
    neg_state: Callable[[str], str],
    set_mode: Callable[[str, str], None],
    served: Callable[[], str | None],
) -> tuple[float, float]:
    """us-east1 starts refusing: (seconds until healthgate decides it is
    UNHEALTHY, seconds from that decision until ``served`` moved to
    europe-west1). Bounded by the waits' own limits."""
    import time

    from tests.integration.serve_proc import wait_for

    set_mode("us-east1", "refuse")
    broke = time.monotonic()
    wait_for(lambda: neg_state("us-east1") == "UNHEALTHY", 15, what="us-east1 UNHEALTHY")
    decided = time.monotonic()
    wait_for(lambda: served() == "europe-west1", 10, interval=0.05, what="failover")
    return decided - broke, time.monotonic() - decided
