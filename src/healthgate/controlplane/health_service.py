"""The engine and how it is probed, wired: resources in, transitions out.

:class:`HealthService` owns one :class:`HealthEngine` and one probe source
(controlplane/probing.py: in this process, in probe workers, or a cluster's
opinions). ``apply(resources)`` updates the engine and tells the source
what to probe; the source feeds endpoint health back through the one
:class:`~healthgate.controlplane.probing.Feed`, and the records that come
out go to every listener (the log, the store, event streams). The route
table the engine publishes is read by the data plane.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from healthgate.controlplane.probing import Feed, InProcessProbing, ProbeSource
from healthgate.health.engine import ApplyResult, HealthEngine, RouteTable
from healthgate.health.states import Record, RecordKind
from healthgate.model.change import WorldChange
from healthgate.model.resources import Resource
from healthgate.probes.prober import ProbeSettings
from healthgate.probes.scheduler import SchedulerSettings
from healthgate.probes.stats import FailureLogLimiter, ProbeTotals

log = logging.getLogger("healthgate.health")

RETRY_EXPIRY = 1.0  # s before the timer of shifts, ramps and TTLs tries again after an error

# a probe source, given the feed and the service's failure-log limiter
SourceFactory = Callable[[Feed, FailureLogLimiter], ProbeSource]


class HealthListener:
    """One who follows the health service, told each kind of news by name
    (:meth:`HealthService.listen`); a follower overrides what it needs."""

    def records(self, records: list[Record]) -> None:
        """Records the engine (or a runner acting for it) emitted: transitions,
        route changes, ramps, ejections, holds, practice runs..."""

    def routes_moved(self) -> None:
        """Time alone moved the routes (a ramp's step: no record), for data
        planes that are pushed a configuration rather than reading the table."""

    def forget(self, paths: list[str]) -> None:
        """Resource or endpoint paths whose persisted state is obsolete."""


class RecordsTo(HealthListener):
    """A follower of records alone: each batch to ``receive``."""

    def __init__(self, receive: Callable[[list[Record]], object]) -> None:
        self.receive = receive

    def records(self, records: list[Record]) -> None:
        self.receive(records)


class HealthService:
    def __init__(
        self,
        probe_settings: ProbeSettings | None = None,
        scheduler_settings: SchedulerSettings | None = None,
        clock: Callable[[], float] = time.time,
        engine: HealthEngine | None = None,
        failure_log_rate: float = 0.0,
        source: SourceFactory | None = None,
    ) -> None:
        self.engine = engine or HealthEngine()
        self.clock = clock  # wall-clock time, for resource changes (probes bring their own)
        self._listeners: list[HealthListener] = []
        self.mute = False  # while loading from the store: the initial evaluation is not news
        # probe failures, logged at most this rate (all sources and workers together)
        self.failure_log = FailureLogLimiter(failure_log_rate)
        self.feed = Feed(self.engine, self.emit)
        self._expiry: asyncio.TimerHandle | None = None  # the next shift to run out
        if source is None:
            self.source: ProbeSource = InProcessProbing(
                self.feed, probe_settings, scheduler_settings, self.failure_log
            )
        else:
            self.source = source(self.feed, self.failure_log)

    def listen(self, listener: HealthListener) -> None:
        """``listener`` is told the news from now on, in the order listeners came."""
        self._listeners.append(listener)

    def forget_states(self, paths: list[str]) -> None:
        if paths:
            self._tell("forget", lambda listener: listener.forget(paths))

    async def start(self) -> None:
        """Begin probing (inside the event loop)."""
        await self.source.start()

    async def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        await self.source.close()

    def apply(self, resources: Iterable[Resource], when: float | None = None) -> ApplyResult:
        """The world is now ``resources`` (compared with the last: tests and
        tools; serve is told changes, :meth:`apply_change`)."""
        world = {r.path: r for r in resources}
        before = self.engine.resources
        return self.apply_change(
            WorldChange.between(0, self.clock() if when is None else when, before, world)
        )

    def apply_change(self, change: WorldChange) -> ApplyResult:
        """The world moved on by ``change``: what it causes is recorded at
        its commit's time - never later than this process's now (a time
        ahead of it, from a writer whose clock runs fast, would have the
        engine skip a shift's expiry, say); the probe source is told what
        to probe from now on."""
        now = self.clock()
        when = now if change.whole and change.time == 0.0 else min(change.time, now)
        result = self.engine.apply_change(change.world, change.changed, when)
        self.emit(result.records)
        self.source.apply(change, result)
        self.schedule_timers()
        return result

    def schedule_timers(self) -> None:
        """A timer for the next shift to run out (SPEC §6: shifts end by
        themselves), the next step of a ramped failback, or the next pushed
        endpoint's TTL (SPEC §10)."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        now = self.clock()
        times = [
            t
            for t in (
                self.engine.next_shift_expiry(now),
                self.engine.next_ramp_step(now),
                self.engine.next_report_expiry(),
            )
            if t is not None
        ]
        if not times:
            return
        when = min(times)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # (no loop: a test drives the engine itself)
        self._expiry = loop.call_later(max(0.0, when - self.clock()) + 0.001, self._expire)

    def _expire(self) -> None:
        """Shifts that ran out, and ramped failbacks' next step (SPEC §6).
        The timer goes on whatever happens here: one that died with an
        error would end no shift, ramp or TTL of this process again (an
        error is logged, and the next try is a second later at the soonest)."""
        self._expiry = None
        generation = self.engine.generation
        now = self.clock()
        try:
            self.emit(self.engine.expire_shifts(now))
            self.emit(self.engine.step_ramps(now))
            self.emit(self.engine.expire_reports(now))
        except Exception:
            log.exception("shifts, ramps and reported TTLs could not move on to %s", now)
            self._expiry = asyncio.get_running_loop().call_later(RETRY_EXPIRY, self._expire)
            return
        finally:
            if self.engine.generation != generation:
                self._tell("routes", lambda listener: listener.routes_moved())
        self.schedule_timers()

    def route_table(self) -> RouteTable:
        return self.engine.route_table()

    def totals(self) -> ProbeTotals:
        return self.source.totals()

    def pids(self) -> list[int]:
        return self.source.pids()

    def vantages(self, endpoint_path: str) -> tuple[str, dict[str, dict[str, object]]] | None:
        """Cluster mode: why the vantages' quorum gives an endpoint its state,
        and each vantage region's opinion (None here: one process decides alone)."""
        return self.source.vantages(endpoint_path)

    def emit(self, records: list[Record]) -> None:
        if not records:
            return
        if any(r.kind is RecordKind.RAMP for r in records):
            self.schedule_timers()  # (a ramp started: its steps need a timer)
        if self.mute:
            return
        self._tell("records", lambda listener: listener.records(records))

    def _tell(self, news: str, tell: Callable[[HealthListener], None]) -> None:
        for listener in self._listeners:
            try:
                tell(listener)
            except Exception:  # a broken listener must not stop health checking
                log.exception("a health listener (%s) failed on %s", type(listener).__name__, news)
