"""The API's own bounds, on a real `Server` in this process: a request head
that never completes is cut off; the API keeps answering meanwhile."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from healthgate.api.state import ApiSettings
from healthgate.runtime.server import Server, ServeSettings
from tests.helpers import run_async


def test_a_slow_request_head_is_cut_off_and_the_api_keeps_answering(tmp_path: Path) -> None:
    async def go() -> tuple[bytes, float, int]:
        settings = ServeSettings(
            db=str(tmp_path / "hg.db"), listen="127.0.0.1:0", api=ApiSettings(head_timeout=0.5)
        )
        settings.dataplane = settings.dataplane.__class__(enabled=False)
        server = Server(settings)
        await server.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            started = time.monotonic()
            async with httpx.AsyncClient(base_url=server.url) as client:
                ok = (await client.get("/healthz")).status_code
            data = await asyncio.wait_for(reader.read(), 10)
            return data, time.monotonic() - started, ok
        finally:
            await server.stop()

    data, took, ok = run_async(go(), timeout=30)
    assert ok == 200
    assert data == b"" and took < 3, (data, took)


@pytest.mark.serial  # (the stop is timed: alone on the machine, tests/conftest.py)
def test_stopping_with_event_streams_open_ends_them_at_once(tmp_path: Path) -> None:
    async def go() -> tuple[float, str]:
        settings = ServeSettings(db=str(tmp_path / "hg.db"), listen="127.0.0.1:0")
        settings.dataplane = settings.dataplane.__class__(enabled=False)
        server = Server(settings)
        await server.start()
        received: list[str] = []
        opened = asyncio.Event()

        async def follow() -> None:
            async with (
                httpx.AsyncClient(base_url=server.url, timeout=10) as client,
                client.stream("GET", "/v1/projects/p/events/stream") as resp,
            ):
                async for line in resp.aiter_lines():
                    opened.set()
                    received.append(line)

        reader = asyncio.create_task(follow())
        await asyncio.wait_for(opened.wait(), 10)
        started = time.monotonic()
        await server.stop()
        took = time.monotonic() - started
        await asyncio.wait_for(reader, 10)
        return took, "\n".join(received)

    took, text = run_async(go(), timeout=30)
    assert "event: end" in text and "reconnect with Last-Event-ID" in text
    assert took < 1.5, took  # (uvicorn's graceful shutdown would wait 2 s, then cancel)
