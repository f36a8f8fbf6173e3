"""Probing on every core: worker processes that each own a shard of endpoints.

``serve --probe-workers N`` runs the probes in N processes (a
:class:`ProbePool`, supervised by process/supervisor.py). Each worker holds
the whole world in a *prober* engine of its own (as a cluster node does),
probes the endpoints it is given that rendezvous hashing (health/placement.py,
the same function that shares endpoints among a cluster's nodes) puts in its
shard, runs the threshold machine on them, and sends only their **flips**, a
tick's worth at a time (and, over every 10 seconds, what it observed of each
endpoint - its runs and last result - for the API's details: a slow side
path, not per probe: every second up to 2,000 endpoints, a tenth of the
shard a second above that), the probe failures to log (at most the owner's
rate), and its running totals every second. What the pool is given to probe
is the owner's choice: every endpoint (:class:`WorkerProbing`, the embedded
server: a flip is a decided state for the serving engine's feed,
controlplane/probing.py), or a cluster node's share (cluster/probing.py: a
flip becomes the node's opinion, as its own prober's flips do).

A worker that dies (``kill -9``) is started again with the world and the
current states of what it probed, so it resumes where the dead one was
(HEALTHY stays HEALTHY until the thresholds say otherwise): no transition,
no UNKNOWN.

**The pool's size follows what a worker can hold.** A kept-alive HTTP(S)
check holds a connection - a file descriptor - between probes; a worker
can hold at most its open-file limit less a reserve. When the world has
more such endpoints than the workers can hold together, the pool grows
(never shrinks), so that no endpoint starves for a descriptor; a probe that
still finds none is no result (SUSPECT), counted as skipped and logged by
the scheduler.

The messages (process/frames.py), one class each::

    owner -> worker   Setup (first), World, Assign, Shards
    worker -> owner   Flips, Observations, Failures, Totals
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from healthgate.controlplane.probing import Decided, Feed, LocalProber, spec_of
from healthgate.health.endpoints import Observed
from healthgate.health.engine import ApplyResult, HealthEngine, ProbeTarget
from healthgate.health.history import history_export
from healthgate.health.placement import rendezvous
from healthgate.health.states import HealthState, Outcome, ProbeResult, RecordKind, Transition
from healthgate.model.change import WorldChange
from healthgate.model.names import ResourcePath, endpoint_path
from healthgate.model.resources import Resource
from healthgate.model.validation import resource_from_wire
from healthgate.probes.prober import ProbeSettings
from healthgate.probes.scheduler import SchedulerSettings
from healthgate.probes.stats import FailureLogLimiter, ProbeTotals
from healthgate.process.frames import (
    expect,
    message,
    read_frame,
    register_model,
    stdio_streams,
    write,
)
from healthgate.process.limits import open_file_limit
from healthgate.process.supervisor import Supervisor

log = logging.getLogger("healthgate.probe_workers")

# a shard up to this size sends what it observed of every endpoint every second
OBSERVE_WHOLE = 2_000

# the default's most workers: each holds the whole world, and three held
# 50,000 kept-alive endpoints at 1 s in 0.7-0.8 cores (docs/benchmarks.md);
# more are there for the asking (--probe-workers N)
DEFAULT_MAX = 8
# the most workers the pool grows to, to hold kept-alive connections
GROWTH_MAX = 64
# descriptors a worker keeps for everything but kept-alive checks
# (fresh probes in flight, its pipes, the raw-SYN socket)
WORKER_RESERVE = 1024

MODULE = "healthgate.controlplane.probe_workers"

StatesOf = Callable[[Iterable[str] | None], dict[str, tuple[int, float]]]


def default_workers(clustered: bool) -> int:
    """``--probe-workers`` unset: one worker per core the process may run on
    for the embedded server, at most ``DEFAULT_MAX`` (each holds the whole
    world: ~47 MB for a small one); none on a single core (a worker there
    only adds a process and a pipe) and none for a cluster node (a cluster
    spreads its probes over nodes; a node takes workers when told to). The
    pool grows beyond this when the workers cannot hold every kept-alive
    connection (:func:`workers_to_hold`)."""
    if clustered:
        return 0
    cores = len(os.sched_getaffinity(0))
    return min(cores, DEFAULT_MAX) if cores > 1 else 0


def holds_connection(target: ProbeTarget, settings: ProbeSettings) -> bool:
    """Does this endpoint's check keep a descriptor open between probes?"""
    kind = target.check.type
    return kind == "GRPC" or (settings.keepalive and kind in ("HTTP", "HTTPS"))


