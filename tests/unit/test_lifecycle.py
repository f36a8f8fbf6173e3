"""The stop's mechanics (runtime/lifecycle.py), in one process: bounded
steps, a stop requested during start-up, and the load generator's loop
(whose lost cancellation once kept `healthgate demo` from stopping)."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest
import uvloop

from healthgate.runtime.demo import LoadGenerator
from healthgate.runtime.lifecycle import Stopper, StopStep, run_steps


def test_a_step_that_overruns_is_abandoned_and_the_next_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[str] = []

    async def hangs() -> None:
        ran.append("hangs")
        await asyncio.Event().wait()

    async def fails() -> None:
        ran.append("fails")
        raise RuntimeError("broken")

    async def last() -> None:
        ran.append("last")

    async def main() -> None:
        await run_steps(
            [StopStep("hanging", hangs, 0.05), StopStep("failing", fails), StopStep("last", last)]
        )

    with caplog.at_level(logging.INFO, "healthgate.lifecycle"):
        asyncio.run(main())
    assert ran == ["hangs", "fails", "last"]
    text = caplog.text
    assert "hanging did not finish within 0.05 s; going on" in text
    assert "failing failed; going on" in text
    assert "stopped in" in text


def test_a_stop_requested_during_start_up_interrupts_it_and_stops() -> None:
    events: list[str] = []
    stopper = Stopper("test")

    async def start() -> None:
        events.append("starting")
        stopper.request()  # as the signal handler does
        await asyncio.sleep(10)
        events.append("started")  # never: the start is interrupted

    async def stop() -> None:
        events.append("stopped")

    async def main() -> None:
        async with asyncio.timeout(5):
            await stopper.run(start, stop)

    asyncio.run(main())
    assert events == ["starting", "stopped"]


def test_a_start_that_fails_still_stops_what_it_started() -> None:
    events: list[str] = []

    async def start() -> None:
        events.append("starting")
        raise OSError("address in use")

    async def stop() -> None:
        events.append("stopped")

    with pytest.raises(OSError, match="address in use"):
        asyncio.run(Stopper("test").run(start, stop))
    assert events == ["starting", "stopped"]


def test_the_load_generator_stops_whenever_it_is_cancelled() -> None:
    """Cancelled at random moments against a server that answers at once:
    with ``asyncio.wait_for`` around its read, about a third of these
    cancellations were lost (the read completed in the same iteration) and
    the generator ran on for ever."""

    async def main() -> int:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nregion=x\n")
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        rng = random.Random(7)
        lost = 0
        for _ in range(150):
            task = asyncio.create_task(LoadGenerator(port, 2000.0).run())
            await asyncio.sleep(rng.uniform(0.002, 0.02))
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=1.0)
            if not done:
                lost += 1
                task.cancel()
                await asyncio.wait([task], timeout=1.0)
        server.close()
        return lost

    assert uvloop.run(main()) == 0  # (the event loop serve and the demo run on)
