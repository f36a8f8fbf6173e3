"""The scheduler in virtual time: a clock that jumps to the next timer, and a
scripted batch prober whose probes last what the script says. No sockets,
no sleeping; exact instants asserted (to the scheduler's tick)."""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Hashable

import pytest

from healthgate.health.states import Outcome, ProbeResult
from healthgate.health.windows import failure_window
from healthgate.probes.prober import Prober
from healthgate.probes.scheduler import ProbeScheduler, SchedulerSettings
from healthgate.probes.spec import ProbeSpec

OK = ProbeResult(Outcome.OK, 0.0)


class _Handle:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class VirtualClock:
    """``time()`` and ``call_at()``, run in time order by :meth:`run_until`."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[tuple[float, int, Callable[[], object], _Handle]] = []
        self._seq = itertools.count()

    def time(self) -> float:
        return self.now

    def wall(self, t: float) -> float:
        return t  # (virtual time is its own wall clock)

    def call_at(self, when: float, callback: Callable[[], object]) -> _Handle:
        handle = _Handle()
        heapq.heappush(self._timers, (when, next(self._seq), callback, handle))
        return handle

    def run_until(self, end: float, max_callbacks: int = 1_000_000) -> None:
        for _ in range(max_callbacks):
            if not self._timers or self._timers[0][0] > end:
                break
            when, _, callback, handle = heapq.heappop(self._timers)
            if not handle.cancelled:
                self.now = max(self.now, when)
                callback()
        self.now = end


Script = Callable[[Hashable, float], tuple[float, ProbeResult]]  # (duration, result)


class ScriptedBatch:
    """Stands in for the batch prober: a probe started at t ends at
    t + duration (at most the timeout, then as a TIMEOUT)."""

    backlog = False

    def __init__(self, script: Script) -> None:
        self.script = script
        self.flying: dict[Hashable, tuple[float, ProbeResult]] = {}
        self.starts: dict[Hashable, list[float]] = {}

    @staticmethod
    def handles(spec: ProbeSpec) -> bool:
        return True

    @property
    def in_flight(self) -> int:
        return len(self.flying)

    def start(self, key: Hashable, spec: ProbeSpec, now: float) -> ProbeResult | None:
        assert key not in self.flying, "probes of one endpoint overlap"
        self.starts.setdefault(key, []).append(now)
        duration, result = self.script(key, now)
        if duration == 0:  # known at once (a loopback connect completes inside the call)
            return result
        if duration >= spec.timeout:
            duration, result = spec.timeout, ProbeResult(Outcome.TIMEOUT, spec.timeout)
        self.flying[key] = (now + duration, result._replace(latency=duration))
        return None

    def poll(self, now: float, until: float = float("inf")) -> list[tuple[Hashable, ProbeResult]]:
        ended = [(k, r) for k, (t, r) in self.flying.items() if t <= now]
        for k, _ in ended:
            del self.flying[k]
        return ended

    def cancel(self, key: Hashable) -> None:
        self.flying.pop(key, None)

    def close(self) -> None:
        return None


def scheduler(
    script: Script, sink: Callable[[float, list[tuple[Hashable, ProbeResult]]], None]
) -> tuple[ProbeScheduler, ScriptedBatch, VirtualClock]:
    batch = ScriptedBatch(script)
    clock = VirtualClock()
    sched = ProbeScheduler(
        Prober(),
        sink,
        SchedulerSettings(),
        rng=random.Random(7),
        batch=batch,  # type: ignore[arg-type]
        clock=clock,
    )
    sched.start()
    return sched, batch, clock


@pytest.mark.parametrize(("interval", "duration"), [(2.0, 0.5), (1.0, 0.02), (5.0, 1.3)])
def test_the_interval_runs_from_the_end_of_one_probe_to_the_start_of_the_next(
    interval: float, duration: float
) -> None:
    sched, batch, clock = scheduler(lambda _k, _t: (duration, OK), lambda *_: None)
    for key in range(20):
        sched.upsert(key, ProbeSpec("TCP", "127.0.0.1", 1, timeout=3.0, interval=interval))
    clock.run_until(60.0)
    tick = sched.tick
    for probed, starts in batch.starts.items():
        assert starts[0] <= interval + tick, "first probes are spread over the first interval"
        gaps = [b - a for a, b in itertools.pairwise(starts)]
        assert len(gaps) >= int(50 / (interval + duration)) - 1, probed
        for gap in gaps:
            # the end is seen at the next tick (response times to one tick),
            # the start within half a tick of due
            assert interval + duration - tick / 2 <= gap <= interval + duration + 1.5 * tick, gap


def test_the_seeds_failure_window_in_virtual_time() -> None:
    """timeout 3, interval 2, threshold 3: from the first failing probe's
    start to the third failure's end, 3x3 + 2x2 = 13 s (to the tick)."""
    broken_at = 20.0
    ends: list[tuple[float, Outcome]] = []

    def script(_key: Hashable, now: float) -> tuple[float, ProbeResult]:
        return (3600.0, OK) if now >= broken_at else (0.01, OK)  # then: hangs

    def sink(end: float, results: list[tuple[Hashable, ProbeResult]]) -> None:
        ends.extend((end, r.outcome) for _, r in results)

    sched, batch, clock = scheduler(script, sink)
    sched.upsert("ep", ProbeSpec("HTTP", "127.0.0.1", 1, timeout=3.0, interval=2.0))
    clock.run_until(60.0)
    first_failing_start = min(t for t in batch.starts["ep"] if t >= broken_at)
    third_timeout_end = [t for t, o in ends if o is Outcome.TIMEOUT][2]
    window = failure_window(3.0, 2.0, 3)
    assert window == 13.0
    assert third_timeout_end - first_failing_start == pytest.approx(window, abs=2 * sched.tick)
    # every result counted as it ended, by outcome (the metrics' histogram)
    totals = sched.totals(sched.prober)
    counted = {o: sum(c) for o, c in totals.buckets.items()}
    assert counted == {o: sum(1 for _, got in ends if got is o) for o in counted}
    assert totals.finished == len(ends)


