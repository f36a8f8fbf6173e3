"""How the scheduler places a key's next probe (pure arithmetic, no loop)."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from healthgate.health.states import Outcome, ProbeResult
from healthgate.probes.prober import Prober
from healthgate.probes.scheduler import ProbeScheduler, _Entry
from healthgate.probes.spec import ProbeSpec

SPEC = ProbeSpec("TCP", "127.0.0.1", 1, timeout=1.0, interval=1.0)


@pytest.mark.parametrize(
    ("due", "started", "end", "expected"),
    [
        (10.0, 10.0, 10.2, 11.2),  # on time: interval after the end
        (10.0, 10.05, 10.2, 11.15),  # 50 ms late: back in its phase next time
        (10.0, 9.995, 10.2, 11.205),  # started 5 ms early (half a tick): 5 ms later next time
        (10.0, 10.4, 10.6, 11.2),  # 400 ms late (under half an interval): phase kept
    ],
)
def test_next_due_keeps_each_key_in_its_phase(
    due: float, started: float, end: float, expected: float
) -> None:
    sched = ProbeScheduler(Prober(), lambda *a: None, rng=random.Random(0))
    entry = _Entry(SPEC)
    entry.due, entry.started = due, started
    assert sched._next_due(entry, end) == pytest.approx(expected)


def test_after_a_stall_longer_than_half_an_interval_keys_are_spread_again() -> None:
    sched = ProbeScheduler(Prober(), lambda *a: None, rng=random.Random(0))
    nexts = []
    for _ in range(200):
        entry = _Entry(SPEC)
        entry.due, entry.started = 10.0, 10.8  # a 0.8 s stall
        nexts.append(sched._next_due(entry, 11.0))
    assert all(11.0 <= n <= 12.0 for n in nexts)
    assert max(nexts) - min(nexts) > 0.8  # spread over the interval, not one clump


class _FakeLoop:
    """Just the clock and the timer the tick uses."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.timers: list[float] = []

    def time(self) -> float:
        return self.now

    def wall(self, t: float) -> float:
        return t

    def call_at(self, at: float, callback: object) -> _FakeLoop:
        self.timers.append(at)
        return self

    def cancel(self) -> None:  # (the timer handle)
        pass


def test_a_tick_on_a_slot_boundary_arms_the_next_one_a_tick_later() -> None:
    """now / tick for a time on a slot boundary can come out just below the
    whole number (12.35 / 0.01 = 1234.99..); the next tick must still be due
    after now, not at once: that would run tick after tick until the clock
    moved (uvloop's clock moves in whole milliseconds)."""
    sched = ProbeScheduler(Prober(), lambda *a: None, rng=random.Random(0))
    for i in range(1000, 2000):
        now = i * 0.01
        loop = _FakeLoop(now)
        sched._loop = loop
        sched._tick_at = now
        sched._in_flight = 1  # something in flight: tick again one tick later
        sched._tick()
        assert loop.timers, now
        # (a tick of an even number of slots wakes up to one slot early: the
        # half tick it may start early is not a whole number of slots)
        nxt = loop.timers[-1]
        assert now + sched.tick - sched._wheel.res - 1e-9 <= nxt <= now + sched.tick + 1e-9, now


def scheduler_on(loop: _FakeLoop, batch: object, seed: int = 0) -> ProbeScheduler:
    """A scheduler over ``batch`` on the fake ``loop`` (as if started there)."""
    sched = ProbeScheduler(
        Prober(),
        lambda *a: None,
        rng=random.Random(seed),
        batch=batch,  # type: ignore[arg-type]
    )
    sched._loop = loop
    return sched


class _SlowBatch:
    """A batch prober whose every start costs 200 µs of CPU: an overload."""

    backlog = False

    def __init__(self) -> None:
        self.started: list[int] = []

    def handles(self, spec: ProbeSpec) -> bool:
        return True

    @property
    def in_flight(self) -> int:
        return 0  # (results do not matter here)

    def start(self, key: int, spec: ProbeSpec, now: float) -> None:
        end = time.perf_counter() + 0.0002
        while time.perf_counter() < end:
            pass
        self.started.append(key)

    def cancel(self, key: int) -> None:
        pass