def worker_capacity(fd_limit: int | None = None) -> int:
    """Kept-alive connections one worker can hold under the open-file limit."""
    return max(1, (fd_limit or open_file_limit()) - WORKER_RESERVE)


def workers_to_hold(held: int, base: int, fd_limit: int | None = None) -> int:
    """Workers needed so that ``held`` kept-alive connections fit (at least ``base``)."""
    return max(base, min(GROWTH_MAX, math.ceil(held / worker_capacity(fd_limit))))


def worker_name(index: int) -> str:
    return f"w{index}"


# ---------------------------------------------------------------------- messages

# resources in messages: their wire form, parsed again by the reader
register_model(Resource, Resource.to_wire, resource_from_wire)


@message
@dataclass(frozen=True, slots=True)
class Setup:
    """The first message to a worker: who it is and how to probe."""

    index: int
    count: int
    probe: ProbeSettings
    scheduler: SchedulerSettings
    observe_every: int  # seconds over which a large shard's observations are sent (0: never)
    failure_log_rate: float


@message
@dataclass(frozen=True, slots=True)
class World:
    """The whole world: a worker's first, and after nothing else (its changes follow)."""

    resources: list[Resource]


@message
@dataclass(frozen=True, slots=True)
class Changes:
    """What one commit changed (model/change.py): never the world again."""

    put: list[Resource]
    deleted: list[ResourcePath]


@message
@dataclass(frozen=True, slots=True)
class Assign:
    """Probe these endpoint paths (None: every endpoint); ``states``: where
    to resume a path new to a worker (path -> (state, since))."""

    paths: frozenset[str] | None
    states: dict[str, tuple[int, float]]


@message
@dataclass(frozen=True, slots=True)
class Shards:
    """The pool now has ``count`` workers: shards move (rendezvous)."""

    count: int
    states: dict[str, tuple[int, float]]


@message
@dataclass(frozen=True, slots=True)
class Flips:
    decided: list[Decided]


@message
@dataclass(frozen=True, slots=True)
class Observations:
    items: list[tuple[str, Observed]]


@message
@dataclass(frozen=True, slots=True)
class Failures:
    """Probe failures to log (at most the owner's rate), and how many more
    this worker left out since it last said."""

    lines: list[tuple[str, str]]
    left_out: int


@message
@dataclass(frozen=True, slots=True)
class Totals:
    totals: ProbeTotals


@message
@dataclass(frozen=True, slots=True)
class HistoryWanted:
    """Send the outcome history of every endpoint probed (SPEC §11: replay)."""

    request: int


@message
@dataclass(frozen=True, slots=True)
class Histories:
    """A worker's outcome histories (endpoint path -> encoded), for ``request``;
    ``truncated``: some were left out to stay under the frame's bound."""

    request: int
    items: dict[str, list[bytes]]
    truncated: bool = False


FromWorker = Flips | Observations | Failures | Totals
HISTORY_FRAME = 48 << 20  # bytes of histories one worker sends (the owner reads 64 MiB frames)


# ---------------------------------------------------------------------- the owner's side


