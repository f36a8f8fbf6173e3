"""The engine and the prober, wired: resources in, transitions out.

:class:`HealthService` owns one :class:`HealthEngine` and one
:class:`ProbeScheduler`. ``apply(resources)`` updates the engine and turns its
answer (endpoints added, removed, re-checked) into scheduler work; each probe
result goes into the engine, and the records that come out go to every
listener (the log, the store, event streams). The route table the engine
publishes is read by the data plane.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable

from healthgate.health.engine import ApplyResult, HealthEngine, ProbeTarget, RouteTable
from healthgate.health.states import ProbeResult, Record
from healthgate.model.resources import Resource
from healthgate.probes.prober import Prober, ProbeSettings
from healthgate.probes.scheduler import ProbeScheduler, SchedulerSettings
from healthgate.probes.spec import ProbeSpec

log = logging.getLogger("healthgate.health")

RecordListener = Callable[[list[Record]], None]


class HealthService:
    def __init__(
        self,
        probe_settings: ProbeSettings | None = None,
        scheduler_settings: SchedulerSettings | None = None,
        clock: Callable[[], float] = time.time,
        engine: HealthEngine | None = None,
    ) -> None:
        self.engine = engine or HealthEngine()
        self.clock = clock
        self.scheduler = ProbeScheduler(Prober(probe_settings), self._on_result, scheduler_settings)
        self._listeners: list[RecordListener] = []
        self.results = 0

    def subscribe(self, listener: RecordListener) -> None:
        self._listeners.append(listener)

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
        self._emit(result.records)
        return result

    @staticmethod
    def spec_of(target: ProbeTarget) -> ProbeSpec:
        return ProbeSpec.from_check(target.check, target.ip, target.port)

    def route_table(self) -> RouteTable:
        return self.engine.route_table()

    def _on_result(self, key: Hashable, _loop_time: float, result: ProbeResult) -> None:
        assert isinstance(key, int)
        self.results += 1
        records = self.engine.on_result(self.clock(), key, result)
        if records:
            self._emit(records)

    def _emit(self, records: list[Record]) -> None:
        if not records:
            return
        for listener in self._listeners:
            try:
                listener(records)
            except Exception:  # a broken listener must not stop health checking
                log.exception("transition listener failed")
