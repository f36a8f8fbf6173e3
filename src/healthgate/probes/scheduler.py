"""The probe scheduler: one timer per endpoint, the timing of SPEC §2.1.

Theory of operation
-------------------
Each key (an endpoint slot of the engine) has one entry and at most one timer.
When the timer fires the probe starts; when the probe ends its result goes to
the sink and the next probe is due ``interval`` seconds *after the end*. So
probes of one key never overlap, and the interval is exactly the spec's.

* **Spreading.** A new key's first probe is due at a random point of its first
  interval, so 10,000 endpoints added at once do not fire together.
* **Changes.** :meth:`upsert` with a new spec takes effect at the next probe
  (a probe in flight finishes and its result is dropped, since it tested the
  old spec); :meth:`remove` stops a key at once. Nothing else is touched.
* **Concurrency cap.** At most ``max_in_flight`` probes run at once (bounded
  also by the open-file limit); due keys beyond it wait in a FIFO queue and
  start as others finish - late, and counted as late.
* **Self-protection.** A monitor measures the event loop's own lag. When the
  loop runs late by more than ``lag_threshold``, a probe that timed out during
  that time may have timed out because of *us*, not the endpoint: its result
  becomes SUSPECT, which the engine treats as no evidence at all. It is
  counted and logged. (A refusal or a wrong status is real evidence whatever
  our lag; only timeouts are converted.)

All times are the event loop's monotonic clock (``loop.time()``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import resource
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from healthgate.health.states import Outcome, ProbeResult
from healthgate.probes.prober import Prober
from healthgate.probes.spec import ProbeSpec

log = logging.getLogger("healthgate.probes")

ResultSink = Callable[[Hashable, float, ProbeResult], None]


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    max_in_flight: int = 8192
    lag_threshold: float = 0.25  # seconds of event-loop lag that make timeouts suspect
    lag_check_interval: float = 0.05
    late_threshold: float = 0.010  # a start later than this counts as late
    fd_reserve: int = 256  # file descriptors kept for the API, store and data plane


@dataclass(slots=True)
class SchedulerStats:
    started: int = 0
    finished: int = 0
    late_starts: int = 0
    suspect: int = 0
    dropped: int = 0  # results of a spec that changed or was removed meanwhile
    max_lag: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)


class _Entry:
    __slots__ = ("due", "generation", "handle", "in_flight", "spec")

    def __init__(self, spec: ProbeSpec) -> None:
        self.spec = spec
        self.generation = 0
        self.handle: asyncio.TimerHandle | None = None
        self.in_flight = False
        self.due = 0.0


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            log.warning("could not raise the open-file limit above %d", soft)
    return soft


class ProbeScheduler:
    def __init__(
        self,
        prober: Prober,
        sink: ResultSink,
        settings: SchedulerSettings | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.prober = prober
        self.sink = sink
        self.settings = settings or SchedulerSettings()
        self.stats = SchedulerStats()
        self._rng = rng or random.Random()
        self._entries: dict[Hashable, _Entry] = {}
        self._waiting: deque[tuple[Hashable, int]] = deque()
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lag_handle: asyncio.TimerHandle | None = None
        self._last_lag_at = float("-inf")
        self._expected_tick = 0.0
        self._closed = False
        soft = raise_open_file_limit()
        self.max_in_flight = max(
            1, min(self.settings.max_in_flight, soft - self.settings.fd_reserve)
        )

    # ------------------------------------------------------------------ control

    def start(self) -> None:
        """Begin probing (inside the event loop). Keys added before now start
        here, spread over their first interval."""
        self._loop = loop = asyncio.get_running_loop()
        self._expected_tick = loop.time() + self.settings.lag_check_interval
        self._lag_handle = loop.call_at(self._expected_tick, self._lag_tick)
        for key, entry in self._entries.items():
            if entry.handle is None and not entry.in_flight:
                self._arm(loop, key, entry, loop.time() + self._rng.uniform(0, entry.spec.interval))

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def upsert(self, key: Hashable, spec: ProbeSpec) -> None:
        """Start probing ``key``, or change how it is probed. Before
        :meth:`start`, keys are only recorded."""
        loop = self._loop
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(spec)
            if loop is not None:
                self._arm(loop, key, entry, loop.time() + self._rng.uniform(0, spec.interval))
            return
        if entry.spec == spec:
            return
        entry.spec = spec
        entry.generation += 1
        self.prober.forget(key)
        if loop is not None and not entry.in_flight:  # a probe in flight re-arms on completion
            if entry.handle is not None:
                entry.handle.cancel()
            self._arm(loop, key, entry, loop.time() + self._rng.uniform(0, spec.interval))

    def remove(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.generation += 1
            if entry.handle is not None:
                entry.handle.cancel()
            self.prober.forget(key)

    async def close(self) -> None:
        self._closed = True
        if self._lag_handle is not None:
            self._lag_handle.cancel()
        for entry in self._entries.values():
            if entry.handle is not None:
                entry.handle.cancel()
        self._entries.clear()
        self._waiting.clear()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.prober.close()

    # ------------------------------------------------------------------ timing

    def _require_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("ProbeScheduler.start() must be called inside the event loop first")
        return self._loop

    def _arm(
        self, loop: asyncio.AbstractEventLoop, key: Hashable, entry: _Entry, due: float
    ) -> None:
        entry.due = due
        entry.handle = loop.call_at(due, self._fire, key, entry.generation)

    def _fire(self, key: Hashable, generation: int) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.generation != generation or self._closed:
            return
        entry.handle = None
        if self._in_flight >= self.max_in_flight:
            self._waiting.append((key, generation))
            return
        self._launch(key, entry)

    def _launch(self, key: Hashable, entry: _Entry) -> None:
        loop = self._require_loop()
        entry.in_flight = True
        self._in_flight += 1
        self.stats.started += 1
        if loop.time() - entry.due > self.settings.late_threshold:
            self.stats.late_starts += 1
        task = loop.create_task(self._run(key, entry))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, key: Hashable, entry: _Entry) -> None:
        loop = self._require_loop()
        generation = entry.generation
        spec = entry.spec
        started = loop.time()
        lag_at_start = started - entry.due
        try:
            result = await self.prober.probe(spec, key)
        except Exception as exc:  # a bug in a probe must not stop the scheduler
            log.exception("probe of %s failed unexpectedly", spec.address)
            result = ProbeResult(Outcome.ERROR, loop.time() - started, 0, type(exc).__name__)
        finally:
            entry.in_flight = False
            self._in_flight -= 1
            self._start_waiting()
        end = loop.time()
        stats = self.stats
        stats.finished += 1
        if result.outcome == Outcome.TIMEOUT and (
            lag_at_start > self.settings.lag_threshold or self._last_lag_at >= started
        ):
            stats.suspect += 1
            log.warning(
                "probe of %s timed out while the prober lagged (%.0f ms): counted as no result",
                spec.address,
                max(lag_at_start, stats.max_lag) * 1000,
            )
            result = ProbeResult(Outcome.SUSPECT, result.latency, 0, "prober overloaded")
        name = result.outcome.name
        stats.outcomes[name] = stats.outcomes.get(name, 0) + 1
        if self._entries.get(key) is not entry or self._closed:
            stats.dropped += 1
            return
        if entry.generation != generation:
            stats.dropped += 1  # the spec changed while this probe ran
            self._arm(loop, key, entry, end + self._rng.uniform(0, entry.spec.interval))
            return
        self._arm(loop, key, entry, end + spec.interval)
        self.sink(key, end, result)

    def _start_waiting(self) -> None:
        while self._waiting and self._in_flight < self.max_in_flight:
            key, generation = self._waiting.popleft()
            entry = self._entries.get(key)
            if entry is not None and entry.generation == generation and not entry.in_flight:
                self._launch(key, entry)

    def _lag_tick(self) -> None:
        loop = self._require_loop()
        now = loop.time()
        lag = now - self._expected_tick
        self.stats.max_lag = max(self.stats.max_lag, lag)
        if lag > self.settings.lag_threshold:
            self._last_lag_at = now
            log.warning("prober event loop lagged %.0f ms behind", lag * 1000)
        self._expected_tick = now + self.settings.lag_check_interval
        self._lag_handle = loop.call_at(self._expected_tick, self._lag_tick)