class ProbePool:
    """N probe worker processes (the owner's side)."""

    def __init__(
        self,
        count: int,
        probe_settings: ProbeSettings,
        scheduler_settings: SchedulerSettings,
        on_flips: Callable[[Sequence[Decided]], object],
        states: StatesOf,
        on_observed: Callable[[list[tuple[str, Observed]]], None] | None = None,
        observe_every: int = 10,
        failure_log: FailureLogLimiter | None = None,
    ) -> None:
        self.probe_settings = probe_settings
        self.scheduler_settings = scheduler_settings
        self.on_flips = on_flips
        self.states = states  # the owner's current states of these paths (None: all)
        # what the probes of each endpoint showed (its runs, its last result),
        # every few seconds: the API's and the dashboard's per-endpoint details
        self.on_observed = on_observed
        self.observe_every = observe_every if on_observed is not None else 0
        # the owner's limiter: each worker sends at most its rate of failures
        # (and how many it left out), the limiter holds all of them to it
        self.failure_log = failure_log or FailureLogLimiter(0.0)
        # the world a worker started now is given: the mirror's own view (read-only)
        self._world: Mapping[ResourcePath, Resource] = {}
        self._paths: frozenset[str] | None = None  # what to probe (None: every endpoint)
        self._totals: dict[int, ProbeTotals] = {}
        self._base = ProbeTotals()  # of workers that died
        self.supervisor = Supervisor(
            "probe worker",
            MODULE,
            count,
            self._take,
            self._greeting,
            on_exit=self._lost,
            prefix="w",
        )
        self._growing: asyncio.Task[None] | None = None
        # history requests in flight: request -> worker index -> its answer
        self._request = 0
        self._wanted: dict[int, dict[int, asyncio.Future[tuple[dict[str, list[bytes]], bool]]]] = {}

    @property
    def count(self) -> int:
        return len(self.supervisor.workers)

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self.supervisor.workers)

    def _greeting(self, index: int) -> list[object]:
        return [
            Setup(
                index,
                self.count,
                self.probe_settings,
                self.scheduler_settings,
                self.observe_every,
                self.failure_log.rate,
            ),
            World(list(self._world.values())),
            Assign(self._paths, self.states(self._paths)),
        ]

    async def start(self) -> None:
        await self.supervisor.start()

    def change(self, change: WorldChange) -> None:
        """A commit: every worker is told what it changed (a worker started
        later gets the world as it is then)."""
        self._world = change.world
        if change.whole:
            self.supervisor.broadcast(World(list(change.world.values())))
        else:
            self.supervisor.broadcast(Changes(list(change.put.values()), list(change.deleted)))

    def assign(self, paths: Iterable[str] | None) -> None:
        """Probe these endpoint paths (None: every endpoint of the world). A
        path new to the pool resumes from the owner's state of it."""
        chosen = None if paths is None else frozenset(paths)
        if chosen == self._paths and chosen is not None:
            return
        new = None if chosen is None or self._paths is None else chosen - self._paths
        self._paths = chosen
        self.supervisor.broadcast(Assign(chosen, self.states(new)))

    def hold(self, held: int, base: int) -> None:
        """``held`` endpoints keep a connection open between probes: grow the
        pool if its workers cannot hold them all (see the module doc)."""
        wanted = workers_to_hold(held, base)
        if wanted <= self.count or self.supervisor.closing:
            return
        if self._growing is not None and not self._growing.done():
            return
        log.warning(
            "%d endpoints keep a connection open between probes: more than %d probe workers "
            "hold under the open-file limit (%d each); starting %d",
            held,
            self.count,
            worker_capacity(),
            wanted,
        )
        self._growing = asyncio.get_running_loop().create_task(self._grow(wanted))

    async def _grow(self, count: int) -> None:
        await self.supervisor.grow(count)
        # every worker re-places its shard over the new count; what moves
        # resumes from the owner's states
        self.supervisor.broadcast(Shards(self.count, self.states(self._paths)))

    def _lost(self, index: int) -> None:
        last = self._totals.pop(index, None)
        if last is not None:
            self._base.add(last)

    async def histories(self, timeout: float = 10.0) -> tuple[dict[str, list[bytes]], bool]:
        """Every worker's outcome histories together (SPEC §11), and whether
        any was cut short (a worker that does not answer in time: left out)."""
        self._request += 1
        request = self._request
        loop = asyncio.get_running_loop()
        waiting = self._wanted[request] = {
            i: loop.create_future() for i in range(len(self.supervisor.workers))
        }
        try:
            for i in waiting:
                self.supervisor.send(i, HistoryWanted(request))
            done, _ = await asyncio.wait(waiting.values(), timeout=timeout)
        finally:
            self._wanted.pop(request, None)
        out: dict[str, list[bytes]] = {}
        truncated = len(done) < len(waiting)
        for future in done:
            items, cut = future.result()
            truncated |= cut
            for path, data in items.items():
                out.setdefault(path, []).extend(data)
        return out, truncated

    def _take(self, index: int, message: object) -> None:
        if isinstance(message, Histories):
            future = self._wanted.get(message.request, {}).get(index)
            if future is not None and not future.done():
                future.set_result((message.items, message.truncated))
            return
        m = expect(message, Flips, Observations, Failures, Totals)
        if isinstance(m, Flips):
            self.on_flips(m.decided)
        elif isinstance(m, Observations):
            if self.on_observed is not None:
                self.on_observed(m.items)
        elif isinstance(m, Failures):
            failure_log = self.failure_log
            for path, description in m.lines:
                failure_log.failed(path, description)
            failure_log.suppressed += m.left_out
        elif isinstance(m, Totals):
            self._totals[index] = m.totals

    def totals(self) -> ProbeTotals:
        total = ProbeTotals()
        for report in (self._base, *self._totals.values()):
            total.add(report)
        return total

    def pids(self) -> list[int]:
        return self.supervisor.pids()

    async def close(self) -> None:
        if self._growing is not None:
            self._growing.cancel()
        await self.supervisor.close(grace=2.0)


