"""N HTTP health endpoints in one uvloop process, on 127.0.0.1:BASE..BASE+N-1.

Each answers any request with ``200 ok`` (keep-alive aware). Used by
bench/probes.py as the common target of HAProxy and healthgate.

    python bench/backends.py --count 1000 --base-port 21000
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import signal
import ssl

import uvloop

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


class Endpoint(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, _, self.buf = self.buf.partition(b"\r\n\r\n")
            self.transport.write(RESPONSE)
            if b"connection: close" in head.lower():
                self.transport.close()
                return

    def connection_lost(self, exc: Exception | None) -> None:
        pass


async def main(count: int, base: int, host: str = "127.0.0.1", tls: str | None = None) -> None:
    context = None
    if tls:  # HTTPS endpoints: one certificate and key (PEM) for all
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tls)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    loop = asyncio.get_running_loop()
    servers = []
    for i in range(count):
        servers.append(
            await loop.create_server(
                Endpoint, host, base + i, backlog=512, reuse_address=True, ssl=context
            )
        )
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for s in servers:
        s.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--base-port", type=int, default=21000)
    ap.add_argument("--host", default="127.0.0.1", help="the loopback address to listen on")
    ap.add_argument("--tls", metavar="PEM", help="serve HTTPS with this key and certificate")
    a = ap.parse_args()
    uvloop.run(main(a.count, a.base_port, a.host, a.tls))
