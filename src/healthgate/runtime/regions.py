"""Simulated regional backends: real HTTP servers on loopback that say which
region and endpoint answered, and that can be broken on purpose.

Used by the end-to-end tests and by ``healthgate demo``. Each endpoint
answers ``GET`` with ``200`` and a body like ``region=us-east1
endpoint=127.0.1.2`` - unless its region is set to:

* ``refuse`` - the listener is closed: connections are refused (RST);
* ``hang``   - connections are accepted and requests read, but never answered;
* ``503``    - every request gets ``503 Service Unavailable``.

:meth:`RegionBackends.deny` makes a region answer 503 to one client
address only (a prober whose path to the region is broken, for the
multi-vantage tests: the other probers still see it HEALTHY).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

MODES = ("ok", "refuse", "hang", "503")


@dataclass(slots=True)
class _Endpoint:
    region: str
    ip: str
    port: int
    mode: str = "ok"
    server: asyncio.Server | None = None
    writers: set[asyncio.StreamWriter] = field(default_factory=set)


class RegionBackends:
    def __init__(self) -> None:
        self.endpoints: list[_Endpoint] = []
        self.served: dict[str, int] = {}
        self.denied: dict[str, set[str]] = {}  # region -> client addresses answered 503
        self._tasks: set[asyncio.Task[None]] = set()

    def add(self, region: str, ip: str, port: int) -> None:
        self.endpoints.append(_Endpoint(region, ip, port))

    async def start(self) -> None:
        for ep in self.endpoints:
            await self._listen(ep)

    async def _listen(self, ep: _Endpoint) -> None:
        if ep.server is None:

            async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                await self._serve(ep, reader, writer)

            ep.server = await asyncio.start_server(handler, ep.ip, ep.port, reuse_address=True)

    async def _serve(
        self, ep: _Endpoint, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        ep.writers.add(writer)
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                if ep.mode == "hang":
                    await asyncio.sleep(3600)
                peer = writer.get_extra_info("peername")
                denied = self.denied.get(ep.region)
                if ep.mode == "503" or (denied and peer and peer[0] in denied):
                    body = f"region={ep.region} endpoint={ep.ip} unavailable\n".encode()
                    writer.write(
                        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n%s"
                        % (len(body), body)
                    )
                else:
                    body = f"region={ep.region} endpoint={ep.ip}\n".encode()
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s"
                        % (len(body), body)
                    )
                    self.served[ep.region] = self.served.get(ep.region, 0) + 1
                await writer.drain()
                if b"connection: close" in head.lower():
                    break
        except (
            asyncio.IncompleteReadError,
            ConnectionError,
            asyncio.LimitOverrunError,
            asyncio.CancelledError,
        ):
            pass
        finally:
            ep.writers.discard(writer)
            writer.close()
            if task is not None:
                self._tasks.discard(task)

    def deny(self, region: str, client: str, on: bool = True) -> None:
        """Answer 503 to requests from ``client`` (an address) in ``region``."""
        clients = self.denied.setdefault(region, set())
        if on:
            clients.add(client)
        else:
            clients.discard(client)

    async def set_mode(self, region: str, mode: str, count: int | None = None) -> int:
        """Break (or heal, with ``ok``) a region's endpoints; returns how many changed."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        targets = [ep for ep in self.endpoints if ep.region == region][: count or None]
        for ep in targets:
            ep.mode = mode
            if mode == "refuse":
                await self._close(ep)
            else:
                await self._listen(ep)
            if mode != "hang":
                for w in list(ep.writers):  # connections stuck in a hang end with it
                    if mode == "refuse":
                        w.transport.abort()
        return len(targets)

    async def _close(self, ep: _Endpoint) -> None:
        if ep.server is not None:
            ep.server.close()
            ep.server = None
        for w in list(ep.writers):
            w.transport.abort()

    async def stop(self) -> None:
        for ep in self.endpoints:
            await self._close(ep)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def regions(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for ep in self.endpoints:
            out[ep.region] = ep.mode
        return out


async def serve_forever(backends: RegionBackends) -> None:
    await backends.start()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.Event().wait()