class WorkerProbing:
    """The embedded server's probe source: every endpoint probed by the
    workers, their flips decided states for the serving engine's feed."""

    def __init__(
        self,
        feed: Feed,
        workers: int,
        probe_settings: ProbeSettings | None = None,
        scheduler_settings: SchedulerSettings | None = None,
        failure_log: FailureLogLimiter | None = None,
    ) -> None:
        self.feed = feed
        self.base = workers
        self._holding: set[int] = set()
        self.probe_settings = probe_settings or ProbeSettings()
        self.pool = ProbePool(
            workers,
            self.probe_settings,
            scheduler_settings or SchedulerSettings(),
            feed.states,
            self._states,
            feed.observed,
            failure_log=failure_log,
        )

    def _states(self, paths: Iterable[str] | None) -> dict[str, tuple[int, float]]:
        """The current states of every endpoint that has one (the pool
        probes every endpoint: a new path starts from UNKNOWN anyway)."""
        out: dict[str, tuple[int, float]] = {}
        engine = self.feed.engine
        for bs in engine.backend_services():
            for ep in engine.endpoints(bs):
                if ep.state is not HealthState.UNKNOWN:
                    out[endpoint_path(bs, ep.ip, ep.port)] = (int(ep.state), ep.since)
        return out

    def apply(self, change: WorldChange, result: ApplyResult) -> None:
        self.pool.change(change)
        settings = self.probe_settings
        holding = self._holding  # slots whose endpoint keeps a connection open
        for slot in result.removed:
            holding.discard(slot)
        for target in (*result.added, *result.changed):
            if holds_connection(target, settings):
                holding.add(target.slot)
            else:
                holding.discard(target.slot)
        self.pool.hold(len(holding), self.base)

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()

    def totals(self) -> ProbeTotals:
        return self.pool.totals()

    def pids(self) -> list[int]:
        return self.pool.pids()

    async def histories(self) -> tuple[dict[str, list[bytes]], bool]:
        return await self.pool.histories()

    def vantages(self, endpoint_path: str) -> tuple[str, dict[str, dict[str, object]]] | None:
        return None


