"""The health engine: probe results and resource changes in, transitions out.

A thin façade over the engine's two parts, each one idea:

* :class:`~healthgate.health.endpoints.EndpointTable` - every endpoint's
  threshold state in parallel arrays, counted per backend service; one probe
  result is O(1);
* :class:`~healthgate.health.graph.HealthGraph` - sources, composites,
  attachments, PSC NEGs and consumer routes, re-evaluated level by level
  when something below them changed, and the route table it publishes.

An endpoint flip in the table is handed to the graph at once, so feeding
results one at a time or a tick at a time gives the same records.
Resource changes go through :meth:`HealthEngine.apply`, given the complete
desired set: the table rebuilds only the backend services whose check or
groups changed, the graph only the nodes that changed.

The engine never reads a clock: every call takes ``now``. It never does I/O.
Records are returned to the caller, which logs, stores and streams them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

from healthgate.gcpause import gc_paused
from healthgate.health.endpoints import EndpointTable
from healthgate.health.evidence import Address, Hops
from healthgate.health.graph import HealthGraph
from healthgate.health.passive import PassiveHealth, PassiveResult
from healthgate.health.routing import Candidate
from healthgate.health.states import (
    HealthState,
    Hold,
    HoldPhase,
    ProbeResult,
    Record,
    RouteChange,
    Transition,
)
from healthgate.health.storms import StormGuard, StormSettings
from healthgate.health.types import (
    ApplyResult,
    Counts,
    EndpointKey,
    EndpointStatus,
    NodeStatus,
    ProbeTarget,
    Route,
    RouteTable,
)
from healthgate.model.names import ResourcePath, endpoint_name, parse_endpoint_name
from healthgate.model.resources import Resource, Shift

__all__ = [
    "ApplyResult",
    "EndpointKey",
    "EndpointStatus",
    "HealthEngine",
    "NodeStatus",
    "ProbeTarget",
    "Route",
    "RouteTable",
    "endpoint_name",
    "parse_endpoint_name",
]


class HealthEngine:
    # The hot path is the table's own, bound once (no façade call per result):
    on_result: Callable[[float, int, ProbeResult], list[Record]]
    """Feed one probe result; returns the transitions it caused (often none)."""
    on_results: Callable[[float, Iterable[tuple[int, ProbeResult]]], list[Record]]
    """Feed the results of probes that ended together (a tick's worth); the
    same as :meth:`on_result` for each in turn, the steady state faster."""

    def __init__(self) -> None:
        self.table = EndpointTable()
        self.graph = HealthGraph(counts=self.table.counts)
        # failover storms held (SPEC §8): every flip is seen before the graph
        self.storms = StormGuard()
        # an endpoint's flip reaches the graph at once, so results fed one at
        # a time or a tick at a time give the same records
        self.table.on_flip = self._flipped
        self.table.on_counts = self.graph.endpoints_flipped
        self.on_result = self.table.on_result
        self.on_results = self.table.on_results
        # real traffic as evidence (SPEC §8): outlier ejection, TRAFFIC sources
        self.passive = PassiveHealth(self.table, self.graph)
        self._resources: Mapping[ResourcePath, Resource] = {}
        self._applies = 0

    def _flipped(self, now: float, backend_service: ResourcePath, records: list[Record]) -> None:
        """An endpoint flipped (``records[0]``, its transition): the storm
        guard sees it first - the flip that makes a storm is held too."""
        hold = None
        if self.storms.on and records and isinstance(records[0], Transition):
            t = records[0]
            probed = self.table.endpoint_count()
            hold = self.storms.flip(now, t.path, backend_service.region, t.current, probed)
            if hold is not None and hold.phase is HoldPhase.HELD:
                records.extend(self._per_project(hold))
                why = f"failover storm {hold.hold_id} across {', '.join(hold.regions)}"
                self.graph.hold_routes(now, True, records, hold.since, why)
                hold = None
        self.graph.endpoints_flipped(now, backend_service, records)
        if hold is not None:  # (lifted: the flip first, then every route again)
            self._let_go(now, hold, records)

    def _let_go(self, now: float, hold: Hold, records: list[Record]) -> None:
        after: list[Record] = []
        self.graph.hold_routes(now, False, after)
        moved = tuple(r.frontend for r in after if isinstance(r, RouteChange))
        records.extend(self._per_project(replace(hold, held=moved)))
        records.extend(after)

    def _per_project(self, hold: Hold) -> list[Record]:
        """A Hold record for each project with a consumer front end (each
        project's log says its routes were held)."""
        projects = sorted({ResourcePath.parse(f).project for f in self.route_table().routes})
        return [replace(hold, project=p) for p in projects] or [hold]

    def set_storm_settings(self, settings: StormSettings) -> None:
        self.storms.settings = settings

    def holds(self) -> list[Hold]:
        """The failover storm hold in effect (none, or one)."""
        return [self.storms.hold] if self.storms.hold is not None else []

    def release_hold(self, now: float, hold_id: str, actor: str) -> list[Record] | None:
        """An admin releases a hold (None: no such hold in effect)."""
        hold = self.storms.release(now, hold_id, actor)
        if hold is None:
            return None
        records: list[Record] = []
        self._let_go(now, hold, records)
        return records

    @property
    def generation(self) -> int:
        """Moves on whenever a route or any backend service's set of HEALTHY
        (or of all) endpoints may have changed: readers that derive something
        from those (the data plane's per-request choice) rebuild it when this
        differs from what they saw, and read nothing else."""
        return self.table.generation + self.graph.generation + self._applies

    # ------------------------------------------------------------------ resources

    def apply(self, resources: Iterable[Resource], now: float) -> ApplyResult:
        """Make the engine's world the given complete set of (valid)
        resources (what changed is found by comparing: :meth:`apply_change`
        is told it, and costs what it changes)."""
        with gc_paused():  # (a large world: healthgate/gcpause.py)
            new = {r.path: r for r in resources}
            old = self._resources
            changed = {p for p, r in new.items() if old.get(p) != r}
            changed |= {p for p in old if p not in new}
            return self._apply(new, changed, now)

    def apply_change(
        self, world: Mapping[ResourcePath, Resource], changed: Collection[ResourcePath], now: float
    ) -> ApplyResult:
        """The world moved on by a change: ``world`` is all of it after the
        change (read-only; the mirror's own view, which the engine keeps and
        reads from then on), ``changed`` every path the change put or
        deleted. The work is the change's (model/change.py)."""
        if not changed:
            self._resources = world
            return ApplyResult()
        return self._apply(world, changed, now)

    def _apply(
        self, world: Mapping[ResourcePath, Resource], changed: Collection[ResourcePath], now: float
    ) -> ApplyResult:
        self._resources = world
        result = ApplyResult()
        rebuilt = self.table.sync(now, world, changed, result)
        self.graph.sync(now, world, changed, rebuilt, result.records)
        self.passive.sync(now, world, changed)
        if self.storms.on and result.removed_paths:
            for path in result.removed_paths:
                self.storms.forget(path)
            hold = self.storms.check(now, self.table.endpoint_count())
            if hold is not None and hold.phase is not HoldPhase.HELD:
                self._let_go(now, hold, result.records)
        self._applies += 1  # (whatever changed, readers re-derive)
        return result

    def observe_traffic(self, now: float, hops: Mapping[Address, Hops]) -> PassiveResult:
        """One second of this node's real traffic, per upstream address
        (health/passive.py): ejections, returns, and the traffic sources'
        verdicts - with their records."""
        return self.passive.observe(now, hops)

    def set_traffic(self, now: float, source: str, state: HealthState, reason: str) -> list[Record]:
        """A TRAFFIC source's state, as the cluster's quorum decided it."""
        return self.passive.set_traffic(now, source, state, reason)

    def ejected(self, backend_service: ResourcePath) -> Mapping[EndpointKey, float]:
        """The endpoints of a backend service ejected from real traffic, until when."""
        return self.table.ejected(backend_service)

    def expire_shifts(self, now: float) -> list[Record]:
        """Shifts that ran out by ``now``: their end and the routes that
        change, each recorded at the shift's own ``expireTime``."""
        records: list[Record] = []
        self.graph.expire_shifts(now, records)
        return records

    def next_shift_expiry(self, now: float) -> float | None:
        """When the next active shift runs out (None: none is active)."""
        return self.graph.next_shift_expiry(now)

    def next_report_expiry(self) -> float | None:
        """When the next pushed endpoint's TTL runs out (health/pushed.py)."""
        return self.table.pushed.next_expiry()

    def expire_reports(self, now: float) -> list[Record]:
        """Pushed endpoints whose TTL ran out by ``now``: UNHEALTHY, each at
        the time it ran out, and what that changes above them."""
        return self.table.pushed.expire(now)

    def next_ramp_step(self, now: float) -> float | None:
        """When a ramped failback in progress next moves its shares (None: none)."""
        return self.graph.next_ramp_step(now)

    def step_ramps(self, now: float) -> list[Record]:
        """Ramps moved on to ``now``: the records of those that ended (at
        their own end time); steps in between change shares, not the log."""
        records: list[Record] = []
        self.graph.step_ramps(now, records)
        return records

    def abandon_ramp(
        self, now: float, frontend: str, neg: str, total: int, failed: int
    ) -> list[Record]:
        """The data plane saw a ramping NEG fail too many of its requests
        (controlplane/ramp_gate.py): the ramp is abandoned and starts again
        a success window later. The records (none: it was not ramping)."""
        records: list[Record] = []
        self.graph.abandon_ramp(now, frontend, neg, total, failed, records)
        return records

    def failover_order(self, frontend: str) -> list[tuple[Candidate, str]]:
        """A consumer front end's PSC NEGs in failover order, each with its
        service attachment's path (health/graph.py)."""
        return self.graph.failover_order(frontend)

    def neg_accepted(self, neg: str) -> bool | None:
        """Was a PSC NEG's connection accepted by its attachment (None: no such NEG)?"""
        return self.graph.neg_accepted(neg)

    def shifts(self) -> Sequence[Shift]:
        """Every Shift resource, active or run out (in path order)."""
        return self.graph.shifts()

    def attachment_of(self, neg: str) -> str | None:
        """The service attachment a PSC NEG reaches (None: no such NEG)."""
        return self.graph.attachment_of(neg)

    def gated_ramps(self, now: float) -> dict[str, tuple[float, list[str]]]:
        """Front end -> (failbackMaxErrorPercent, its NEGs ramping now)."""
        return self.graph.gated_ramps(now)

    def ramp_seconds(self, frontend: str) -> int:
        """The failbackRampSec of a consumer front end's backend service (0: none)."""
        return self.graph.ramp_seconds(frontend)

    def ramps(self) -> dict[str, dict[str, float]]:
        """Ramped failbacks in progress: front end -> {NEG path: start time}."""
        return self.graph.ramps()

    def restore(
        self,
        now: float,
        endpoints: Mapping[str, tuple[HealthState, float]],
        nodes: Mapping[str, tuple[HealthState, str, float]],
        routes: Mapping[str, Route],
        ramps: Mapping[str, Mapping[str, float]] | None = None,
    ) -> list[Record]:
        """Resume from persisted states (fail static across restarts).

        ``endpoints`` maps endpoint paths, ``nodes`` source / composite / NEG
        paths, ``routes`` front-end paths to what was last known. Entries for
        things that no longer exist are ignored. Everything is then
        re-evaluated once: only real differences produce records.
        """
        self.table.restore(endpoints)
        return self.graph.restore(now, nodes, routes, ramps or {})

    # ------------------------------------------------------------------ queries

    @property
    def resources(self) -> Mapping[ResourcePath, Resource]:
        return MappingProxyType(self._resources)

    def route_table(self) -> RouteTable:
        return self.graph.route_table()

    def targets(self, only: Container[int] | None = None) -> Iterator[ProbeTarget]:
        return self.table.targets(only)

    def endpoint_count(self) -> int:
        return self.table.endpoint_count()

    def slot_of(self, backend_service: ResourcePath, ip: str, port: int | None) -> int | None:
        return self.table.slot_of(backend_service, ip, port)

    def endpoint_path(self, slot: int) -> str:
        return self.table.endpoint_path(slot)

    def last_probe_ok(self, backend_service: ResourcePath) -> list[tuple[EndpointKey, bool]]:
        return self.table.last_probe_ok(backend_service)

    def endpoints(self, backend_service: ResourcePath) -> list[EndpointStatus]:
        return self.table.endpoints(backend_service)

    def healthy_endpoints(self, backend_service: ResourcePath) -> tuple[EndpointKey, ...]:
        return self.table.healthy_endpoints(backend_service)

    def all_endpoints(self, backend_service: ResourcePath) -> tuple[EndpointKey, ...]:
        return self.table.all_endpoints(backend_service)

    def counts(self, backend_service: ResourcePath) -> Counts | None:
        return self.table.counts(backend_service)

    def backend_services(self) -> list[ResourcePath]:
        return self.table.backend_services()

    def node_states(self) -> Iterator[tuple[str, NodeStatus]]:
        return self.graph.node_states()

    def knows(self, path: str) -> bool:
        """Is there an endpoint, source, composite, attachment, NEG or front end of this path?"""
        return self.graph.knows(path) or self.table.slot_of_path(path) is not None

    def node_status(self, path: ResourcePath | str) -> NodeStatus | None:
        return self.graph.node_status(path)

    def destination_state(self, forwarding_rule: ResourcePath | str) -> NodeStatus | None:
        return self.graph.destination_state(forwarding_rule)
