"""Listeners in worker processes: every core serves traffic.

With ``serve --dataplane-workers N`` the serving process opens no listener
itself. It starts N worker processes (process/run.py runs this module's ``worker_main``);
each opens *every* listener with ``SO_REUSEPORT``, so the kernel spreads new
connections (and UDP flows) over them, and each runs the same
:class:`~healthgate.dataplane.manager.DataPlane` as the serving process would,
over a snapshot of health instead of the engine.

The serving process is the only source of truth. It sends each worker
typed messages over the worker's stdin (process/frames.py; the workers are
supervised by process/supervisor.py, as the probe workers are):

* ``Setup`` once, then ``Resources`` whenever they change (the listeners
  follow, as in-process);
* ``Health``: the route table and, for every backend service behind a
  producer rule, its HEALTHY and all endpoints - after every batch of
  transitions, sent at once (a burst within one event-loop turn: once more
  at its end), and only when something the listeners read has changed.

Each worker reports its listeners' counters and its propagation histogram
(``Stats``) on its stdout once a second; the serving process adds them up
for ``/metrics`` and the forwarding rules' ``status.listener``. A worker
whose stdin closes (the serving process stops, or is gone) closes its
listeners - open connections get the grace the serving process was given -
and exits, so no worker outlives it; a worker that dies is started again
(with a backoff), and gets the current resources and health first.
Propagation to a worker costs one pipe write and a wake-up (well under a
millisecond here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from healthgate.dataplane.manager import (
    PROPAGATION_BUCKETS,
    AppliedHook,
    DataPlane,
    DataPlaneSettings,
    UpstreamTotal,
    upstream_view,
)
from healthgate.health.engine import EndpointKey, HealthEngine, RouteTable
from healthgate.health.evidence import Hops
from healthgate.health.types import Route
from healthgate.model.change import WorldChange
from healthgate.model.names import ResourcePath
from healthgate.model.resources import ForwardingRule, Resource
from healthgate.model.validation import resource_from_wire
from healthgate.process.frames import (
    expect,
    message,
    read_frame,
    register_model,
    stdio_streams,
    write,
)
from healthgate.process.supervisor import Supervisor

log = logging.getLogger("healthgate.dataplane")

STATS_INTERVAL = 1.0
SENT_KEPT = 64  # snapshots remembered with the generations they carried
MODULE = "healthgate.dataplane.workers"

Address = tuple[str, int]
BackendEndpoints = dict[ResourcePath, tuple[tuple[EndpointKey, ...], ...]]


# ---------------------------------------------------------------- messages

# resources in messages: their wire form, parsed again by the reader
register_model(Resource, Resource.to_wire, resource_from_wire)


@message
@dataclass(frozen=True, slots=True)
class Setup:
    settings: DataPlaneSettings
    grace: float  # on stop, open connections get this long


@message
@dataclass(frozen=True, slots=True)
class Resources:
    """The whole world: a worker's first (its changes follow, never it again)."""

    resources: dict[ResourcePath, Resource]


@message
@dataclass(frozen=True, slots=True)
class Changes:
    """What one commit changed (model/change.py)."""

    revision: int
    put: list[Resource]
    deleted: list[ResourcePath]


@message
@dataclass(frozen=True, slots=True)
class Health:
    """What a worker's listeners read of health (see :func:`health_snapshot`)."""

    version: int
    routes: dict[str, Route]
    published: float
    endpoints: BackendEndpoints


@message
@dataclass(frozen=True, slots=True)
class Stats:
    status: dict[str, dict[str, Any]]
    propagation: list[int]
    propagation_sum: float
    # (listener, upstream, what its hops came to since the last Stats)
    hops: list[tuple[str, tuple[str, int], Hops]] = field(default_factory=list)
    tripped: bool = False  # sent early: a run of errors reached an outlier threshold


@message
@dataclass(frozen=True, slots=True)
class Applied:
    """A worker took the health snapshot of ``version``: its listeners for
    ``serving`` route by it from now on (SPEC §11: convergence receipts)."""

    version: int
    serving: list[str]


@message
@dataclass(frozen=True, slots=True)
class ResetRuns:
    """Upstreams just ejected (health/outliers.py): their runs start again."""

    addresses: list[tuple[str, int]]


def health_snapshot(engine: HealthEngine, resources: Mapping[ResourcePath, Resource]) -> Health:
    """What a worker's listeners read of health, as plain data (process/frames.py)."""
    table = engine.route_table()
    endpoints: BackendEndpoints = {}
    for res in resources.values():
        if isinstance(res, ForwardingRule) and not res.is_global:
            bs = res.ref("backend_service")
            if bs is not None and bs not in endpoints:
                endpoints[bs] = (engine.healthy_endpoints(bs), engine.all_endpoints(bs))
    return Health(table.version, dict(table.routes), table.published, endpoints)


# ---------------------------------------------------------------- serving side


