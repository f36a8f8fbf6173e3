"""A webhook receiver on loopback for the tests: keeps every request, answers
204, or a chosen status while ``failing`` is set."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Receiver:
    """Answers ``failing`` (a status) while set, else 204; keeps every request."""

    port: int = 0
    failing: int | None = None
    requests: list[tuple[dict[str, str], bytes, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def acked(self) -> list[int]:
        with self.lock:
            return [json.loads(b)["id"] for _, b, code in self.requests if code < 300]

    def answered(self) -> list[tuple[int, int]]:
        with self.lock:
            return [(json.loads(b)["id"], code) for _, b, code in self.requests]


@contextmanager
def receiver() -> Iterator[Receiver]:
    rec = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = min(int(self.headers.get("Content-Length", "0")), 1 << 20)
            body = self.rfile.read(length)
            with rec.lock:
                code = rec.failing or 204
                rec.requests.append((dict(self.headers.items()), body, code))
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    rec.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield rec
    finally:
        server.shutdown()
        server.server_close()
