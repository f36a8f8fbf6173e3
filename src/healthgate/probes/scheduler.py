"""The probe scheduler: the timing of SPEC §2.1, driven by one tick.

Theory of operation
-------------------
Each key (an endpoint slot of the engine) has one entry. When its probe ends,
its result goes to the sink and the next probe is due ``interval`` seconds
*after the end*. So probes of one key never overlap, and the interval is
exactly the spec's.

* **The tick.** Due times sit on a wheel of short slots
  (:mod:`healthgate.probes.wheel`). A single timer, the tick, starts every
  probe due within half a tick of now (so a probe starts at most half a
  tick early or late) and polls the batch prober
  (:mod:`healthgate.probes.batch`, plain TCP and HTTP), which finishes every
  probe whose socket is ready or whose deadline has passed. While anything
  is in flight the tick runs every tick; otherwise it sleeps until the next
  due time. This is the point of the design: at 1,000 probes a second the
  process wakes about 60 times a second instead of 3,000, and a wake-up is
  the dominant cost on these machines (see docs/benchmarks.md). HTTPS and
  gRPC probes run as tasks of the coroutine
  :class:`~healthgate.probes.prober.Prober`; the tick starts them too.
* **The tick's length follows the probe rate**: ``settings.tick`` (16 ms by
  default: starts within 8 ms of due, which leaves 2 ms for the loop's own
  jitter under the 10 ms that count as late - 20 ms ticks left none, and
  3-5 % of the starts in ``serve`` came later) while that makes at most
  ``starts_per_tick`` starts per tick, shorter at higher rates, down to
  ``min_tick`` (2 ms): 1,000 probes a second tick every 16 ms, 2,000 every
  10 ms, 5,000 every 4 ms, 10,000 every 2 ms. A long tick costs less at low
  rates (each wake-up of an idle process costs this kind of machine 250-400
  µs of CPU: at 1,000 probes a second kept alive, `serve` took 108 µs per
  probe with 10 ms ticks, 90 with 16 ms); at high rates its starts take milliseconds of
  CPU (a loopback connect is ~40 µs) and the last of them start late, and a
  tick that runs long makes the next one late: at 10,000 TCP endpoints 10 ms
  ticks kept 70-94 % of the starts within 10 ms of due, 2 ms ticks 97-99.5 %.
* **Spreading.** A new key's first probe is due at a random point of its first
  interval, so 10,000 endpoints added at once do not fire together; and each
  key keeps that phase: a probe that started late (or up to half a tick
  early) moves the next due time back (or forward) by as much, so that probes
  the loop started together once do not stay together (:meth:`_next_due`).
* **Changes.** :meth:`upsert` with a new spec takes effect at once: a batch
  probe in flight is cancelled (a coroutine probe finishes and its result is
  dropped, since it tested the old spec) and the key is re-armed;
  :meth:`remove` stops a key at once. Nothing else is touched.
* **Concurrency cap.** At most ``max_in_flight`` probes run at once (bounded
  also by the open-file limit); due keys beyond it wait in a FIFO queue and
  start as others finish - late, and counted as late. The lane's own
  connections under way (TCP and fresh HTTP checks) count within the cap
  (a key of the lane past it waits there).
* **The lane.** Given a steady sink (``steady``), a key whose plain HTTP
  or TCP check succeeds joins the lane (probes/lane.py):
  the batch prober's C part then times, sends and reads its checks, and the
  tick only calls it (``_lane_start``, ``_lane_poll``); its steady
  successes go to the steady sink a tick's worth at a time, and any other
  answer hands the key back here, in flight in the batch prober or due
  again. Its counters join this scheduler's every tick.
* **Self-protection.** Each tick measures how late it runs. When the loop runs
  late by more than ``lag_threshold``, or ticks leave answers unread (their
  budget spent, below) for longer than that, a probe in flight then that
  times out may have timed out because of *us*, not the endpoint: its
  result becomes SUSPECT, which the engine treats as no evidence at all.
  It is counted and logged.
  (A refusal or a wrong status is real evidence whatever our lag; only
  timeouts are converted.) A probe that merely *started* late is timed from
  its start, and the batch prober and the lane read every answer that is in
  before they call anything a timeout: its timeout is evidence. (It was
  not, once; then a prober overloaded by the reconnects of hung endpoints -
  20,000 of them stopped at once - called a third of their timeouts no
  result, and the last endpoints took 22-24 s, not ~8, to be UNHEALTHY.)
* **Bounded ticks.** A tick starts probes for at most one tick of CPU, then
  reads results in batches until that budget is spent. When more is due (the
  prober is overloaded), the rest waits for the next tick, due at once, and
  the event loop serves the API and the listeners in between instead of
  stalling. Counted in ``stats.deferred_ticks``.

All times are the event loop's monotonic clock (``loop.time()``), or the
clock given to :meth:`ProbeScheduler.start`; the timing rules themselves are
probes/timetable.py's, shared with the simulator.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from healthgate.health.states import Outcome, ProbeResult, inverted
from healthgate.probes.batch import LANE_IDLE, LANE_UNSENT, BatchProber, LaneHandback
from healthgate.probes.clock import Clock, LoopClock, TimerHandle
from healthgate.probes.prober import Prober
from healthgate.probes.spec import ProbeSpec
from healthgate.probes.stats import LAG_BUCKETS, ProbeStats, ProbeTotals
from healthgate.probes.timetable import Timetable
from healthgate.probes.wheel import TimerWheel
from healthgate.process.limits import open_file_limit

log = logging.getLogger("healthgate.probes")

# per-probe outcomes as globals (see the note on Outcome)
_OK = Outcome.OK
_TIMEOUT = Outcome.TIMEOUT
_SUSPECT = Outcome.SUSPECT

ResultSink = Callable[[float, list[tuple[Hashable, ProbeResult]]], None]
"""Where results go: the wall-clock time they were taken at (the clock's
``wall`` of the loop time: probes/clock.py) and (key, result) for each probe
that ended then - a whole tick's worth in one call, so that the receiver
(the engine) pays its per-call overhead once per tick, not per probe."""

SteadySink = Callable[[float, bytes], None]
"""Where the lane's steady successes go (probes/lane.py): the
wall-clock time and a tick's records (health/states.py's ``STEADY``)."""

SKIPPED_LOG_EVERY = 10.0  # seconds between log lines about probes that could not start

__all__ = ["Clock", "ProbeScheduler", "ResultSink", "SchedulerSettings", "SchedulerStats"]


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    max_in_flight: int = 8192
    tick: float = 0.016  # seconds between ticks while probes are in flight, at most
    min_tick: float = 0.002  # ... and at least, however high the probe rate
    starts_per_tick: int = 20  # the tick shortens (to min_tick) to keep starts per tick near this
    lag_threshold: float = 0.25  # seconds of event-loop lag that make timeouts suspect
    late_threshold: float = 0.010  # a start later than this counts as late
    fd_reserve: int = 256  # file descriptors kept for the API, store and data plane


@dataclass(slots=True)
class SchedulerStats:
    started: int = 0
    finished: int = 0
    late_starts: int = 0
    skipped: int = 0  # could not start (no file descriptor): no result, counted and logged
    suspect: int = 0
    dropped: int = 0  # results of a spec that changed or was removed meanwhile
    max_lag: float = 0.0
    # how late each tick ran, as a histogram over LAG_BUCKETS (+Inf last)
    lag_buckets: list[int] = field(default_factory=lambda: [0] * (len(LAG_BUCKETS) + 1))
    lag_sum: float = 0.0
    deferred_ticks: int = 0  # ticks that left due work for the next one (overload)


class _Entry:
    __slots__ = (
        "due",
        "generation",
        "in_batch",
        "in_flight",
        "laned",
        "spec",
        "started",
    )

    def __init__(self, spec: ProbeSpec) -> None:
        self.spec = spec
        self.generation = 0
        self.in_flight = False
        self.in_batch = False  # in flight in the batch prober (not a coroutine)
        self.laned = False  # in the lane (probes/lane.py), which times it
        self.due = 0.0
        self.started = 0.0


class ProbeScheduler:
    def __init__(
        self,
        prober: Prober,
        sink: ResultSink,
        settings: SchedulerSettings | None = None,
        rng: random.Random | None = None,
        batch: BatchProber | None = None,
        clock: Clock | None = None,
        steady: SteadySink | None = None,
    ) -> None:
        self.prober = prober
        self.clock = clock  # (None: the running event loop's, taken at start)
        self.batch = batch  # plain TCP and HTTP; without it everything runs on `prober`
        self.sink = sink
        self.settings = settings or SchedulerSettings()
        self.stats = SchedulerStats()
        self.durations = ProbeStats()  # each result's duration by outcome, counted as it ends
        self._rng = rng or random.Random()
        self._entries: dict[Hashable, _Entry] = {}
        # due times on a wheel of short slots (probes/wheel.py): each item is
        # (key, its generation, its due time) - stale once either moved on
        self._wheel: TimerWheel[tuple[Hashable, int, float]] = TimerWheel(
            self.settings.tick, self.settings.min_tick, self.settings.starts_per_tick
        )
        self._rate = 0.0  # probes per second: the sum of 1 / interval over the keys
        self._wheel_add = self._wheel.add  # (bound once: called for every probe)
        self._waiting: deque[tuple[Hashable, int]] = deque()
        self._in_flight = 0
        # results the batch prober knew as it started the probes (a loopback
        # connect completes inside the call), ended together (_end_started)
        self._started_done: list[tuple[Hashable, ProbeResult]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: Clock | None = None
        self._timetable = Timetable(lambda: self._require_loop().time(), self._rng.random)
        self._skipped_logged_at = float("-inf")
        self._suspect_logged_at = float("-inf")
        self._suspect_logged = 0  # stats.suspect when last logged
        self._tick_handle: TimerHandle | None = None
        self._tick_at = float("inf")  # when the armed tick is due
        self._ticking = False  # inside _tick
        # when the prober was last behind - a tick late by more than
        # lag_threshold, or one that left answers unread - and how: a
        # timeout of a probe started before then is SUSPECT
        self._behind_at = float("-inf")
        self._behind = ""
        self._unread_since = math.inf  # since when ticks have left answers unread
        self._closed = False
        # (the limit is raised once, at the process's start: process/limits.py)
        self.max_in_flight = max(
            1, min(self.settings.max_in_flight, open_file_limit() - self.settings.fd_reserve)
        )
        # steady kept-alive checks in C (probes/lane.py), given somewhere to go
        self.steady = steady
        self._lane = (
            batch is not None
            and steady is not None
            and batch.open_lane(self.settings.late_threshold, lambda: self._rng.getrandbits(64))
        )

    # ------------------------------------------------------------------ control

    def start(self) -> None:
        """Begin probing (inside the event loop, whose clock and timers it
        uses unless a clock was given: tests drive a virtual one). Keys
        added before now start here, spread over their first interval."""
        self._loop = self.clock or LoopClock()
        for key, entry in self._entries.items():
            if not entry.in_flight:
                self._arm(key, entry, self._timetable.first(entry.spec.interval))

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def in_flight(self) -> int:
        if self._lane:
            assert self.batch is not None
            return self._in_flight + int(self.batch.lane.in_flight)
        return self._in_flight

    def upsert(self, key: Hashable, spec: ProbeSpec) -> None:
        """Start probing ``key``, or change how it is probed. Before
        :meth:`start`, keys are only recorded."""
        loop = self._loop
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(spec)
            self._retune(1 / spec.interval)
            if loop is not None:
                self._arm(key, entry, self._timetable.first(spec.interval))
            return
        if entry.spec == spec:
            return
        self._retune(1 / spec.interval - 1 / entry.spec.interval)
        entry.spec = spec
        entry.generation += 1
        self._forget(key, entry)
        if loop is not None and not entry.in_flight:  # a coroutine probe re-arms on completion
            self._arm(key, entry, self._timetable.first(spec.interval))

    def remove(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._retune(-1 / entry.spec.interval)
            entry.generation += 1
            self._forget(key, entry)

    def _forget(self, key: Hashable, entry: _Entry) -> None:
        if entry.in_batch:
            assert self.batch is not None
            self.batch.cancel(key)
            entry.in_batch = entry.in_flight = False
            self._in_flight -= 1
            self.stats.dropped += 1
        elif self.batch is not None:
            # a kept-alive connection, in the lane perhaps (its request out: dropped)
            if self.batch.cancel(key):
                self.stats.dropped += 1
            entry.laned = False
        self.prober.forget(key)

    async def close(self) -> None:
        self._closed = True
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        self._entries.clear()
        self._wheel.clear()
        self._waiting.clear()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.batch is not None:
            self.batch.close()
        await self.prober.close()

    # ------------------------------------------------------------------ timing

    def _require_loop(self) -> Clock:
        if self._loop is None:
            raise RuntimeError("ProbeScheduler.start() must be called inside the event loop first")
        return self._loop

    def _retune(self, rate_change: float) -> None:
        """The probe rate changed: the tick follows it (probes/wheel.py)."""
        self._rate = rate = max(0.0, self._rate + rate_change) if self._entries else 0.0
        self._wheel.fit(rate)

    @property
    def tick(self) -> float:
        """The tick now, in seconds."""
        return self._wheel.tick

    def _arm(self, key: Hashable, entry: _Entry, due: float) -> None:
        entry.due = due
        wake = self._wheel_add((key, entry.generation, due), due)
        if wake is not None and wake < self._tick_at and not self._ticking:
            self._schedule_tick(wake)  # (a tick sets the next one as it ends)

    def _schedule_tick(self, at: float) -> None:
        loop = self._require_loop()
        if self._closed:
            return
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        self._tick_at = at
        self._tick_handle = loop.call_at(at, self._tick)

    def _tick(self) -> None:
        self._ticking = True
        try:
            self._run_tick()
        finally:
            self._ticking = False

    def _run_tick(self) -> None:
        loop = self._require_loop()
        now = loop.time()
        self._measure_lag(now)
        # Starts first, so that they are on time however many results wait.
        # The tick's work is bounded (one tick of CPU for the starts, then
        # at least one batch of results): when more is due than that - the
        # prober overloaded - the rest waits for the next tick, due at once,
        # and the loop serves the API and the listeners in between instead of
        # stalling for seconds.
        wheel = self._wheel
        budget_end = time.perf_counter() + wheel.tick
        last = wheel.last_due(now)
        deferred = self._start_due(loop, last, budget_end)
        unread = False
        batch = self.batch
        lane = batch.lane if self._lane and batch is not None else None
        # (a lane that empties as it starts is polled still: its counts)
        laned = lane is not None and len(lane) > 0
        if laned:
            deferred = self._lane_start(now, last, budget_end) or deferred
        if batch is not None and batch.in_flight:
            end = loop.time()  # (after the starts: some may have ended already)
            ended = batch.poll(end, budget_end)
            if ended:
                self._ended(ended, end, from_batch=True)
            unread = batch.backlog
        if laned and self._lane_poll(loop, budget_end):
            unread = True
        self._unread(now, unread)
        deferred = deferred or unread
        if not deferred and self._waiting:
            deferred = self._start_waiting(loop, budget_end)
        if deferred:
            self.stats.deferred_ticks += 1
            nxt = now  # due now: after whatever else the loop has ready
        elif self._in_flight or self._waiting or (lane is not None and lane.in_flight):
            nxt = wheel.wake_for(last + wheel.k)
        elif (first := self._first_slot()) is not None:  # (a tick's worth at once, as when busy)
            nxt = wheel.wake_for(max(first, last + wheel.k))
        else:
            return
        self._schedule_tick(nxt)  # (nothing arms a tick while this one runs)

    def _first_slot(self) -> int | None:
        """The earliest slot with a probe due: on the wheel, or in the lane."""
        first = self._wheel.first()
        if self._lane:
            assert self.batch is not None
            due = self.batch.lane.next_due
            if due is not None:
                slot = int(due / self._wheel.res + 0.5)
                first = slot if first is None else min(first, slot)
        return first

    def _lane_start(self, now: float, last: int, budget_end: float) -> bool:
        """Send the lane's requests (and connect its TCP and fresh HTTP
        checks) due by slot ``last``; True when the budget ran out first. A
        key whose send failed is armed again here (its connection dropped: a
        fresh one at once); a check that failed at once has ended here."""
        assert self.batch is not None
        horizon = (last + 0.5) * self._wheel.res  # (the end of slot `last`)
        room = self.max_in_flight - self._in_flight  # (the cap: the lane's connects within it)
        back, deferred = self.batch.lane_start(now, horizon, budget_end, room)
        if back:
            ended = self._taken_back(back)
            if ended:
                self._ended(ended, now, from_batch=True)
        return deferred

    def _taken_back(self, back: list[LaneHandback]) -> list[tuple[Hashable, ProbeResult]]:
        """Keys the lane handed back, on the wheel again: an idle or unsent
        one armed at its due time; any other was started by the lane and is
        in flight in the batch prober, or ended (its result: returned)."""
        ended: list[tuple[Hashable, ProbeResult]] = []
        entries = self._entries
        for key, what, started, due, result in back:
            entry = entries.get(key)
            if entry is None:  # (cannot be: a key removed leaves the lane)
                continue
            entry.laned = False
            if what in (LANE_IDLE, LANE_UNSENT):
                self._arm(key, entry, due)
                continue
            entry.in_flight = entry.in_batch = True
            entry.due, entry.started = due, started
            self._in_flight += 1
            if result is not None:
                ended.append((key, result))
        return ended

    def _lane_poll(self, loop: Clock, budget_end: float) -> bool:
        """The lane's steady successes to the steady sink, and the keys it
        handed back taken up here: an idle connection dropped is due again
        at its time; any other was started by the lane and is in flight in
        the batch prober, or ended (its result, as any batch result's).
        True when events wait still (the budget ran out)."""
        batch = self.batch
        assert batch is not None and self.steady is not None
        end = loop.time()
        records, back, backlog = batch.lane_poll(end, budget_end)
        ended = self._taken_back(back) if back else []
        started_n, late, finished, total, buckets = batch.lane.take_counts()
        stats = self.stats
        stats.started += started_n
        stats.late_starts += late
        stats.finished += finished
        if finished:
            self.durations.add(_OK, buckets, total)
        if records:
            self.steady(loop.wall(end) if self._loop is not None else end, records)
        if ended:
            self._ended(ended, end, from_batch=True)
        return bool(backlog)

    def _unread(self, now: float, unread: bool) -> None:
        """Did this tick leave answers (or connects' ends) unread, its budget
        spent? The next reads them, due at once; but when some have waited
        for more than lag_threshold, a fresh connection's request may have
        gone that late, and a timeout then is no evidence (as a lag)."""
        if not unread:
            self._unread_since = math.inf
        elif now - min(self._unread_since, now) > self.settings.lag_threshold:
            waited = (now - self._unread_since) * 1000
            self._behind_at, self._behind = now, f"answers waited unread for {waited:.0f} ms"
        else:
            self._unread_since = min(self._unread_since, now)

    def _measure_lag(self, now: float) -> None:
        """How late this tick runs: counted, and remembered when it makes timeouts suspect."""
        stats = self.stats
        lag = now - self._tick_at
        self._tick_at = float("inf")
        self._tick_handle = None
        stats.max_lag = max(stats.max_lag, lag)
        stats.lag_buckets[bisect.bisect_left(LAG_BUCKETS, lag)] += 1
        stats.lag_sum += max(lag, 0.0)
        if lag > self.settings.lag_threshold:
            self._behind_at, self._behind = now, f"its loop lagged {lag * 1000:.0f} ms"
            log.warning("prober event loop lagged %.0f ms behind", lag * 1000)

    def _start_due(self, loop: Clock, last: int, budget_end: float) -> bool:
        """Start every probe due up to slot ``last``, within the CPU budget;
        True when the budget ran out first (the rest is put back)."""
        launched = 0
        wheel = self._wheel
        entries = self._entries
        cap = self._cap()
        while (taken := wheel.take(last)) is not None:
            slot, keys = taken
            for i, (key, generation, at) in enumerate(keys):
                entry = entries.get(key)
                if entry is None or entry.generation != generation or entry.due != at:
                    continue  # removed, changed or re-armed since
                if entry.in_flight:
                    continue
                if self._in_flight >= cap:
                    self._end_started(loop)  # (what ended already is not in flight)
                    if self._in_flight >= cap:
                        self._waiting.append((key, generation))
                        continue
                self._launch(loop, key, entry, loop.time())
                launched += 1
                if not launched % 32 and time.perf_counter() > budget_end:
                    wheel.put_back(slot, keys[i + 1 :])
                    self._end_started(loop)
                    return True
        self._end_started(loop)
        return False

    def _end_started(self, loop: Clock) -> None:
        """End the probes whose results the batch prober gave as it started
        them, all in one call (and so in one call to the sink): per result,
        that call cost more than the check (issue 31)."""
        done = self._started_done
        if done:
            self._started_done = []
            self._ended(done, loop.time(), from_batch=True)

    def _launch(self, loop: Clock, key: Hashable, entry: _Entry, now: float) -> None:
        entry.in_flight = True
        entry.started = now
        self._in_flight += 1
        self.stats.started += 1
        if now - entry.due > self.settings.late_threshold:
            self.stats.late_starts += 1
        spec = entry.spec
        batch = self.batch
        if batch is not None and batch.handles(spec):
            entry.in_batch = True
            result = batch.start(key, spec, now)
            if result is not None:  # (ended by the caller: _end_started)
                self._started_done.append((key, result))
            return
        task = asyncio.get_running_loop().create_task(self._run(key, entry))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, key: Hashable, entry: _Entry) -> None:
        loop = self._require_loop()
        generation = entry.generation
        spec = entry.spec
        started = entry.started
        try:
            result = await self.prober.probe(spec, key)
        except Exception as exc:  # a bug in a probe must not stop the scheduler
            log.exception("probe of %s failed unexpectedly", spec.address)
            result = ProbeResult(Outcome.ERROR, loop.time() - started, 0, type(exc).__name__)
        end = loop.time()
        if self._entries.get(key) is not entry or self._closed:
            entry.in_flight = False
            self._in_flight -= 1
            self.stats.dropped += 1
            self._start_waiting(loop)
            return
        if entry.generation != generation:  # the spec changed while this probe ran
            entry.in_flight = False
            self._in_flight -= 1
            self.stats.dropped += 1
            self._arm(key, entry, self._timetable.first(entry.spec.interval))
            self._start_waiting(loop)
            return
        self._ended([(key, result)], end)
        self._start_waiting(loop)

    def _ended(
        self, results: list[tuple[Hashable, ProbeResult]], end: float, from_batch: bool = False
    ) -> None:
        """Probes that ended at ``end``: each key is armed for its next probe,
        and the results go to the sink in one call. (A batch result for a key
        no longer in the batch - removed, changed - is dropped.)"""
        entries = self._entries
        stats = self.stats
        count = self.durations.count
        batch = self.batch if self._lane and from_batch else None
        laned = False
        out: list[tuple[Hashable, ProbeResult]] = []
        for key, result in results:
            entry = entries.get(key)
            if entry is None or (from_batch and not entry.in_batch):
                continue
            entry.in_flight = entry.in_batch = False
            count(result.outcome, result.latency)
            if result.outcome is _SUSPECT:  # the prober could not make it (no descriptor)
                self._skipped(end, result)
                out.append((key, result))
            elif result.outcome is _TIMEOUT and self._behind_at >= entry.started:
                self._suspected(end, entry)
                out.append(
                    (key, ProbeResult(Outcome.SUSPECT, result.latency, 0, "prober overloaded"))
                )
            elif entry.spec.invert:  # (an inverted check: success and failure swap)
                out.append((key, inverted(result)))
            else:
                out.append((key, result))
            due = self._next_due(entry, end)
            if (
                batch is not None
                and result.outcome is _OK
                and batch.enter_lane(key, entry.spec, due)
            ):
                entry.laned = laned = True  # (the lane times it from now on)
            else:
                self._arm(key, entry, due)
        if laned and not self._ticking:
            first = self._first_slot()
            if first is not None and (wake := self._wheel.wake_for(first)) < self._tick_at:
                self._schedule_tick(wake)
        self._in_flight -= len(out)
        stats.finished += len(out)
        if out:
            loop = self._loop
            self.sink(loop.wall(end) if loop is not None else end, out)

    def totals(self, prober: Prober) -> ProbeTotals:
        """Every counter of this scheduler and its prober, as one value."""
        s, d = self.stats, self.durations
        return ProbeTotals(
            s.started,
            s.late_starts,
            s.skipped,
            s.finished,
            s.suspect,
            s.deferred_ticks,
            self.in_flight,
            prober.tls_handshakes,
            prober.tls_resumed,
            {o: list(c) for o, c in d.buckets.items()},
            dict(d.sums),
            list(s.lag_buckets),
            s.lag_sum,
        )

    def _suspected(self, now: float, entry: _Entry) -> None:
        """A timeout taken while the prober lagged: counted, and logged at
        most every SKIPPED_LOG_EVERY seconds: one stall times out every
        probe in flight, thousands at once (three workers starting 50,000
        endpoints against starved backends wrote a line per probe, each
        worker two seconds behind), and writing a line each is more work
        for a prober already behind."""
        stats = self.stats
        stats.suspect += 1
        if now - self._suspect_logged_at >= SKIPPED_LOG_EVERY:
            log.warning(
                "probe of %s timed out while the prober was behind (%s): counted as no result"
                " (%d more such since the last line)",
                entry.spec.address,
                self._behind,
                stats.suspect - self._suspect_logged - 1,
            )
            self._suspect_logged_at = now
            self._suspect_logged = stats.suspect

    def _skipped(self, now: float, result: ProbeResult) -> None:
        """A probe that could not start: starvation, counted and logged
        (at most every SKIPPED_LOG_EVERY seconds)."""
        stats = self.stats
        stats.skipped += 1
        if now - self._skipped_logged_at >= SKIPPED_LOG_EVERY:
            self._skipped_logged_at = now
            log.warning(
                "probes could not start (%d so far): %s; %d probes in flight, open-file limit %d "
                "- raise LimitNOFILE / ulimit -n, or probe in more worker processes "
                "(--probe-workers)",
                stats.skipped,
                result.detail or result.describe(),
                self._in_flight,
                open_file_limit(),
            )

    def _next_due(self, entry: _Entry, end: float) -> float:
        """``interval`` after the end, keeping the key's phase (probes/timetable.py)."""
        return self._timetable.next(entry.spec.interval, entry.due, entry.started, end)

    def _cap(self) -> int:
        """How many probes of the Python path may be in flight: the cap, less
        the lane's own connections under way (each holds a descriptor too)."""
        if self._lane:
            assert self.batch is not None
            return self.max_in_flight - int(self.batch.lane.connecting)
        return self.max_in_flight

    def _start_waiting(self, loop: Clock, budget_end: float = math.inf) -> bool:
        """Start the probes that waited for room under the cap, oldest first,
        while there is room; within the tick's CPU budget when one is given.
        True when the budget ran out with some still waiting. (Room for
        thousands comes at once when a stall times out every probe in
        flight: started all in one go, each of them a fresh connection, they
        stalled the tick for a second - three workers on 50,000 endpoints
        against starved backends - and made the next stall.)"""
        cap = self._cap()
        launched = 0
        waiting = self._waiting
        while waiting:
            if self._in_flight >= cap:
                self._end_started(loop)  # (what ended already is not in flight)
                if self._in_flight >= cap:
                    break
            key, generation = waiting.popleft()
            entry = self._entries.get(key)
            if entry is not None and entry.generation == generation and not entry.in_flight:
                self._launch(loop, key, entry, loop.time())
                launched += 1
                if not launched % 32 and waiting and time.perf_counter() > budget_end:
                    self._end_started(loop)
                    return True
        self._end_started(loop)
        return False
