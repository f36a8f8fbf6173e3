"""One supervisor for every worker pool (process/supervisor.py), with real
worker processes: a worker that stops reading is replaced and never blocks
the event loop; a worker that dies is started again after a backoff; a
frame a reader does not take is refused before it is read."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest

from healthgate.controlplane.probe_workers import Probe, ProbePool, Totals
from healthgate.health.engine import HealthEngine
from healthgate.health.states import HealthState
from healthgate.probes.prober import ProbeSettings
from healthgate.probes.scheduler import SchedulerSettings
from healthgate.process.frames import FrameTooLarge, encode, expect, read_frame
from tests.helpers import example_world, resources, run_async


def pool_of(count: int) -> ProbePool:
    return ProbePool(
        count,
        ProbeSettings(),
        SchedulerSettings(),
        lambda d: None,
        lambda: (),
        lambda slot: (HealthState.UNKNOWN, 0.0),
    )


async def until(predicate: object, timeout: float, what: str) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():  # type: ignore[operator]
            await asyncio.sleep(0.05)


def test_a_worker_that_stops_reading_is_replaced_and_never_blocks_the_loop() -> None:
    engine = HealthEngine()
    engine.apply(resources(example_world()), 0.0)
    targets = list(engine.targets())
    paths = [f"{t.backend_service}/endpoints/{t.ip}:{t.port}" for t in targets]

    async def go() -> tuple[float, int, int]:
        pool = pool_of(1)
        pool.supervisor.max_backlog = 1 << 20  # 1 MiB unread: a worker that stopped reading
        await pool.start()
        first = pool.pids()[0]
        # it answers: totals every second
        await until(lambda: 0 in pool._totals, 15, "the worker's first totals")
        os.kill(first, signal.SIGSTOP)  # it reads nothing from now on
        try:
            loop = asyncio.get_running_loop()
            worst = 0.0
            for _ in range(4000):  # more than the pipe and the backlog hold
                t = loop.time()
                pool.change(targets, paths)  # (each endpoint stopped, and probed again)
                worst = max(worst, loop.time() - t)
                await asyncio.sleep(0)
                if pool.pids() and pool.pids()[0] != first:
                    break
            await until(lambda: pool.pids() and pool.pids()[0] != first, 15, "a new worker")
        finally:
            with contextlib.suppress(ProcessLookupError):  # (killed and reaped: as it should)
                os.kill(first, signal.SIGCONT)
        second = pool.pids()[0]
        await until(lambda: pool.supervisor.workers[0].restarts == 1, 5, "one restart counted")
        await pool.close()
        return worst, first, second

    worst, first, second = run_async(go(), timeout=60)
    assert second != first
    assert worst < 0.05, f"a send to a stopped worker held the loop {worst * 1000:.0f} ms"
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)  # (killed, and reaped)


def test_a_dead_worker_is_started_again_with_a_growing_backoff() -> None:
    async def go() -> list[float]:
        pool = pool_of(1)
        await pool.start()
        starts = []
        for _ in range(3):
            pid = pool.pids()[0]
            os.kill(pid, signal.SIGKILL)
            died = time.monotonic()
            await until(lambda p=pid: pool.pids() and pool.pids()[0] != p, 20, "a restart")
            starts.append(time.monotonic() - died)
        await pool.close()
        return starts

    delays = run_async(go(), timeout=60)
    # 1 s, then 2 s, then 4 s (each worker died young)
    assert delays[0] >= 0.9 and delays[1] >= 1.9 and delays[2] >= 3.9, delays
    assert delays[2] < 10, delays


def test_frames_over_the_limit_or_of_the_wrong_type_are_refused() -> None:
    async def go() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(encode(Probe({}, [], [])))
        reader.feed_eof()
        with pytest.raises(FrameTooLarge):
            await read_frame(reader, limit=10)

        reader = asyncio.StreamReader()
        reader.feed_data(encode(Probe({}, [], [])))
        reader.feed_eof()
        message = await read_frame(reader)
        assert expect(message, Totals) is None  # logged and dropped
        assert await read_frame(reader) is None  # the end of the stream

    run_async(go(), timeout=10)


def test_a_worker_never_imports_code_from_the_working_directory(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever serve's working directory holds - a package named like one
    a worker imports - the worker imports the installed code."""
    from pathlib import Path

    planted = Path(str(tmp_path)) / "planted"
    marker = Path(str(tmp_path)) / "ran"
    for name in ("healthgate", "uvloop"):
        (planted / name).mkdir(parents=True)
        (planted / name / "__init__.py").write_text(
            f"open({str(marker)!r}, 'a').write({name!r})\nraise SystemExit(3)\n"
        )
    monkeypatch.chdir(planted)

    async def go() -> None:
        pool = pool_of(1)
        await pool.start()
        try:
            await until(lambda: 0 in pool._totals, 15, "the worker's first totals")
        finally:
            await pool.close()

    run_async(go())
    assert not marker.exists()
