"""Real servers on loopback that misbehave on purpose, for probe tests."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from typing import Any

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_head(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


def respond(status: int, body: bytes = b"ok", extra: bytes = b"") -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: answer every request on the connection
                head = await read_head(reader)
                writer.write(
                    b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n%s\r\n%s"
                    % (status, len(body), extra, body)
                )
                await writer.drain()
                if b"connection: close" in head.lower():
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return handler


async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Accept, read the request, never answer."""
    try:
        await read_head(reader)
        await asyncio.sleep(3600)
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def endless_headers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(1_000_000):  # bounded: stops when the client goes away
            writer.write(b"X-Header-%d: %s\r\n" % (i, b"y" * 100))
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def huge_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        await read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n")
        chunk = b"z" * 65536
        for _ in range(16_000):  # up to ~1 GB, bounded; stops when the client goes away
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def reset_mid_response(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_head(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-")
    await writer.drain()
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_head(reader)
    writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
    await writer.drain()
    writer.close()


async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


class Server:
    """An asyncio server on 127.0.0.1 with a free port."""

    def __init__(
        self, handler: Handler, tls: ssl.SSLContext | None = None, host: str = "127.0.0.1"
    ) -> None:
        self.handler = handler
        self.tls = tls
        self.host = host
        self.port = 0
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Server:
        async def counted(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.connections += 1
            task = asyncio.current_task()
            assert task is not None
            self._tasks.add(task)
            try:
                await self.handler(r, w)
            finally:
                self._tasks.discard(task)

        self._server = await asyncio.start_server(counted, self.host, 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A port with nothing listening (connects are refused).

    Under pytest-xdist (``make test`` runs two workers) each worker draws
    from its own range below the kernel's ephemeral ports (32768+), never
    twice the same: a port the kernel hands to one worker (port 0) may be
    handed to the other before the first binds it, and a serve then exits
    with "Address already in use"."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit():
        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    index = int(worker[2:]) % _WORKER_RANGES
    low = _LOWEST + index * _RANGE
    for _ in range(1000):
        port = low + _random.randrange(_RANGE)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{low + _RANGE - 1} for {worker}")


_LOWEST, _RANGE, _WORKER_RANGES = 10_000, 5_000, 4  # (10,000-29,999: below 32,768)
_handed: set[int] = set()
_random = random.Random()


class FullBacklog:
    """A listener that never accepts, with its accept queue filled: new SYNs are
    dropped, so a connect never completes (the handshake-never-completes case)."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(0)
        self.port = self.listener.getsockname()[1]
        self.fillers: list[socket.socket] = []

    def __enter__(self) -> FullBacklog:
        for _ in range(4):  # the queue holds backlog + 1; extra connects just hang in SYN_SENT
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", self.port))
            self.fillers.append(s)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s in self.fillers:
            s.close()
        self.listener.close()


# ------------------------------------------------------------------ SPEC §10: what probes send

PROXY_V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"


async def read_proxy_header(reader: asyncio.StreamReader) -> bytes | None:
    """A PROXY protocol preamble, v1 or v2, as a real listener reads it
    first on a connection (None: not one - the listener closes)."""
    first = await reader.readexactly(6)
    if first == b"PROXY ":
        line = await reader.readuntil(b"\r\n")
        if len(line) > 101:  # (v1's line is at most 107 bytes)
            return None
        return first + line
    rest = await reader.readexactly(10)
    head = first + rest
    if head[:12] != PROXY_V2_SIGNATURE or head[12] >> 4 != 2:
        return None
    length = struct.unpack("!H", head[14:16])[0]
    return head + await reader.readexactly(length)


def demanding(
    method: str = "GET",
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    proxy: bool = False,
    seen: list[bytes] | None = None,
) -> Handler:
    """An HTTP endpoint that answers 200 only to the right request (method,
    headers, body), else 403; with ``proxy``, a PROXY-protocol listener
    (the preamble first on each connection, or it closes). Keeps
    connections alive; ``seen`` gets every preamble and request head."""
    wanted = {k.lower(): v for k, v in (headers or {}).items()}

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if proxy:
                preamble = await read_proxy_header(reader)
                if preamble is None:
                    return
                if seen is not None:
                    seen.append(preamble)
            while True:
                head = await read_head(reader)
                if seen is not None:
                    seen.append(head)
                lines = head.decode("latin-1").split("\r\n")
                got_method = lines[0].split(" ")[0]
                got = {}
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name:
                        got[name.strip().lower()] = value.strip()
                length = int(got.get("content-length", "0"))
                got_body = await reader.readexactly(length) if length else b""
                ok = (
                    got_method == method
                    and all(got.get(k) == v for k, v in wanted.items())
                    and got_body == body
                )
                status, answer = (200, b"ok") if ok else (403, b"no")
                content = b"" if got_method == "HEAD" else answer
                writer.write(
                    b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s"
                    % (status, len(answer), content)
                )
                await writer.drain()
                if got.get("connection") == "close":
                    break
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    return handler


def redis_like(proxy: bool = False) -> Handler:
    """``PING`` -> ``+PONG``, anything else ``-ERR`` (a Redis port, say)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if proxy and await read_proxy_header(reader) is None:
                return
            line = await reader.readuntil(b"\r\n")
            writer.write(b"+PONG\r\n" if line == b"PING\r\n" else b"-ERR unknown command\r\n")
            await writer.drain()
            await reader.read(1)  # until the prober goes
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    return handler


def banner(text: bytes, then_close: bool = False) -> Handler:
    """Speaks first, as SMTP does (``220 ...``), then waits (or closes)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(text)
            await writer.drain()
            if not then_close:
                await reader.read(1)
        except ConnectionError:
            pass
        finally:
            writer.close()

    return handler
