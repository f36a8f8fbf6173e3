"""The API's capacity shared fairly (SPEC §7), in-process over real
sockets and over ASGI: event streams per principal, room kept for health
answers, connections per source address - and no token in a URL."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import httpx
import yaml

from healthgate.api.capacity import RequestCapacity, SourceConnections, is_health_path
from tests.helpers import run_async
from tests.integration.serve_proc import ServeProcess

VIEWER = {"token": "v" * 24, "project": "shop", "role": "viewer"}


def open_stream(port: int, token: str) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(
        f"GET /v1/projects/shop/events/stream HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {token}\r\n\r\n".encode()
    )
    answer = sock.recv(4096)
    if answer.startswith(b"HTTP/1.1 4") and b"\r\n\r\n" in answer and answer.endswith(b"\r\n\r\n"):
        answer += sock.recv(4096)  # (an error's body)
    return sock, answer


def test_event_streams_are_capped_per_principal_and_not_taken_from_a_url(
    tmp_path: Path,
) -> None:
    tokens = tmp_path / "tokens.yaml"
    other = {**VIEWER, "token": "w" * 24}  # another viewer of the same project
    tokens.write_text(yaml.safe_dump([VIEWER, other]))
    tokens.chmod(0o600)
    with ServeProcess(tmp_path / "s.db", "--tokens", str(tokens)) as s:
        opened = []
        try:
            for _ in range(32):  # as many as one token may hold (the default)
                sock, first = open_stream(s.port, VIEWER["token"])
                assert first.startswith(b"HTTP/1.1 200"), first[:100]
                opened.append(sock)
            sock, first = open_stream(s.port, VIEWER["token"])
            opened.append(sock)
            assert first.startswith(b"HTTP/1.1 429"), first[:200]
            assert b"32 event streams open" in first
            # the cap is the token's, not its role's: another viewer still gets one
            sock, first = open_stream(s.port, other["token"])
            opened.append(sock)
            assert first.startswith(b"HTTP/1.1 200"), first[:200]
            with s.client() as anonymous:  # a token in the URL is not a token
                url = f"/v1/projects/shop/events/stream?access_token={VIEWER['token']}"
                assert anonymous.get(url).status_code == 401
            with s.client(VIEWER["token"]) as viewer:  # and other reads still go through
                assert viewer.get("/v1/projects/shop/events").status_code == 200
        finally:
            for sock in opened:
                sock.close()


def test_one_source_address_cannot_take_the_apis_connections(tmp_path: Path) -> None:
    with ServeProcess(tmp_path / "c.db") as s:
        held = []
        try:
            for _ in range(256):  # one address's share (the default)
                held.append(
                    socket.create_connection(("127.0.0.1", s.port), source_address=("127.0.0.9", 0))
                )
            extra = socket.create_connection(("127.0.0.1", s.port), source_address=("127.0.0.9", 0))
            extra.settimeout(5)
            assert extra.recv(100) == b""  # closed at once
            extra.close()
            with s.client() as api:  # another address is served
                assert api.get("/healthz").status_code == 200
        finally:
            for sock in held:
                sock.close()


def test_health_answers_keep_their_room_when_everything_else_is_full() -> None:
    """Requests in flight at the cap: a health check still gets through,
    anything else gets 503."""
    gate = asyncio.Event()

    async def slow(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/slow":
            await gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def go() -> tuple[int, int, int]:
        app = RequestCapacity(slow, max_requests=4, reserved=2)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x")
        hogs = [asyncio.create_task(client.get("/slow")) for _ in range(4)]
        for _ in range(100):
            if app.in_flight == 4:
                break
            await asyncio.sleep(0.01)
        other = (await client.get("/v1/projects/p/regions/r/healthChecks")).status_code
        health = (await client.get("/healthz")).status_code
        rule = (await client.get("/v1/projects/p/regions/r/forwardingRules/f/healthz")).status_code
        gate.set()
        await asyncio.gather(*hogs)
        await client.aclose()
        return other, health, rule

    other, health, rule = run_async(go(), timeout=20)
    assert (other, health, rule) == (503, 200, 200)
    assert is_health_path("/readyz") and not is_health_path("/v1/apply")


def test_one_source_holds_at_most_its_share_of_the_apis_connections() -> None:
    sources = SourceConnections(max_per_source=2)
    assert sources.admit("10.0.0.1") and sources.admit("10.0.0.1")
    assert not sources.admit("10.0.0.1")  # its share is taken
    assert sources.admit("10.0.0.2")  # another address is not held back
    sources.release("10.0.0.1")
    assert sources.admit("10.0.0.1")
    assert sources.refused == 1


# ---------------------------------------------------------------- bodies (issue 38)

PRODUCER = {"token": "p" * 24, "project": "shop", "role": "producer"}
OTHER = {"token": "o" * 24, "project": "web", "role": "producer"}


async def raw_request(
    port: int, head: bytes, body: bytes = b""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body)
    await writer.drain()
    return reader, writer  # (the writer kept: dropped, it would close the connection)


def post_head(port: int, path: str, length: int, token: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/yaml\r\n"
        f"Content-Length: {length}\r\n{auth}\r\n"
    ).encode()


async def answer_and_close(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> bytes:
    """What the server sends until it closes (bounded)."""
    async with asyncio.timeout(10):
        data = await conn[0].read()
    conn[1].close()
    return data


def test_a_body_without_a_token_is_refused_before_it_is_read() -> None:
    async def go() -> None:
        from tests.inprocess import InProcessApi

        async with InProcessApi([PRODUCER]) as api:
            port = (await api.listen()).port
            for token, status in ((None, b"401"), ("x" * 24, b"401")):
                conn = await raw_request(port, post_head(port, "/v1/apply", 10_000_000, token))
                got = await answer_and_close(conn)  # (not a byte of the body was sent)
                assert got.startswith(b"HTTP/1.1 " + status), got[:200]
                assert b"connection: close" in got.lower()

    run_async(go())


def test_a_slow_body_gets_408_and_holds_nothing_past_its_deadline() -> None:
    async def go() -> None:
        from healthgate.api.app import ApiSettings
        from tests.inprocess import InProcessApi

        async with InProcessApi([PRODUCER], settings=ApiSettings(body_timeout=0.5)) as api:
            port = (await api.listen()).port
            conn = await raw_request(
                port, post_head(port, "/v1/apply", 1000, PRODUCER["token"]), b"kind: Heal"
            )
            got = await answer_and_close(conn)
            assert got.startswith(b"HTTP/1.1 408"), got[:200]
            assert b"did not arrive within 0.5 s" in got

    run_async(go())


def test_slow_manifests_of_one_token_do_not_hold_another_tenants_apply() -> None:
    """Two manifests of one producer whose bodies never arrive: another
    producer's apply is answered at once (the slots are taken after the
    body has come, and one token holds one of them at most)."""

    async def go() -> None:
        from healthgate.api.app import ApiSettings
        from tests.inprocess import InProcessApi

        settings = ApiSettings(manifest_wait=2.0)
        async with InProcessApi([PRODUCER, OTHER], settings=settings) as api:
            port = (await api.listen()).port
            stalled = [
                await raw_request(
                    port, post_head(port, "/v1/apply", 100_000, PRODUCER["token"]), b"kind"
                )
                for _ in range(2)
            ]
            manifest = yaml.safe_dump(
                {"kind": "HealthCheck", "project": "web", "region": "r1", "name": "hc",
                 "type": "TCP", "port": 80}
            )  # fmt: skip
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                loop = asyncio.get_running_loop()
                started = loop.time()
                r = await client.post(
                    "/v1/apply",
                    content=manifest,
                    headers={
                        "Content-Type": "application/yaml",
                        "Authorization": f"Bearer {OTHER['token']}",
                    },
                )
                assert r.status_code == 200, r.text
                assert loop.time() - started < 1.5  # (not after manifest_wait)
            assert len(stalled) == 2

    run_async(go())


def test_a_flood_of_connections_leaves_the_health_answers_reachable() -> None:
    """More connections than the API may hold, each holding its head back:
    a health check still gets its answer (the connection that waited
    longest gives up its place), and so does any other request."""

    async def go() -> None:
        from healthgate.api.app import ApiSettings
        from tests.inprocess import InProcessApi

        settings = ApiSettings(max_connections=10, reserved_for_health=4, max_per_source=1000)
        async with InProcessApi(settings=settings) as api:
            port = (await api.listen()).port
            flood = []
            for i in range(30):
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, local_addr=(f"127.0.1.{i + 1}", 0)
                )
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never finished
                await writer.drain()
                flood.append((reader, writer))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                assert (await client.get("/healthz")).status_code == 200
                assert (await client.get("/v1/projects")).status_code == 200
            # the oldest of the flood were closed to make room
            async with asyncio.timeout(10):
                assert await flood[0][0].read() == b""
            for _, writer in flood:
                writer.close()

    run_async(go())


def test_open_connections_keep_room_for_health_answers_when_all_are_busy() -> None:
    from healthgate.api.capacity import OpenConnections, is_health_request_line

    class Conn:
        def __init__(self, waiting: bool) -> None:
            self.is_waiting = waiting
            self.evicted = False

        def waiting(self) -> bool:
            return self.is_waiting

        def evict(self) -> None:
            self.evicted = True

    pool = OpenConnections(max_connections=2, reserved=1)
    a, b, c = Conn(False), Conn(False), Conn(False)
    assert [pool.admit(x) for x in (a, b)] == [True, True]
    assert pool.admit(c) is False  # every one busy: the reserve, a health answer's only
    assert pool.admit(Conn(False)) is None  # no room left at all
    pool.release(a)
    pool.release(c)
    idle = Conn(True)
    assert pool.admit(idle) is True
    newer = Conn(True)
    assert pool.admit(newer) is True  # full: the one waiting longest gives way
    assert idle.evicted and pool.evicted == 1 and pool.open == 2
    assert is_health_request_line(b"GET /healthz HTTP/1.1")
    assert is_health_request_line(
        b"GET /v1/projects/p/regions/r/forwardingRules/f/healthz?x HTTP/1.1"
    )
    assert not is_health_request_line(b"POST /healthz HTTP/1.1")
    assert not is_health_request_line(b"GET /v1/projects HTTP/1.1")
