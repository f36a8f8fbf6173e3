"""HAProxy's agent-check protocol (``serve --agent HOST:PORT``).

HAProxy connects to the agent, sends the server line's ``agent-send``
string - here the PSC NEG that server stands for, as
``PROJECT/REGION/NAME`` - and reads one line back: ``up``, ``down`` or
``maint``, ``drain`` (integrations/verdicts.py says which). ``up`` is sent
as ``up ready`` (``up 70%`` as ``up ready 70%``): ``ready`` takes a server
out of a maintenance or drain state the agent put it in earlier (a NEG that
was not accepted, or not there yet, or DEGRADED), which ``up`` alone would
not.

Bounded: a request is one line of at most 512 bytes (the name is answered
at the first newline, or when nothing more came for 100 ms - HAProxy's
``agent-send`` may carry no newline); whatever it sends, a connection is
answered and closed ``read_timeout`` after it opened (each byte used to
start the wait anew, so a byte every 90 ms held a connection for
minutes); at most ``max_connections`` at once.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable

from healthgate.model.names import is_valid_name

log = logging.getLogger("healthgate.agent")

Answer = Callable[[str], str]  # NEG path -> "up" / "down" / "maint"
INSTANCE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def neg_path(reference: str) -> str | None:
    """``PROJECT/REGION/NAME`` (an instance's name may follow, after a
    space) -> the PSC NEG's full path (None if malformed)."""
    parts = reference.strip().split(" ", 1)[0].split("/")
    if len(parts) != 3 or not all(is_valid_name(p) for p in parts):
        return None
    project, region, name = parts
    return f"projects/{project}/regions/{region}/networkEndpointGroups/{name}"


def instance_of(request: bytes, peer: str) -> str:
    """Which HAProxy asks (SPEC §11's receipts): the name its ``agent-send``
    adds after the NEG (``PROJECT/REGION/NAME INSTANCE``: a name of 1-63
    letters, digits, ``.``, ``_`` and ``-``), else its address."""
    words = request.decode("ascii", "replace").split()
    if len(words) == 2 and INSTANCE_RE.fullmatch(words[1]):
        return words[1]
    return peer


def reply(answer: Answer, request: bytes) -> bytes:
    path = neg_path(request.decode("ascii", "replace"))
    word = answer(path) if path is not None else "maint"
    if word == "up" or word.startswith("up "):  # ("up 70%": a share's weight)
        return b"up ready" + word[2:].encode() + b"\n"
    return word.encode() + b"\n"


class _AgentConnection(asyncio.Protocol):
    MAX_LINE = 512
    SETTLE = 0.1  # seconds without more data: the request is whole

    def __init__(self, server: AgentServer) -> None:
        self.server = server
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None  # the settle wait
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if len(self.server.live) >= self.server.max_connections:
            transport.close()  # (HAProxy's next check comes within agent-inter)
            return
        self.transport = transport  # type: ignore[assignment]
        self.server.live.add(self)
        # the connection's whole life, whatever arrives (never re-armed)
        self.deadline = asyncio.get_running_loop().call_later(
            self.server.read_timeout, self._answer
        )

    def _arm(self, delay: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(delay, self._answer)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if b"\n" in self.buf or len(self.buf) >= self.MAX_LINE:
            self._answer()
        else:
            self._arm(self.SETTLE)

    def _answer(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        line = self.buf.split(b"\n", 1)[0][: self.MAX_LINE]
        if line.strip():
            try:
                transport.write(reply(self.server.answer, line))
                observer, path = self.server.observer, neg_path(line.decode("ascii", "replace"))
                if observer is not None and path is not None:
                    peer = transport.get_extra_info("peername")
                    observer(instance_of(line, str(peer[0]) if peer else "haproxy"), path)
            except Exception:  # an answer must never take the agent down
                log.exception("agent answer failed for %r", line[:80])
                transport.write(b"maint\n")
        transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.deadline is not None:
            self.deadline.cancel()
        self.server.live.discard(self)
        self.transport = None


class AgentServer:
    def __init__(
        self,
        answer: Answer,
        host: str,
        port: int,
        read_timeout: float = 5.0,
        max_connections: int = 1024,
    ) -> None:
        self.answer = answer
        self.host, self.port = host, port
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self.live: set[_AgentConnection] = set()
        self._server: asyncio.Server | None = None
        # told (instance, NEG path) after each answer (SPEC §11: receipts)
        self.observer: Callable[[str, str], None] | None = None

    def _accept(self) -> asyncio.Protocol:
        return _AgentConnection(self)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, self.host, self.port)
        if self.port == 0:
            self.port = self._server.sockets[0].getsockname()[1]
        log.info("HAProxy agent-check answering on %s:%d", self.host, self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self.live):
                if conn.transport is not None:
                    conn.transport.abort()
            await self._server.wait_closed()
