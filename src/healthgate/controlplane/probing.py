"""Where endpoint health comes from, and the one path by which it becomes
the serving engine's state.

Three *probe sources* (docs/architecture.md has the picture), one interface
(:class:`ProbeSource`):

* :class:`InProcessProbing` - this process's scheduler probes every
  endpoint; a tick's results go into the engine's threshold machine.
* :class:`~healthgate.controlplane.probe_workers.WorkerProbing` - probe
  worker processes probe shards of the endpoints, run the threshold machine
  there, and send the endpoints' *flips*; a flip sets the endpoint's state.
* :class:`~healthgate.cluster.probing.ClusterProbing` - a cluster node
  probes its share into a prober table of its own; its flips become
  opinions in etcd; every node decides each endpoint from the watched
  opinions by the vantage quorum and sets its state.

Each hands the serving engine either results (:meth:`Feed.results`) or
decided states (:meth:`Feed.states`), and :class:`Feed` emits the records:
nothing else writes an endpoint's state, so "where does a probe result
become a state?" has one answer - here, through the engine's endpoint table.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple, Protocol, cast

from healthgate.health.endpoints import EndpointTable, Observed
from healthgate.health.engine import ApplyResult, HealthEngine, ProbeTarget
from healthgate.health.history import OutcomeHistory, history_export
from healthgate.health.states import (
    STEADY,
    HealthState,
    Outcome,
    ProbeResult,
    Record,
    steady_results,
)
from healthgate.model.change import WorldChange
from healthgate.probes.batch import BatchProber
from healthgate.probes.prober import Prober, ProbeSettings
from healthgate.probes.scheduler import ProbeScheduler, SchedulerSettings
from healthgate.probes.spec import ProbeSpec
from healthgate.probes.stats import FailureLogLimiter, ProbeTotals

_OK = Outcome.OK  # (a per-probe global: see the note on Outcome)
_DEGRADED = Outcome.DEGRADED

Emit = Callable[[list[Record]], None]
HISTORY_BUDGET = 256 << 20  # bytes of outcome history one process hands over for a replay


class Decided(NamedTuple):
    """An endpoint's state decided elsewhere (a worker's threshold machine,
    a cluster's quorum): its path, state, since when, why, and - when known
    - what its probes had shown then (the runs the reason counts, the last
    result; setting a state clears them)."""

    path: str
    state: HealthState
    since: float
    reason: str
    observed: Observed | None = None


class Feed:
    """The one way into the serving engine's endpoint states (see the module doc)."""

    def __init__(self, engine: HealthEngine, emit: Emit) -> None:
        self.engine = engine
        self.emit = emit

    def results(self, now: float, results: Sequence[tuple[int, ProbeResult]]) -> None:
        """A tick's probe results (taken at ``now``, wall-clock time) into the
        threshold machine; keys are the engine's slots."""
        records = self.engine.on_results(now, results)
        if records:
            self.emit(records)

    def states(self, decided: Iterable[Decided]) -> list[Record]:
        """States decided elsewhere, set as they are (unknown paths are
        skipped); the records they caused, emitted."""
        records = set_states(self.engine.table, decided)
        self.emit(records)
        return records

    def release_hold(self, now: float, hold_id: str, actor: str) -> None:
        """An admin released a failover storm hold (the log says so: every
        node of a cluster follows it; none in effect here - nothing)."""
        records = self.engine.release_hold(now, hold_id, actor)
        if records:
            self.emit(records)

    def observed(self, items: Iterable[tuple[str, Observed]]) -> None:
        """What the probes of endpoints probed elsewhere have shown (the API's details)."""
        table = self.engine.table
        for path, seen in items:
            slot = table.slot_of_path(path)
            if slot is not None:
                table.set_observed(slot, seen)


def set_states(table: EndpointTable, decided: Iterable[Decided]) -> list[Record]:
    """Decided states into an endpoint table: the records they cause. (Used
    for the serving engine's by :class:`Feed`, and for a cluster node's
    prober table by the probe workers that probe its share.)"""
    records: list[Record] = []
    # in the order they happened, not the order they arrived: a record of a
    # source, NEG or route carries the time of the endpoint state that made
    # it so, and every cluster node must find the same one - a node that
    # rejoins takes a whole batch at once, the others saw it one by one
    for d in sorted(decided, key=lambda d: (d.since, d.path)):
        slot = table.slot_of_path(d.path)
        if slot is not None:
            records += table.set_state(d.since, slot, d.state, d.reason)
            if d.observed is not None:
                table.set_observed(slot, d.observed)  # (setting a state clears the runs)
    return records