class _Counts:
    def __init__(self) -> None:
        self.stats: dict[str, dict[str, object]] = {}  # per listener: its status and events
        self.propagation = [0] * (len(PROPAGATION_BUCKETS) + 1)
        self.propagation_sum = 0.0
        self.connections = 0


class WorkerPool:
    """The serving process's side: starts the workers and feeds them. Offers
    what the server uses of an in-process :class:`DataPlane`."""

    def __init__(
        self, engine: HealthEngine, settings: DataPlaneSettings, grace: float = 2.0
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.grace = grace
        self.counts = [_Counts() for _ in range(settings.workers)]
        # what the workers' hops came to, per listener and upstream: since
        # the last take_hops, and in all (for /metrics)
        self._hops: dict[str, dict[Address, Hops]] = {}
        self._totals: dict[str, dict[Address, list[Any]]] = {}
        self._trip: Callable[[], None] | None = None
        self._resources: Mapping[ResourcePath, Resource] = {}
        self._last_health: Health | None = None
        self._publish_pending = False
        self._publish_dirty = False
        # SPEC §11: the generations each snapshot sent carried (the last ones)
        self.on_applied: AppliedHook | None = None
        self._sent: dict[int, dict[str, int]] = {}
        self.supervisor = Supervisor(
            "data-plane worker", MODULE, settings.workers, self._take, self._greeting
        )

    def _greeting(self, index: int) -> list[object]:
        return [
            Setup(self.settings, self.grace),
            Resources(dict(self._resources)),
            self._sending(health_snapshot(self.engine, self._resources)),
        ]

    def _sending(self, snapshot: Health) -> Health:
        self._sent[snapshot.version] = {f: r.generation for f, r in snapshot.routes.items()}
        while len(self._sent) > SENT_KEPT:
            del self._sent[next(iter(self._sent))]
        return snapshot

    # -- what the server calls
    async def start(self) -> None:
        await self.supervisor.start()

    async def apply_change(self, change: WorldChange) -> None:
        """Every worker is told what the commit changed (a new world: all
        of it); a worker started later is given the world as it is then."""
        self._resources = change.world
        if change.whole:
            self.supervisor.broadcast(Resources(dict(change.world)))
        else:
            put, deleted = list(change.put.values()), list(change.deleted)
            self.supervisor.broadcast(Changes(change.revision, put, deleted))
        self._last_health = None
        self.publish_health()

    def routes_changed(self, _frontends: list[str]) -> None:
        """(Workers see route changes in the health they are sent, and drain
        their own connections.)"""

    def publish_health(self) -> None:
        """Send the current health to every worker at once (a route change
        waits for nothing); further calls in the same event-loop turn - a
        burst of transitions in one probe tick - become one more send at the
        end of the turn, so a storm costs two snapshots, not one per record."""
        if self._publish_pending:
            self._publish_dirty = True
            return
        self._publish()
        self._publish_pending = True
        asyncio.get_running_loop().call_soon(self._end_of_turn)

    def _end_of_turn(self) -> None:
        self._publish_pending = False
        if self._publish_dirty:
            self._publish_dirty = False
            self._publish()

    def _publish(self) -> None:
        snapshot = health_snapshot(self.engine, self._resources)
        if snapshot == self._last_health:
            return
        self._last_health = snapshot
        self.supervisor.broadcast(self._sending(snapshot))

    async def close(self, grace: float = 0.0) -> None:
        await self.supervisor.close(grace + 5.0)

    def _take(self, index: int, message: object) -> None:
        if isinstance(message, Applied):
            generations = self._sent.get(message.version)
            if generations is not None and self.on_applied is not None:
                held = {f: generations[f] for f in message.serving if f in generations}
                self.on_applied(f"worker-{index}", held)
            return
        m = expect(message, Stats)
        if m is None:
            return
        for path, address, hops in m.hops:
            per_listener = self._hops.setdefault(path, {})
            before = per_listener.get(address)
            per_listener[address] = hops if before is None else before.plus(hops)
            total = self._totals.setdefault(path, {}).setdefault(address, [0, 0, {}])
            total[0] += hops.served
            total[1] += hops.errors
            for kind, n in hops.kinds.items():
                total[2][kind] = total[2].get(kind, 0) + n
        if m.tripped and self._trip is not None:
            self._trip()
        c = self.counts[index]
        c.stats, c.propagation, c.propagation_sum = m.status, m.propagation, m.propagation_sum
        c.connections = sum(
            int(s.get("connections", 0))  # type: ignore[call-overload]
            for s in c.stats.values()
        )

    def pids(self) -> list[int]:
        return self.supervisor.pids()

    # -- what /metrics and the API read
    @property
    def propagation(self) -> list[int]:
        return [sum(col) for col in zip(*(c.propagation for c in self.counts), strict=True)]

    @property
    def propagation_sum(self) -> float:
        return sum(c.propagation_sum for c in self.counts)

    def take_hops(self) -> dict[str, dict[Address, Hops]]:
        """Per listener, what the workers' hops of each upstream came to since
        the last call (each worker reports once a second)."""
        out, self._hops = self._hops, {}
        return out

    def reset_runs(self, addresses: Iterable[Address]) -> None:
        wanted = list(addresses)
        if wanted:
            self.supervisor.broadcast(ResetRuns(wanted))

    def on_trip(self, hook: Callable[[], None]) -> None:
        self._trip = hook

    def upstream_totals(self) -> Iterator[UpstreamTotal]:
        for path, by_address in self._totals.items():
            for address, (ok, errors, kinds) in by_address.items():
                yield path, address, ok, errors, kinds

    def listener_events(self) -> dict[str, dict[str, int]]:
        """The counters of :meth:`status`, summed over the workers."""
        return {
            path: {
                k: v for k, v in merged.items() if isinstance(v, int) and not isinstance(v, bool)
            }
            for path, merged in self.status().items()
        }

    def status(self) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        for c in self.counts:
            for path, status in c.stats.items():
                merged = out.setdefault(path, {})
                for key, value in status.items():
                    if key == "upstreams":
                        continue  # (the workers' together: from their hops, below)
                    if isinstance(value, int) and not isinstance(value, bool):
                        previous = merged.get(key, 0)
                        merged[key] = (previous if isinstance(previous, int) else 0) + value
                    elif key not in merged or (key == "error" and value):
                        merged[key] = value
        for path, merged in out.items():
            totals = self._totals.get(path, {})
            merged["upstreams"] = upstream_view((a, t[0], t[1]) for a, t in totals.items())
        return out

    def collect(self) -> Iterator[Metric]:
        """Connections per worker process (the pool is a Collector)."""
        family = CounterMetricFamily(
            "healthgate_worker_connections",
            "Connections accepted per data-plane worker",
            labels=["worker"],
        )
        for i, c in enumerate(self.counts):
            family.add_metric([str(i)], c.connections)
        yield family


# ---------------------------------------------------------------- worker side


class HealthSnapshot:
    """The health a worker's listeners read: the last one the serving process sent."""

    def __init__(self) -> None:
        self.table = RouteTable(0, {})
        self.endpoints: BackendEndpoints = {}
        self.generation = 0  # one per snapshot received

    def route_table(self) -> RouteTable:
        return self.table

    def healthy_endpoints(self, backend_service: ResourcePath) -> tuple[EndpointKey, ...]:
        entry = self.endpoints.get(backend_service)
        return entry[0] if entry else ()

    def all_endpoints(self, backend_service: ResourcePath) -> tuple[EndpointKey, ...]:
        entry = self.endpoints.get(backend_service)
        return entry[1] if entry else ()


async def run_worker(index: int) -> None:
    reader, writer = await stdio_streams()
    view = HealthSnapshot()
    setup = expect(await read_frame(reader), Setup)
    if setup is None:
        return
    dp = DataPlane(view, setup.settings)

    def stats(tripped: bool = False) -> Stats:
        hops = [(path, a, h) for path, per in dp.take_hops().items() for a, h in per.items()]
        return Stats(dp.status(), dp.propagation, dp.propagation_sum, hops, tripped)

    async def report() -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL)
            write(writer, stats())

    early: list[asyncio.Handle] = []

    def tripped() -> None:  # (an outlier threshold reached: report now, once per turn)
        if not early:
            early.append(asyncio.get_running_loop().call_soon(report_now))

    def report_now() -> None:
        early.clear()
        write(writer, stats(tripped=True))

    dp.on_trip(tripped)

    reporter = asyncio.get_running_loop().create_task(report())
    world: dict[ResourcePath, Resource] = {}  # this worker's mirror
    try:
        while (message := await read_frame(reader)) is not None:
            m = expect(message, Resources, Changes, Health, ResetRuns)
            if isinstance(m, ResetRuns):
                dp.reset_runs([(str(ip), int(port)) for ip, port in m.addresses])
            elif isinstance(m, Resources):
                world = dict(m.resources)
                await dp.apply_change(WorldChange(0, 0.0, world, world, whole=True))
            elif isinstance(m, Changes):
                for path in m.deleted:
                    world.pop(path, None)
                put = {r.path: r for r in m.put}
                world.update(put)
                await dp.apply_change(
                    WorldChange(m.revision, 0.0, world, put, frozenset(m.deleted))
                )
            elif isinstance(m, Health):
                before = view.table.routes
                view.table = RouteTable(m.version, m.routes, m.published)
                view.endpoints = m.endpoints
                view.generation += 1
                changed = [f for f, r in m.routes.items() if before.get(f) != r]
                dp.routes_changed(changed)  # (with none: slow start's look at who joined)
                write(writer, Applied(m.version, dp.serving()))
    finally:
        reporter.cancel()
        await asyncio.gather(reporter, return_exceptions=True)
        await dp.close(setup.grace)
        write(writer, stats())
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        log.info("data-plane worker %d stopped", index)


def worker_main(index: int) -> None:
    """A worker process's work (process/run.py starts it, set up)."""
    import uvloop

    uvloop.run(run_worker(index))