def test_an_overloaded_tick_leaves_the_rest_for_the_next_one_due_at_once() -> None:
    """1,000 probes due together at 200 µs each are 200 ms of work: a tick
    does about one tick's worth (10 ms), and the next tick is due at once, so
    the event loop serves everything else in between; every probe still
    starts, once."""
    batch = _SlowBatch()
    loop = _FakeLoop(100.0)
    sched = scheduler_on(loop, batch)
    for key in range(1000):
        sched.upsert(key, SPEC)
        sched._arm(key, sched._entries[key], 100.0)
    per_tick = []
    for _ in range(1000):  # bounded
        before = len(batch.started)
        sched._tick()
        per_tick.append(len(batch.started) - before)
        if len(batch.started) == 1000:
            break
        assert loop.timers[-1] <= loop.now  # the rest is due at once
    assert sorted(batch.started) == list(range(1000))
    assert len(per_tick) > 5  # spread over ticks ...
    assert max(per_tick) < 400  # ... none of them anywhere near the whole 200 ms
    assert sched.stats.deferred_ticks == len(per_tick) - 1


def test_probes_waiting_for_room_start_within_the_ticks_budget_too() -> None:
    """A stall that times out every probe in flight frees room for all the
    probes that waited under the cap at once: 1,000 of them at 200 µs each
    start over several ticks, each within about one tick's budget, oldest
    first, every one once - not in one 200 ms tick."""
    batch = _SlowBatch()
    loop = _FakeLoop(100.0)
    sched = scheduler_on(loop, batch)
    for key in range(1000):
        sched.upsert(key, SPEC)
        entry = sched._entries[key]
        entry.due = -1.0  # (its place on the wheel stale: it waits instead)
        sched._waiting.append((key, entry.generation))
    per_tick = []
    for _ in range(1000):  # bounded
        before = len(batch.started)
        sched._tick()
        per_tick.append(len(batch.started) - before)
        if not sched._waiting:
            break
        assert loop.timers[-1] <= loop.now  # the rest is due at once
    assert batch.started == list(range(1000))  # oldest first, each once
    assert len(per_tick) > 5
    assert max(per_tick) < 400
    assert sched.stats.deferred_ticks == len(per_tick) - 1


class _TimeoutBatch:
    """A batch prober whose probes time out when the test says (``ends``);
    ``backlog``: its last poll left answers unread."""

    def __init__(self) -> None:
        self.backlog = False
        self.running: set[str] = set()
        self.ends: list[str] = []

    def handles(self, spec: ProbeSpec) -> bool:
        return True

    @property
    def in_flight(self) -> int:
        return len(self.running)

    def start(self, key: str, spec: ProbeSpec, now: float) -> None:
        self.running.add(key)

    def poll(self, now: float, until: float) -> list[tuple[str, ProbeResult]]:
        ended, self.ends = self.ends, []
        self.running -= set(ended)
        return [(key, ProbeResult(Outcome.TIMEOUT, 1.0)) for key in ended]

    def cancel(self, key: str) -> None:
        self.running.discard(key)


@pytest.mark.parametrize(
    ("late_start", "lag", "unread", "expected"),
    [
        (0.0, 0.0, 0.0, Outcome.TIMEOUT),
        # started 400 ms late (the prober overloaded): timed from its start,
        # every answer in read before the timeout - evidence
        (0.4, 0.0, 0.0, Outcome.TIMEOUT),
        (0.0, 0.3, 0.0, Outcome.SUSPECT),  # a tick 300 ms late while it ran
        (0.4, 0.1, 0.0, Outcome.TIMEOUT),  # ... 100 ms late: within lag_threshold
        (0.0, 0.0, 0.3, Outcome.SUSPECT),  # ticks left answers unread for 300 ms
        (0.4, 0.0, 0.1, Outcome.TIMEOUT),  # ... for 100 ms: within lag_threshold
    ],
)
def test_a_timeout_is_no_evidence_only_when_the_prober_was_behind_while_the_probe_ran(
    late_start: float, lag: float, unread: float, expected: Outcome
) -> None:
    batch = _TimeoutBatch()
    loop = _FakeLoop(100.0 + late_start)
    sched = scheduler_on(loop, batch)
    got: list[ProbeResult] = []
    sched.sink = lambda t, ended: got.extend(r for _, r in ended)
    sched.upsert("k", SPEC)
    entry = sched._entries["k"]
    sched._arm("k", entry, 100.0)  # due at 100.0
    sched._tick_at = loop.now
    sched._tick()
    assert batch.running == {"k"} and entry.started == loop.now
    loop.now += 0.2
    sched._tick_at = loop.now - lag  # a tick, `lag` late
    batch.backlog = unread > 0  # ... that left answers unread, as the next `unread` later
    sched._tick()
    loop.now += unread or 0.2
    sched._tick_at = loop.now
    sched._tick()
    batch.backlog = False
    loop.now = entry.started + 1.0
    sched._tick_at = loop.now
    batch.ends = ["k"]
    sched._tick()
    assert [r.outcome for r in got] == [expected]
    assert sched.stats.suspect == (expected is Outcome.SUSPECT)