# ---------------------------------------------------------------------- the worker


class _Worker:
    """A probe worker's state: its shard of the world, probed in-process."""

    def __init__(self, setup: Setup, writer: asyncio.StreamWriter) -> None:
        self.setup = setup
        self.writer = writer
        self.names = [worker_name(i) for i in range(setup.count)]
        self.me = worker_name(setup.index)
        self.engine = HealthEngine()
        self.resources: dict[ResourcePath, Resource] = {}  # this worker's mirror of the world
        self.mine: dict[int, str] = {}  # slot -> endpoint path
        self.given: list[frozenset[str] | None] = []  # what to probe, once told
        self.failures: list[tuple[str, str]] = []
        self.left_out = 0  # failures not sent (the limiter's count when last sent)
        self.local = LocalProber(
            self._results,
            self.engine.endpoint_path,
            setup.probe,
            setup.scheduler,
            FailureLogLimiter(0.0),  # (failures are sent to the owner, who logs them)
        )
        self.failure_log = FailureLogLimiter(setup.failure_log_rate)

    def _results(self, now: float, results: Sequence[tuple[int, ProbeResult]]) -> None:
        failure_log = self.failure_log
        if failure_log.rate:
            for key, result in results:
                if (
                    result.outcome is not Outcome.OK
                    and result.outcome is not Outcome.DEGRADED
                    and failure_log.allow()
                ):
                    self.failures.append((self.engine.endpoint_path(key), result.describe()))
            if self.failures:
                self._send(Failures(list(self.failures), failure_log.suppressed - self.left_out))
                self.left_out = failure_log.suppressed
                self.failures.clear()
        records = self.engine.on_results(now, results)
        table = self.engine.table
        flips = []
        for r in records:
            if isinstance(r, Transition) and r.kind is RecordKind.ENDPOINT:
                slot = table.slot_of_path(r.path)
                if slot is not None:
                    flips.append(Decided(r.path, r.current, r.time, r.reason, table.observed(slot)))
        if flips:
            self._send(Flips(flips))

    def _send(self, message: FromWorker) -> None:
        write(self.writer, message)

    def place(self, states: dict[str, tuple[int, float]], changed: set[int]) -> None:
        """Probe the given endpoints of this worker's shard; stop the rest."""
        if not self.given:
            return  # (the first Assign follows the world at once)
        paths = self.given[0]
        scheduler = self.local.scheduler
        table = self.engine.table
        seen = set()
        for t in self.engine.targets():
            path = endpoint_path(t.backend_service, t.ip, t.port)
            if (paths is not None and path not in paths) or rendezvous(path, self.names) != self.me:
                continue
            seen.add(t.slot)
            if t.slot not in self.mine:
                resumed = states.get(path)
                if resumed is not None:  # a worker started again, a share moved: go on from there
                    table.set_state(resumed[1], t.slot, HealthState(resumed[0]), "resumed")
                else:  # not a state left from an earlier time this worker probed it
                    table.set_state(time.time(), t.slot, HealthState.UNKNOWN, "assigned")
                self.mine[t.slot] = path
                scheduler.upsert(t.slot, spec_of(t))
            elif t.slot in changed:
                scheduler.upsert(t.slot, spec_of(t))
        for slot in [s for s in self.mine if s not in seen]:
            del self.mine[slot]
            self.local.remove(slot)

    def world(self, resources: list[Resource]) -> None:
        """The whole world (at the start): placed whole."""
        self.resources = {r.path: r for r in resources}
        result = self.engine.apply_change(self.resources, set(self.resources), time.time())
        for slot in result.removed:
            self.local.remove(slot)
            self.mine.pop(slot, None)
        self.place({}, {t.slot for t in result.changed})
        self._freeze()

    def changes(self, put: list[Resource], deleted: list[ResourcePath]) -> None:
        """One commit: only what it added, changed or removed is placed."""
        world = self.resources
        for path in deleted:
            world.pop(path, None)
        for res in put:
            world[res.path] = res
        changed = {r.path for r in put} | set(deleted)
        result = self.engine.apply_change(world, changed, time.time())
        scheduler = self.local.scheduler
        for slot in result.removed:
            if self.mine.pop(slot, None) is not None:
                self.local.remove(slot)
        if not self.given:
            return  # (the first Assign places everything)
        for target in result.added:
            self._place_one(target, {})
        for target in result.changed:
            if target.slot in self.mine:
                scheduler.upsert(target.slot, spec_of(target))

    def _place_one(self, target: ProbeTarget, states: dict[str, tuple[int, float]]) -> None:
        paths = self.given[0]
        path = endpoint_path(target.backend_service, target.ip, target.port)
        if (paths is not None and path not in paths) or rendezvous(path, self.names) != self.me:
            return
        resumed = states.get(path)
        table = self.engine.table
        if resumed is not None:  # a worker started again, a share moved: go on from there
            table.set_state(resumed[1], target.slot, HealthState(resumed[0]), "resumed")
        else:  # not a state left from an earlier time this worker probed it
            table.set_state(time.time(), target.slot, HealthState.UNKNOWN, "assigned")
        self.mine[target.slot] = path
        self.local.scheduler.upsert(target.slot, spec_of(target))

    def _freeze(self) -> None:
        # the world's objects live as long as it does: out of the collector's
        # sight, a full collection of a large one would stall probes by tens of
        # ms (unfrozen first, so that the last world's cycles are collected)
        gc.unfreeze()
        gc.collect()
        gc.freeze()

    def assign(self, paths: frozenset[str] | None, states: dict[str, tuple[int, float]]) -> None:
        self.given[:] = [paths]
        self.place(states, set())

    def shards(self, count: int, states: dict[str, tuple[int, float]]) -> None:
        self.names = [worker_name(i) for i in range(count)]
        self.place(states, set())

    async def report(self) -> None:
        """Totals every second; observations of (part of) the shard too."""
        seconds = 0
        every_seconds = self.setup.observe_every
        while True:
            await asyncio.sleep(1.0)
            seconds += 1
            self._send(Totals(self.local.totals()))
            suppressed = self.failure_log.suppressed
            if suppressed > self.left_out:
                self._send(Failures([], suppressed - self.left_out))
                self.left_out = suppressed
            if every_seconds:
                # a small shard whole every second; a large one a tenth
                # (say) of it a second, not all at once
                every = every_seconds if len(self.mine) > OBSERVE_WHOLE else 1
                part = seconds % every
                table = self.engine.table
                self._send(
                    Observations(
                        [(p, table.observed(s)) for s, p in self.mine.items() if s % every == part]
                    )
                )


