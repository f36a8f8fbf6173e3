"""The engine and the prober, wired: resources in, transitions out.

:class:`HealthService` owns one :class:`HealthEngine` and one
:class:`ProbeScheduler`. ``apply(resources)`` updates the engine and turns its
answer (endpoints added, removed, re-checked) into scheduler work; each probe
result goes into the engine, and the records that come out go to every
listener (the log, the store, event streams). The route table the engine
publishes is read by the data plane.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, cast

from healthgate.health.engine import ApplyResult, HealthEngine, ProbeTarget, RouteTable
from healthgate.health.states import Outcome, ProbeResult, Record
from healthgate.model.resources import Resource
from healthgate.probes.batch import BatchProber
from healthgate.probes.prober import Prober, ProbeSettings
from healthgate.probes.scheduler import ProbeScheduler, SchedulerSettings
from healthgate.probes.spec import ProbeSpec

if TYPE_CHECKING:
    from healthgate.controlplane.probe_workers import Report

log = logging.getLogger("healthgate.health")

# per-probe outcomes as globals (see the note on Outcome)
_OK = Outcome.OK

RecordListener = Callable[[list[Record]], None]

PROBE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ProbeStats:
    """A probe-duration histogram by outcome: one list increment per probe
    (a tick's results at a time)."""

    def __init__(self) -> None:
        self.buckets: dict[Outcome, list[int]] = {}
        self.sums: dict[Outcome, float] = {}

    def observe(self, results: Iterable[tuple[Hashable, ProbeResult]]) -> None:
        buckets, sums = self.buckets, self.sums
        for _, (outcome, latency, _status, _detail) in results:
            counts = buckets.get(outcome)
            if counts is None:
                counts = buckets[outcome] = [0] * (len(PROBE_BUCKETS) + 1)
                sums[outcome] = 0.0
            counts[bisect.bisect_left(PROBE_BUCKETS, latency)] += 1
            sums[outcome] += latency


class FailureLogLimiter:
    """Log probe failures at most ``rate`` per second (0: never), so a dead
    region does not flood the log; the count of suppressed lines is reported."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.clock = clock
        self.tokens = rate
        self.last = clock()
        self.suppressed = 0

    def allow(self) -> bool:
        if self.rate <= 0:
            return False
        now = self.clock()
        self.tokens = min(self.rate, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        self.suppressed += 1
        return False

    def failed(self, path: str, description: str) -> None:
        """A probe of this endpoint failed: a log line, if the rate allows."""
        if self.allow():
            log.info(
                "probe failed: %s: %s (%d similar lines suppressed so far)",
                path,
                description,
                self.suppressed,
            )


class HealthService:
    def __init__(
        self,
        probe_settings: ProbeSettings | None = None,
        scheduler_settings: SchedulerSettings | None = None,
        clock: Callable[[], float] = time.time,
        engine: HealthEngine | None = None,
        failure_log_rate: float = 0.0,
    ) -> None:
        self.engine = engine or HealthEngine()
        self.clock = clock
        self.scheduler = ProbeScheduler(
            Prober(probe_settings),
            self._on_results,
            scheduler_settings,
            batch=BatchProber(probe_settings),
        )
        self._listeners: list[RecordListener] = []
        self._forget_listeners: list[Callable[[list[str]], None]] = []
        self.results = 0
        self.mute = False  # while loading from the store: the initial evaluation is not news
        self.probe_stats = ProbeStats()
        self.failure_log = FailureLogLimiter(failure_log_rate)

    def subscribe(self, listener: RecordListener) -> None:
        self._listeners.append(listener)

    def on_forget(self, listener: Callable[[list[str]], None]) -> None:
        """Called with resource or endpoint paths whose persisted state is obsolete."""
        self._forget_listeners.append(listener)

    def forget_states(self, paths: list[str]) -> None:
        if paths:
            for listener in self._forget_listeners:
                listener(paths)

    def start(self) -> None:
        """Must run inside the event loop."""
        self.scheduler.start()

    async def close(self) -> None:
        await self.scheduler.close()

    def apply(self, resources: Iterable[Resource]) -> ApplyResult:
        result = self.engine.apply(resources, self.clock())
        for slot in result.removed:
            self.scheduler.remove(slot)
        for target in (*result.added, *result.changed):
            self.scheduler.upsert(target.slot, self.spec_of(target))
        self.emit(result.records)
        return result

    @staticmethod
    def spec_of(target: ProbeTarget) -> ProbeSpec:
        return ProbeSpec.from_check(target.check, target.ip, target.port)

    def route_table(self) -> RouteTable:
        return self.engine.route_table()

    def vantages(self, endpoint_path: str) -> tuple[str, dict[str, dict[str, object]]] | None:
        """Cluster mode: why the vantages' quorum gives an endpoint its state,
        and each vantage region's opinion (None here: one process decides alone)."""
        return None

    def _on_results(self, _loop_time: float, results: list[tuple[Hashable, ProbeResult]]) -> None:
        """A tick's results: counted, failures logged (rate-limited), and
        into the engine in one call. The keys are the engine's slots."""
        self.results += len(results)
        self.probe_stats.observe(results)
        failure_log = self.failure_log
        if failure_log.rate:
            for key, result in results:
                if result.outcome is not _OK:
                    failure_log.failed(self.engine.endpoint_path(cast(int, key)), result.describe())
        records = self.engine.on_results(
            self.clock(), cast("list[tuple[int, ProbeResult]]", results)
        )
        if records:
            self.emit(records)

    def take_report(self, total: Report) -> None:
        """Probe workers' totals (controlplane/probe_workers.py) as this
        process's own: the metrics read them from here."""
        stats = self.scheduler.stats
        stats.started, stats.late_starts, stats.finished = total.started, total.late, total.finished
        self.probe_stats.buckets, self.probe_stats.sums = total.buckets, total.sums
        prober = self.scheduler.prober
        prober.tls_handshakes, prober.tls_resumed = total.tls_handshakes, total.tls_resumed

    def emit(self, records: list[Record]) -> None:
        if not records or self.mute:
            return
        for listener in self._listeners:
            try:
                listener(records)
            except Exception:  # a broken listener must not stop health checking
                log.exception("transition listener failed")
