"""The L7 fast path's protocol objects without sockets: HttpProxy and a
pooled UpstreamConnection over stand-in transports, one plain request and
its whole response at a time. Compiled, their reads are handled by
_speedups.c's FastProxy / FastUpstream; with HEALTHGATE_PURE_PYTHON=1 by
their Python bases (`make pure` runs this file both ways). What the C must
get right beyond what tests/integration/test_proxies.py sees through real
sockets: references (nothing leaks, cycles are collected), errors raised
where Python would raise them, and each field left as the Python path
leaves it."""

from __future__ import annotations

import asyncio
import functools
import gc
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import uvloop

from healthgate import http_scan
from healthgate.dataplane.counters import ListenerCounters
from healthgate.dataplane.guard import ConnectionGuard
from healthgate.dataplane.http import HttpProxy
from healthgate.dataplane.http_limits import HttpSettings
from healthgate.dataplane.upstream import UpstreamConnection, UpstreamPool

REQUEST = b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n"
FORWARDED = b"GET /x HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: 127.0.0.9\r\n\r\n"
RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
ADDRESS = ("127.0.0.1", 8080)


class Transport:
    """Records what is written; says it is closing once closed."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.9", 40000) if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def close(self) -> None:
        self.closing = True

    abort = close


class Stack:
    """A proxy, its pool and one pooled upstream connection."""

    def __init__(self, first: Any = "round robin") -> None:
        self.settings = HttpSettings()
        self.pool = UpstreamPool(self.settings)
        self.upstream = UpstreamConnection(ADDRESS)
        self.upstream_transport = Transport()
        self.upstream.connection_made(self.upstream_transport)  # type: ignore[arg-type]
        self.pool.release(self.upstream)
        self.region = [ADDRESS]
        self.tries = 0
        self.guard = ConnectionGuard(10)
        self.counters = ListenerCounters()
        self.stats = self.counters.events
        self.active: dict[tuple[str, int], int] = {}
        self.proxy = HttpProxy(
            lambda: [self.region],
            self.pool,
            self.settings,
            self.counters,
            None,
            self.active,
            functools.partial(self.first_try) if first == "round robin" else first,
            self.guard,
        )
        self.client = Transport()
        self.proxy.connection_made(self.client)  # type: ignore[arg-type]

    def first_try(self, _data: bytes) -> tuple[tuple[str, int], list[tuple[str, int]]]:
        self.tries += 1
        return self.region[0], self.region

    def exchange(self) -> None:
        self.proxy.data_received(REQUEST)
        self.upstream.data_received(RESPONSE)

    def close(self) -> None:
        self.pool.close()
        self.guard.close()


@pytest.fixture
def stack() -> Iterator[Stack]:
    loop = uvloop.new_event_loop()
    made: list[Stack] = []

    async def build() -> Stack:
        made.append(Stack())
        return made[0]

    yield loop.run_until_complete(build())
    made[0].close()

    async def drain() -> None:  # (a general path's worker, never run here)
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    loop.run_until_complete(drain())
    loop.close()


def test_the_compiled_bases_are_used_when_built() -> None:
    speedups = http_scan.speedups
    if speedups is None:  # HEALTHGATE_PURE_PYTHON=1 (or not built: test_http_scan fails then)
        assert not any(c.__module__ == "healthgate._speedups" for c in HttpProxy.__mro__)
        return
    assert issubclass(HttpProxy, speedups.FastProxy)
    assert issubclass(UpstreamConnection, speedups.FastUpstream)
    # (uvloop calls the C data_received: neither subclass overrides it)
    assert "data_received" not in vars(HttpProxy)
    assert "data_received" not in vars(UpstreamConnection)


def test_one_exchange_leaves_every_field_as_the_python_path_does(stack: Stack) -> None:
    stack.exchange()
    proxy, conn = stack.proxy, stack.upstream
    assert stack.upstream_transport.written == [FORWARDED]
    assert stack.client.written == [RESPONSE]
    assert stack.stats == {"connections": 1, "requests": 1, "fast_path": 1}
    counted = stack.counters.upstreams[ADDRESS]
    assert (counted.served, counted.errors, counted.run) == (1, 0, 0)
    assert stack.active == {}  # counted up for the exchange, down after it
    assert proxy.inflight is False and proxy.upstream is None and proxy.touched is True
    assert proxy._fast_counted is None and proxy._fast_request == FORWARDED
    assert proxy._pending == {}
    assert conn.owner is None and conn.status == 200 and conn.reused is True
    assert conn.got_bytes is True and conn.sink is None
    assert stack.pool.idle_connections[ADDRESS] == [conn]  # pooled again


def test_a_request_with_no_pooled_connection_pins_its_endpoint(stack: Stack) -> None:
    stack.pool.idle_connections[ADDRESS].clear()
    stack.proxy.data_received(REQUEST)
    assert stack.proxy._pin == ADDRESS
    assert stack.upstream_transport.written == []
    assert stack.proxy.current is not None or stack.proxy.queue  # the parser has it
    assert "fast_path" not in stack.stats


def test_without_a_first_try_chooser_the_route_is_asked(stack: Stack) -> None:
    stack.proxy.first = None
    stack.exchange()
    assert stack.stats["fast_path"] == 1 and stack.tries == 0
    assert stack.client.written == [RESPONSE]


def test_a_chooser_that_raises_raises_from_data_received(stack: Stack) -> None:
    def broken(_data: bytes) -> None:
        raise RuntimeError("chooser broke")

    stack.proxy.first = broken
    with pytest.raises(RuntimeError, match="chooser broke"):
        stack.proxy.data_received(REQUEST)
    assert stack.proxy.inflight is False and stack.upstream_transport.written == []
    assert stack.pool.idle_connections[ADDRESS] == [stack.upstream]  # not taken


def test_no_reference_leaks(stack: Stack) -> None:
    """A thousand exchanges change no object's reference count."""
    held = [stack.proxy, stack.upstream, ADDRESS, stack.region, REQUEST, RESPONSE]
    held += [stack.proxy._xff, stack.client]
    for _ in range(10):  # (the first ones make the counters and the pool's list)
        stack.exchange()
    held.append(stack.counters.upstreams[ADDRESS])
    stack.client.written.clear()  # (what the stand-ins keep is not a leak)
    stack.upstream_transport.written.clear()
    before = [sys.getrefcount(o) for o in held]
    for _ in range(1000):
        stack.exchange()
        stack.client.written.clear()
        stack.upstream_transport.written.clear()
    assert [sys.getrefcount(o) for o in held] == before
    assert stack.stats["fast_path"] == 1010


def test_a_closed_pair_is_collected(stack: Stack) -> None:
    """The proxy and its upstream connection refer to each other mid-exchange:
    the cycle collector must see through both C types."""
    stack.proxy.data_received(REQUEST)  # (the connection's owner is the proxy now)
    proxy, conn = weakref.ref(stack.proxy), weakref.ref(stack.upstream)
    stack.pool.idle_connections.clear()
    stack.pool.deadlines.close()
    stack.guard.unwatch(stack.proxy)
    stack.proxy = stack.upstream = None  # type: ignore[assignment]
    gc.collect()
    assert proxy() is None and conn() is None


def test_a_chooser_that_breaks_the_proxy_gets_an_error_not_a_crash(stack: Stack) -> None:
    """The chooser is Python, called from the middle of the C first try:
    whatever it does to the proxy, the C must not read a field blindly."""

    def chooser(_data: bytes) -> tuple[tuple[str, int], list[tuple[str, int]]]:
        stack.proxy._xff = "not bytes"  # type: ignore[assignment]
        return ADDRESS, stack.region

    stack.proxy.first = chooser
    with pytest.raises(TypeError):
        stack.proxy.data_received(REQUEST)
    assert stack.upstream_transport.written == []