async def run_worker() -> None:
    """A probe worker process: its shard of the endpoints, until its stdin ends."""
    reader, writer = await stdio_streams()
    setup = expect(await read_frame(reader), Setup)
    if setup is None:
        return
    worker = _Worker(setup, writer)
    worker.local.start()
    reporter = asyncio.create_task(worker.report())
    try:
        while (message := await read_frame(reader)) is not None:
            m = expect(message, World, Changes, Assign, Shards, HistoryWanted)
            if isinstance(m, HistoryWanted):
                items, cut = history_export(worker.local.history, HISTORY_FRAME)
                write(writer, Histories(m.request, items, cut))
            elif isinstance(m, World):
                worker.world(m.resources)
            elif isinstance(m, Changes):
                worker.changes(m.put, m.deleted)
            elif isinstance(m, Assign):
                worker.assign(m.paths, m.states)
            elif isinstance(m, Shards):
                worker.shards(m.count, m.states)
    finally:
        reporter.cancel()
        await asyncio.gather(reporter, return_exceptions=True)
        await worker.local.close()
        with contextlib.suppress(ConnectionError):
            await writer.drain()


def worker_main(index: int) -> None:
    """A worker process's work (process/run.py starts it, set up)."""
    import uvloop

    uvloop.run(run_worker())
