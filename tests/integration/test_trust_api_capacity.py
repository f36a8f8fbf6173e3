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
    tokens.write_text(yaml.safe_dump([VIEWER]))
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
