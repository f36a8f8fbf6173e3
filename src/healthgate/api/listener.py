"""The API's own HTTP server: uvicorn (h11), on a socket bound first.

:meth:`ApiListener.bind` binds and listens on the API's address at the very
start of ``serve`` - before the store, the data plane or anything a tenant
configures can take the address - and :meth:`ApiListener.serve` starts
answering on that socket once everything is up. Connections that arrive in
between wait in the accept queue.

The API's own bounds (docs/operations.md, "Limits and protections"): h11
bounds a request head as it arrives and it must be whole within
``head_timeout`` (:class:`_H11WithHeadTimeout`: uvicorn has no such
timeout), idle keep-alive connections close after 5 s, and past
``max_connections`` new connections get 503 instead of descriptors - but
``reserved_for_health`` more may still ask for a health answer
(api/capacity.py). Bodies are the middleware's (api/bodies.py). uvicorn
installs no signal handlers: the runtime owns the signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from healthgate.api.app import ApiSettings
from healthgate.api.capacity import OpenConnections, SourceConnections, is_health_request_line
from healthgate.api.errors import error_body

# seconds an idle kept-alive connection stays open (clients must let theirs
# go sooner: healthgate.client.KEEPALIVE_EXPIRY)
IDLE_TIMEOUT = 5


class _H11WithHeadTimeout(H11Protocol):
    """uvicorn's h11 protocol with a header timeout: a request head must be
    whole within ``HEAD_TIMEOUT`` of the connection opening or of its first
    byte after a response, or the connection is closed (a slowloris would
    otherwise hold one of the API's connections for ever)."""

    HEAD_TIMEOUT = 10.0
    SOURCES: SourceConnections | None = None  # (set per server: see ApiListener.serve)
    CONNECTIONS: OpenConnections | None = None  # (likewise)
    _head_timer: asyncio.TimerHandle | None = None
    _source: str | None = None
    _counted = False
    # in the health reserve: the first request line is checked (what came so far)
    _health_only: bytearray | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sources = self.SOURCES
        if sources is not None:
            peer = transport.get_extra_info("peername")
            source = str(peer[0]) if peer else ""
            if not sources.admit(source):
                transport.close()  # one address may not hold every connection
                return
            self._source = source
        connections = self.CONNECTIONS
        if connections is not None:
            self.transport = transport  # (evict() may close it from now on)
            admitted = connections.admit(self)
            if admitted is None:
                self._release()
                transport.close()
                return
            self._counted = True
            if not admitted:
                self._health_only = bytearray()
        super().connection_made(transport)
        self._arm_head_timer()

    def _release(self) -> None:
        if self._source is not None and self.SOURCES is not None:
            self.SOURCES.release(self._source)
            self._source = None
        if self._counted and self.CONNECTIONS is not None:
            self.CONNECTIONS.release(self)
            self._counted = False

    def waiting(self) -> bool:
        return self._waiting_for_head()

    def evict(self) -> None:
        self._counted = False  # (no longer among the open connections)
        if not self.transport.is_closing():
            self.transport.close()

    def _health_line(self, data: bytes) -> bytes | None:
        """A reserved connection's bytes until its request line is whole and
        asks for a health answer (then all of them); None meanwhile, or when
        it asks for something else (answered 503, closed)."""
        held = self._health_only
        assert held is not None
        held += data
        end = held.find(b"\r\n")
        if end < 0 and len(held) < 2048:
            return None
        if end >= 0 and is_health_request_line(bytes(held[:end])):
            self._health_only = None
            return bytes(held)
        body = json.dumps(
            error_body(503, "the API is answering as many connections as it may")
        ).encode()
        self.transport.write(
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()
        return None

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.HEAD_TIMEOUT, self._head_expired)

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self._health_only is not None:
            whole = self._health_line(data)
            if whole is None:
                return
            data = whole
        if self._waiting_for_head():
            self._arm_head_timer()
        super().data_received(data)
        if not self._waiting_for_head() and self._head_timer is not None:
            self._head_timer.cancel()  # a head arrived whole: its request is being served
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if getattr(self, "transport", None) is None:
            return  # (refused before it was made)
        super().connection_lost(exc)


class _QuietUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the runtime owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:
        return None


class ApiListener:
    def __init__(self, host: str, port: int, settings: ApiSettings) -> None:
        self.host, self.port = host, port
        self.settings = settings
        self.sock: socket.socket | None = None
        self._server: _QuietUvicorn | None = None
        self._task: asyncio.Task[None] | None = None
        self.sources = SourceConnections(settings.max_per_source)
        self.connections = OpenConnections(settings.max_connections, settings.reserved_for_health)

    def bind(self) -> None:
        """Take the address now (OSError naming ``--listen`` when it is taken)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
            sock.listen(1024)
        except OSError as exc:
            sock.close()
            raise OSError(
                f"--listen {self.host}:{self.port}: {exc.strerror or exc} (another healthgate?)"
            ) from None
        sock.setblocking(False)
        self.sock = sock
        self.port = sock.getsockname()[1]  # (an ephemeral port asked for: the real one)

    async def serve(self, app: Any) -> None:
        """Answer on the bound socket (returns once uvicorn serves)."""
        assert self.sock is not None, "bind() first"
        s = self.settings
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            loop="none",
            timeout_graceful_shutdown=2,
            http=type(
                "H11Protocol",
                (_H11WithHeadTimeout,),
                {
                    "HEAD_TIMEOUT": s.head_timeout,
                    "SOURCES": self.sources,
                    "CONNECTIONS": self.connections,
                },
            ),
            h11_max_incomplete_event_size=s.max_head_bytes,
            timeout_keep_alive=IDLE_TIMEOUT,
            # (no limit of uvicorn's: it would answer 503 to health requests too;
            # the protocol bounds connections with a reserve for health answers,
            # the API's middleware requests in flight: api/capacity.py)
            limit_concurrency=None,
        )
        self._server = server = _QuietUvicorn(config)
        self._task = task = asyncio.create_task(server.serve(sockets=[self.sock]), name="api")
        while not server.started:
            if task.done():
                task.result()  # raises why the API could not start
                raise RuntimeError(f"the API could not serve on {self.host}:{self.port}")
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self.sock is not None:
            self.sock.close()