class ProbeSource(Protocol):
    """How probing runs (see the module doc)."""

    def apply(self, change: WorldChange, result: ApplyResult) -> None:
        """The resources changed (``change``: what, and the world after it;
        ``result``: what the serving engine made of it): probe what is to be
        probed, doing the change's work, not the world's."""

    async def start(self) -> None:
        """Begin probing (inside the event loop)."""

    async def close(self) -> None: ...

    def totals(self) -> ProbeTotals:
        """Every probing counter, this process's and its workers' together."""

    def pids(self) -> list[int]:
        """Worker processes probing for this one (none in-process)."""

    async def histories(self) -> tuple[dict[str, list[bytes]], bool]:
        """The outcome history of every endpoint this process (or its
        workers) probes, encoded (health/history.py), and whether some was
        left out (SPEC §11: replay)."""

    def vantages(self, endpoint_path: str) -> tuple[str, dict[str, dict[str, object]]] | None:
        """Cluster mode: why the vantages' quorum gives an endpoint its state,
        and each vantage region's opinion (None: one process decides alone)."""


def spec_of(target: ProbeTarget) -> ProbeSpec:
    return ProbeSpec.from_check(target.check, target.ip, target.port, target.secrets)


class LocalProber:
    """A scheduler probing in this process, its results to ``sink`` (the
    serving engine's feed, or a cluster node's prober table), its
    failures logged at ``failure_log``'s rate and its durations counted."""

    def __init__(
        self,
        sink: Callable[[float, Sequence[tuple[int, ProbeResult]]], None],
        describe: Callable[[int], str],
        probe_settings: ProbeSettings | None = None,
        scheduler_settings: SchedulerSettings | None = None,
        failure_log: FailureLogLimiter | None = None,
        table: EndpointTable | None = None,
    ) -> None:
        self.sink = sink
        self.describe = describe  # a slot's endpoint path, for the failure log
        self.prober = Prober(probe_settings)
        # the endpoint table behind `sink`: given, steady kept-alive checks
        # skip the sink (probes/lane.py) and go into it directly
        self.table = table
        self.scheduler = ProbeScheduler(
            self.prober,
            self._on_results,
            scheduler_settings,
            batch=BatchProber(probe_settings),
            steady=self._on_steady if table is not None else None,
        )
        self.failure_log = failure_log or FailureLogLimiter(0.0)
        self.results = 0
        # SPEC §11: every result kept, run-length coded, for replay (None: off)
        hours = (probe_settings or ProbeSettings()).history_hours
        self.history = OutcomeHistory(hours) if hours > 0 else None

    def _on_results(self, now: float, results: list[tuple[Hashable, ProbeResult]]) -> None:
        """A tick's results (the scheduler counted them): kept in the
        history, failures logged (rate-limited), then to the sink."""
        self.results += len(results)
        if self.history is not None:
            self.history.record(now, results, self.describe)
        failure_log = self.failure_log
        if failure_log.rate:
            for key, result in results:
                if result.outcome is not _OK and result.outcome is not _DEGRADED:
                    failure_log.failed(self.describe(cast(int, key)), result.describe())
        self.sink(now, cast("list[tuple[int, ProbeResult]]", results))

    def _on_steady(self, now: float, records: bytes) -> None:
        """A tick's steady successes from the lane: kept in the
        history and taken into the table; those of an endpoint not HEALTHY
        yet go to the sink as results (no failure among them to log)."""
        assert self.table is not None
        self.results += len(records) // STEADY.size
        if self.history is not None:
            self.history.steady(now, records, self.describe)
        left = self.table.on_steady(now, records)
        if left:
            self.sink(now, steady_results(left))

    def totals(self) -> ProbeTotals:
        return self.scheduler.totals(self.prober)

    def remove(self, key: int) -> None:
        """Stop probing ``key`` (its history stays, by its endpoint's path)."""
        self.scheduler.remove(key)
        if self.history is not None:
            self.history.forget(key)

    def start(self) -> None:
        self.scheduler.start()

    async def close(self) -> None:
        await self.scheduler.close()


class InProcessProbing:
    """Every endpoint probed by this process's scheduler, into the feed."""

    def __init__(
        self,
        feed: Feed,
        probe_settings: ProbeSettings | None = None,
        scheduler_settings: SchedulerSettings | None = None,
        failure_log: FailureLogLimiter | None = None,
    ) -> None:
        self.local = LocalProber(
            feed.results,
            feed.engine.endpoint_path,
            probe_settings,
            scheduler_settings,
            failure_log,
            feed.engine.table,
        )

    def apply(self, change: WorldChange, result: ApplyResult) -> None:
        scheduler = self.local.scheduler
        for slot in result.removed:
            self.local.remove(slot)
        for target in (*result.added, *result.changed):
            scheduler.upsert(target.slot, spec_of(target))

    async def start(self) -> None:
        self.local.start()

    async def close(self) -> None:
        await self.local.close()

    def totals(self) -> ProbeTotals:
        return self.local.totals()

    def pids(self) -> list[int]:
        return []

    async def histories(self) -> tuple[dict[str, list[bytes]], bool]:
        return history_export(self.local.history, HISTORY_BUDGET)

    def vantages(self, endpoint_path: str) -> tuple[str, dict[str, dict[str, object]]] | None:
        return None