@pytest.mark.parametrize(
    ("keys", "interval", "tick_ms"),
    [
        (1, 1.0, 16),  # low rates: the longest tick, the fewest wake-ups
        (500, 1.0, 16),  # 8 starts per 16 ms tick
        (1000, 1.0, 16),  # 16: still within starts_per_tick
        (1500, 1.0, 12),
        (2000, 1.0, 10),
        (2500, 1.0, 8),
        (5000, 1.0, 4),
        (10_000, 1.0, 2),  # 20 starts per 2 ms tick
        (50_000, 1.0, 2),  # never below min_tick
        (10_000, 5.0, 10),  # the rate is what counts, not the number of keys
    ],
)
def test_the_tick_shortens_as_the_probe_rate_rises(
    keys: int, interval: float, tick_ms: int
) -> None:
    sched = ProbeScheduler(Prober(), lambda *a: None, rng=random.Random(0))
    spec = ProbeSpec("TCP", "127.0.0.1", 1, timeout=1.0, interval=interval)
    for key in range(keys):
        sched.upsert(key, spec)
    assert sched.tick == pytest.approx(tick_ms / 1000)
    for key in range(keys):  # and lengthens again as keys go
        sched.remove(key)
    assert sched.tick == pytest.approx(0.016)


class _VirtualLoop(_FakeLoop):
    """A virtual clock that runs the armed timer (one at a time, like the tick's)."""

    def call_at(self, at: float, callback: object) -> _FakeLoop:
        self.timers.append(at)
        self.callback = callback
        return self


class _InstantBatch(_SlowBatch):
    """Every probe ends as it starts (and costs nothing)."""

    def start(self, key: int, spec: ProbeSpec, now: float) -> ProbeResult:  # type: ignore[override]
        self.started.append(key)
        return ProbeResult(Outcome.OK, 0.0)


@pytest.mark.parametrize(("keys", "tick_ms"), [(1000, 16), (2000, 10), (10_000, 2)])
def test_in_virtual_time_ticks_follow_the_rate_and_starts_stay_within_half_a_tick(
    keys: int, tick_ms: int
) -> None:
    batch = _InstantBatch()
    starts: list[float] = []  # lateness of each start (< 0: early)

    loop = _VirtualLoop(1000.0)
    sched = scheduler_on(loop, batch, seed=1)
    launch = sched._launch

    def timed_launch(lp: object, key: object, entry: _Entry, now: float) -> None:
        starts.append(now - entry.due)
        launch(lp, key, entry, now)  # type: ignore[arg-type]

    sched._launch = timed_launch  # type: ignore[method-assign,assignment]
    for key in range(keys):  # (with the loop set, each key is armed in its first interval)
        sched.upsert(key, SPEC)
    wakes = []
    for _ in range(5000):  # bounded: 2 virtual seconds at most
        loop.now = loop.timers[-1]
        if loop.now > 1002.0:
            break
        wakes.append(loop.now)
        sched._tick()
    assert len(starts) >= keys  # every key started (about twice)
    gaps = sorted(b - a for a, b in itertools.pairwise(wakes[len(wakes) // 2 :]))
    assert gaps[len(gaps) // 2] == pytest.approx(tick_ms / 1000)  # the tick in use
    half = tick_ms / 2000
    assert all(-half - 1e-9 <= lateness <= half + 1e-9 for lateness in starts)