def test_a_removed_key_is_never_probed_again() -> None:
    sched, batch, clock = scheduler(lambda _k, _t: (0.1, OK), lambda *_: None)
    spec = ProbeSpec("TCP", "127.0.0.1", 1, timeout=1.0, interval=1.0)
    sched.upsert("a", spec)
    sched.upsert("b", spec)
    clock.run_until(10.0)
    sched.remove("a")
    count = len(batch.starts["a"])
    clock.run_until(20.0)
    assert len(batch.starts["a"]) == count
    assert len(batch.starts["b"]) >= 17


def test_results_known_at_the_start_end_together_and_free_their_place() -> None:
    """A probe whose result the batch gives as it starts (a loopback connect)
    ends in the same tick, with the others of that tick in one sink call, and
    frees its place in flight at once: with room for 3, all 40 keys of a tick
    still start on time, every interval."""
    calls: list[int] = []
    sched, batch, clock = scheduler(lambda _k, _t: (0.0, OK), lambda _e, r: calls.append(len(r)))
    sched.max_in_flight = 3
    for key in range(40):
        sched.upsert(key, ProbeSpec("TCP", "127.0.0.1", 1, timeout=1.0, interval=1.0))
    clock.run_until(30.5)
    assert sum(calls) == sum(len(v) for v in batch.starts.values())
    for probed, starts in batch.starts.items():
        assert len(starts) >= 29, probed
        for gap in itertools.pairwise(starts):
            assert 1.0 - sched.tick / 2 <= gap[1] - gap[0] <= 1.0 + 1.5 * sched.tick, gap
    assert max(calls) > 1 and len(calls) < sum(calls)  # together, not one call each
    assert sched.in_flight == 0 and not sched._waiting
