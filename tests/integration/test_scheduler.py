"""The scheduler in real time: windows, no overlap, spreading, changes, lag."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Hashable
from typing import Any

import pytest

from healthgate.controlplane.health_service import HealthService, RecordsTo
from healthgate.health.states import HealthState, Outcome, ProbeResult, Record, Transition
from healthgate.health.windows import failure_window, success_window
from healthgate.probes.clock import LoopClock
from healthgate.probes.prober import Prober
from healthgate.probes.scheduler import ProbeScheduler, SchedulerSettings
from healthgate.probes.spec import ProbeSpec
from tests.helpers import resources, run_async
from tests.integration.servers import Server

TOLERANCE = 0.15  # seconds; real time on a noisy 2-core machine


class Switchable:
    """An HTTP endpoint whose behaviour the test switches: ok, hang, or slow ok."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.delay = 0.0
        self.starts: list[float] = []  # loop time of each probe's arrival
        self.served: list[tuple[float, str]] = []  # (arrival, what that probe got)
        self.ends: list[float] = []
        self.open = 0
        self.max_open = 0

    async def handler(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.starts.append(start)
        self.open += 1
        self.max_open = max(self.max_open, self.open)
        try:
            await reader.readuntil(b"\r\n\r\n")
            self.served.append((start, f"{self.mode}/{self.delay}"))
            if self.mode == "hang":
                await reader.read(1)  # until the prober gives up and closes
                return
            if self.delay:
                await asyncio.sleep(self.delay)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await reader.read(1)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open -= 1
            self.ends.append(loop.time())
            writer.close()


def world(port: int, timeout: int, interval: int, threshold: int) -> list[Any]:
    return resources(
        [
            {
                "kind": "HealthCheck",
                "project": "p",
                "region": "r",
                "name": "hc",
                "type": "HTTP",
                "port": port,
                "timeoutSec": timeout,
                "checkIntervalSec": interval,
                "healthyThreshold": threshold,
                "unhealthyThreshold": threshold,
            },
            {
                "kind": "NetworkEndpointGroup",
                "project": "p",
                "region": "r",
                "name": "neg",
                "networkEndpointType": "GCE_VM_IP",
                "endpoints": [{"ipAddress": "127.0.0.1"}],
            },
            {
                "kind": "BackendService",
                "project": "p",
                "region": "r",
                "name": "bs",
                "loadBalancingScheme": "INTERNAL",
                "healthChecks": ["hc"],
                "backends": [{"group": "neg"}],
            },
        ]
    )


def test_real_time_windows_match_the_formula_and_probes_never_overlap() -> None:
    """timeout 1, interval 1, threshold 2: failure window 3 s; success window at
    0.2 s responses 1.4 s - measured from the first failing/passing probe's start."""

    async def go() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        ep = Switchable()
        async with Server(ep.handler) as srv:
            service = HealthService(clock=loop.time)
            wall = LoopClock(loop).wall  # (records carry the wall-clock time of the loop's)
            changes: list[Transition] = []
            became: dict[HealthState, asyncio.Event] = {s: asyncio.Event() for s in HealthState}

            def on_records(records: list[Record]) -> None:
                for r in records:
                    if isinstance(r, Transition) and r.kind == "Endpoint":
                        changes.append(r)
                        became[r.current].set()

            service.listen(RecordsTo(on_records))
            await service.start()
            service.apply(world(srv.port, timeout=1, interval=1, threshold=2))
            await asyncio.wait_for(became[HealthState.HEALTHY].wait(), 10)
            became[HealthState.HEALTHY].clear()

            ep.mode = "hang"
            t_hang = loop.time()
            await asyncio.wait_for(became[HealthState.UNHEALTHY].wait(), 10)
            first_failing = next(t for t, got in ep.served if got.startswith("hang"))
            fail_window = changes[-1].time - wall(first_failing)

            ep.mode, ep.delay = "ok", 0.2
            await asyncio.wait_for(became[HealthState.HEALTHY].wait(), 10)
            first_passing = next(t for t, got in ep.served if got == "ok/0.2")
            ok_window = changes[-1].time - wall(first_passing)
            await service.close()
            gaps = [b - a for a, b in zip(ep.ends, ep.starts[1:], strict=False)]
            return {
                "fail": fail_window,
                "ok": ok_window,
                "max_open": ep.max_open,
                "min_gap": min(gaps),
                "suspect": service.totals().suspect,
                "starts": [round(t - t_hang, 3) for t in ep.starts[-10:]],
                "changes": [(round(c.time - wall(t_hang), 3), c.current.name) for c in changes],
            }

    got = run_async(go())
    assert abs(got["fail"] - failure_window(1, 1, 2)) < TOLERANCE, got
    assert abs(got["ok"] - success_window(0.2, 1, 2)) < TOLERANCE, got
    assert got["max_open"] == 1  # never two probes of one endpoint at once
    assert got["min_gap"] > 1 - TOLERANCE  # the interval runs from the end of a probe


class FakeProber(Prober):
    """No sockets: answers after `delay` with `outcome`, and records calls."""

    def __init__(self, delay: float = 0.0, outcome: Outcome = Outcome.OK) -> None:
        super().__init__()
        self.delay = delay
        self.outcome = outcome
        self.calls: list[tuple[Hashable, float]] = []
        self.running = 0
        self.max_running = 0

    async def probe(self, spec: ProbeSpec, key: Any = None) -> ProbeResult:
        self.calls.append((key, asyncio.get_running_loop().time()))
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.running -= 1
        return ProbeResult(self.outcome, self.delay)


def spec(interval: float = 1.0, port: int = 1) -> ProbeSpec:
    return ProbeSpec("TCP", "127.0.0.1", port, timeout=1.0, interval=interval)


def test_first_probes_are_spread_over_the_first_interval() -> None:
    async def go() -> list[float]:
        prober = FakeProber()
        sched = ProbeScheduler(prober, lambda *a: None, rng=random.Random(7))
        sched.start()
        t0 = asyncio.get_running_loop().time()
        for k in range(500):
            sched.upsert(k, spec(interval=1.0))
        await asyncio.sleep(1.05)
        await sched.close()
        return [t - t0 for _, t in prober.calls]

    starts = run_async(go())
    firsts = starts[:500]
    assert len(firsts) == 500
    buckets = [sum(1 for t in firsts if i / 10 <= t < (i + 1) / 10) for i in range(10)]
    assert max(buckets) < 100, buckets  # ~50 per 100 ms bucket, never a thundering herd


def test_changes_and_removals_take_effect_without_touching_others() -> None:
    async def go() -> tuple[dict[Hashable, int], int]:
        prober = FakeProber()
        results: dict[Hashable, int] = {}
        sched = ProbeScheduler(
            prober,
            lambda t, ended: results.update((k, results.get(k, 0) + 1) for k, _ in ended),
            rng=random.Random(1),
        )
        sched.start()
        for k in ("a", "b", "c"):
            sched.upsert(k, spec(interval=0.1))
        await asyncio.sleep(0.35)
        sched.remove("b")
        sched.upsert("c", spec(interval=0.1, port=2))  # changed: re-armed
        sched.upsert("a", spec(interval=0.1))  # unchanged: nothing happens
        before_b = results.get("b", 0)
        await asyncio.sleep(0.35)
        await sched.close()
        return results, before_b

    results, before_b = run_async(go())
    assert results["b"] == before_b  # removed: no more results
    assert results["a"] >= 5 and results["c"] >= 4


def test_concurrency_cap_delays_but_never_drops() -> None:
    async def go() -> tuple[int, int, int]:
        prober = FakeProber(delay=0.05)
        done: list[Hashable] = []
        sched = ProbeScheduler(
            prober,
            lambda t, ended: done.extend(k for k, _ in ended),
            SchedulerSettings(max_in_flight=5),
            rng=random.Random(2),
        )
        sched.start()
        for k in range(40):  # all due within 0.1 s; 5 at a time of 50 ms each need 0.4 s
            sched.upsert(k, spec(interval=0.1))
        await asyncio.sleep(0.8)
        await sched.close()
        return prober.max_running, len(set(done)), sched.stats.late_starts

    max_running, distinct, late = run_async(go())
    assert max_running == 5
    assert distinct == 40  # every endpoint got its first probe
    assert late > 0  # and the ones that waited are counted as late


def test_timeouts_during_prober_lag_are_suspect_not_failures() -> None:
    async def go() -> tuple[list[ProbeResult], int]:
        prober = FakeProber(delay=0.3, outcome=Outcome.TIMEOUT)
        got: list[ProbeResult] = []
        sched = ProbeScheduler(
            prober,
            lambda t, ended: got.extend(r for _, r in ended),
            SchedulerSettings(lag_threshold=0.1),
            rng=random.Random(3),
        )
        sched.start()
        sched.upsert("x", spec(interval=0.05))
        await asyncio.sleep(0.15)
        time.sleep(0.5)  # the prober's own event loop stalls (deliberately blocking)
        await asyncio.sleep(0.6)
        await sched.close()
        return got, sched.stats.suspect

    got, suspect = run_async(go())
    assert suspect >= 1
    assert any(r.outcome is Outcome.SUSPECT and r.detail == "prober overloaded" for r in got)
    assert got[-1].outcome is Outcome.TIMEOUT  # once the lag is over, timeouts count again


def test_a_stall_that_makes_many_timeouts_suspect_logs_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One stall times out every probe in flight; a line each would flood
    the log (and stall the prober again): one line, with the count."""

    async def go() -> int:
        prober = FakeProber(delay=0.3, outcome=Outcome.TIMEOUT)
        sched = ProbeScheduler(
            prober,
            lambda t, ended: None,
            SchedulerSettings(lag_threshold=0.1),
            rng=random.Random(3),
        )
        sched.start()
        for key in range(20):
            sched.upsert(key, spec(interval=0.05))
        await asyncio.sleep(0.15)
        time.sleep(0.5)  # the prober's own event loop stalls (deliberately blocking)
        await asyncio.sleep(0.2)
        await sched.close()
        return sched.stats.suspect

    with caplog.at_level(logging.WARNING, logger="healthgate.probes"):
        suspect = run_async(go())
    lines = [
        r.getMessage() for r in caplog.records if "while the prober was behind (" in r.getMessage()
    ]
    assert suspect >= 10 and len(lines) == 1, (suspect, lines)
    assert "(its loop lagged " in lines[0] and "more such since the last line" in lines[0]
