"""Probing on every core: worker processes that each own a shard of endpoints.

``serve --probe-workers N`` runs the probes in N processes (a
:class:`ProbePool`, supervised by process/supervisor.py). The owner shards
what it probes over the workers by rendezvous hashing (health/placement.py,
the same function that shares endpoints among a cluster's nodes) and gives
each worker its shard - endpoint paths and their backend services' checks,
then only what a change moves (:class:`Probe`), never the world. A worker
holds its shard alone, in a prober table (health/probed.py: the serving
engine's threshold machine, nothing above it), probes it, and sends only
the endpoints' **flips**, a
tick's worth at a time (and, over every 10 seconds, what it observed of each
endpoint - its runs and last result - for the API's details: a slow side
path, not per probe: every second up to 2,000 endpoints, a tenth of the
shard a second above that), the probe failures to log (at most the owner's
rate), and its running totals every second. What the pool is given to probe
is the owner's choice: every endpoint (:class:`WorkerProbing`, the embedded
server: a flip is a decided state for the serving engine's feed,
controlplane/probing.py), or a cluster node's share (cluster/probing.py: a
flip becomes the node's opinion, as its own prober's flips do).

A worker that dies (``kill -9``) is started again with its shard and the
owner's current states of it, so it resumes where the dead one was
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

    owner -> worker   Setup (first), Probe, HistoryWanted
    worker -> owner   Flips, Observations, Failures, Totals, Histories
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
from healthgate.health.engine import ApplyResult, ProbeTarget
from healthgate.health.history import history_export
from healthgate.health.placement import rendezvous
from healthgate.health.probed import CheckOf, ProbedTable, flips
from healthgate.health.states import HealthState, Outcome, ProbeResult
from healthgate.health.types import NO_SECRETS
from healthgate.model.change import WorldChange
from healthgate.model.names import ResourcePath, endpoint_path
from healthgate.model.resources import HealthCheck, Resource
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

# a Probe putting this many endpoints or more is followed by a collection and a
# freeze (_Worker.probe), so a worker's first - its whole shard - is unless the
# shard is small. (The bound was "more than 10,000": a shard of 10,000 never
# froze, the collector went over its objects again and again, and 20,000
# kept-alive endpoints over two workers cost 7-9 % more CPU per check.)
FREEZE_AFTER = 1_000

# a shard up to this size sends what it observed of every endpoint every second
OBSERVE_WHOLE = 2_000

# the default's most workers: each is a process (its interpreter), and three held
# 50,000 kept-alive endpoints at 1 s in 0.7-0.8 cores (docs/benchmarks.md);
# more are there for the asking (--probe-workers N)
DEFAULT_MAX = 8
# the most workers the pool grows to, to hold kept-alive connections
GROWTH_MAX = 64
# descriptors a worker keeps for everything but kept-alive checks
# (fresh probes in flight, its pipes, the raw-SYN socket)
WORKER_RESERVE = 1024

MODULE = "healthgate.controlplane.probe_workers"


def default_workers(clustered: bool) -> int:
    """``--probe-workers`` unset: one worker per core the process may run on
    for the embedded server, at most ``DEFAULT_MAX`` (each is a process of
    its own: ~40 MB and its shard); none on a single core (a worker there
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
    probe: ProbeSettings
    scheduler: SchedulerSettings
    observe_every: int  # seconds over which a large shard's observations are sent (0: never)
    failure_log_rate: float


@message
@dataclass(frozen=True, slots=True)
class Probe:
    """What a worker probes of its shard from now on: the endpoints to probe
    (``put``: path, and the state to resume a path new to the worker from -
    0, UNKNOWN, for none - and since when) and to stop (``gone``, taken
    first), and the check of each backend service (and its secrets'
    values) the worker was not given yet or that changed. A worker's first
    after its Setup is its whole shard; then only what a change moved."""

    checks: dict[str, tuple[HealthCheck, dict[str, str]]]
    put: list[tuple[str, int, float]]
    gone: list[str]


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
    """N probe worker processes (the owner's side). The owner says what to
    probe as it changes (:meth:`change`: targets put, endpoint paths gone);
    the pool shards it over its workers by rendezvous hashing and sends each
    worker its part - the endpoints and their checks, never the world.
    ``targets`` gives everything the pool probes now (a worker started
    again, or a pool that grew, is given its shard of it), ``state_of`` an
    owner's slot's state and since when (where a worker resumes)."""

    def __init__(
        self,
        count: int,
        probe_settings: ProbeSettings,
        scheduler_settings: SchedulerSettings,
        on_flips: Callable[[Sequence[Decided]], object],
        targets: Callable[[], Iterable[ProbeTarget]],
        state_of: Callable[[int], tuple[HealthState, float]],
        on_observed: Callable[[list[tuple[str, Observed]]], None] | None = None,
        observe_every: int = 10,
        failure_log: FailureLogLimiter | None = None,
    ) -> None:
        self.probe_settings = probe_settings
        self.scheduler_settings = scheduler_settings
        self.on_flips = on_flips
        self.targets = targets
        self.state_of = state_of
        # what the probes of each endpoint showed (its runs, its last result),
        # every few seconds: the API's and the dashboard's per-endpoint details
        self.on_observed = on_observed
        self.observe_every = observe_every if on_observed is not None else 0
        # the owner's limiter: each worker sends at most its rate of failures
        # (and how many it left out), the limiter holds all of them to it
        self.failure_log = failure_log or FailureLogLimiter(0.0)
        # the shards (the workers', but named before a growing pool's new
        # workers start: they are given their shards of the new count)
        self._names = [worker_name(i) for i in range(count)]
        # each worker's checks as last sent to it (backend service -> check, secrets)
        self._sent: dict[int, dict[ResourcePath, CheckOf]] = {}
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
        """A worker (started again): its settings, then its whole shard."""
        self._sent[index] = {}
        me, names = self._names[index], self._names
        shard = []
        for t in self.targets():
            path = endpoint_path(t.backend_service, t.ip, t.port)
            if rendezvous(path, names) == me:
                shard.append((path, t))
        setup = Setup(
            index,
            self.probe_settings,
            self.scheduler_settings,
            self.observe_every,
            self.failure_log.rate,
        )
        return [setup, self._probe(index, shard, [])]

    def _probe(self, index: int, put: Sequence[tuple[str, ProbeTarget]], gone: list[str]) -> Probe:
        sent = self._sent.setdefault(index, {})
        checks: dict[str, tuple[HealthCheck, dict[str, str]]] = {}
        items = []
        state_of = self.state_of
        for path, t in put:
            known = sent.get(t.backend_service)
            if known is None or known[0] is not t.check or known[1] is not t.secrets:
                sent[t.backend_service] = (t.check, t.secrets)
                secrets = {p.text: v for p, v in t.secrets.items()}
                checks[t.backend_service.text] = (t.check, secrets)
            state, since = state_of(t.slot)
            items.append((path, int(state), since))
        return Probe(checks, items, gone)

    def change(self, put: Iterable[ProbeTarget], gone: Iterable[str]) -> None:
        """Probe these targets (new to the pool, or their check changed) and
        stop probing these endpoint paths: each worker is told its part."""
        names = self._names
        index = {name: i for i, name in enumerate(names)}
        parts: dict[int, tuple[list[tuple[str, ProbeTarget]], list[str]]] = {}
        for path in gone:
            i = index[rendezvous(path, names) or names[0]]
            parts.setdefault(i, ([], []))[1].append(path)
        for t in put:
            path = endpoint_path(t.backend_service, t.ip, t.port)
            i = index[rendezvous(path, names) or names[0]]
            parts.setdefault(i, ([], []))[0].append((path, t))
        for i, (shard, stopped) in sorted(parts.items()):
            if i < self.count:  # (else it is being started: its greeting has it)
                self.supervisor.send(i, self._probe(i, shard, stopped))

    async def start(self) -> None:
        await self.supervisor.start()

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
        """Shards over ``count`` workers: what moves to a new worker is
        taken from its old one first (the new one is given it, resumed from
        the owner's states, in its greeting)."""
        old = self._names
        self._names = [worker_name(i) for i in range(count)]
        gone: dict[int, list[str]] = {}
        for t in self.targets():
            path = endpoint_path(t.backend_service, t.ip, t.port)
            before = rendezvous(path, old)
            if before != rendezvous(path, self._names) and before is not None:
                gone.setdefault(old.index(before), []).append(path)
        for i, paths in sorted(gone.items()):
            self.supervisor.send(i, self._probe(i, [], paths))
        await self.supervisor.grow(count)

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
            self._targets,
            self._state_of,
            feed.observed,
            failure_log=failure_log,
        )

    def _targets(self) -> Iterable[ProbeTarget]:
        return self.feed.engine.targets()

    def _state_of(self, slot: int) -> tuple[HealthState, float]:
        table = self.feed.engine.table
        return table.state(slot), table.since(slot)

    def apply(self, change: WorldChange, result: ApplyResult) -> None:
        """The serving engine's probe work moved: the pool is told what."""
        table = self.feed.engine.table
        gone = dict.fromkeys(result.removed_paths)
        for slot in result.removed:  # (probed no more, and still there: its check changed kind)
            path = table.path_of(slot)
            if path is not None:
                gone[path] = None
        self.pool.change((*result.added, *result.changed), gone)
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
    """A probe worker's state: its shard of the endpoints, probed in-process."""

    def __init__(self, setup: Setup, writer: asyncio.StreamWriter) -> None:
        self.setup = setup
        self.writer = writer
        self.table = ProbedTable()
        self.mine: set[int] = set()  # the slots it probes (their paths: the table's)
        self.failures: list[tuple[str, str]] = []
        self.left_out = 0  # failures not sent (the limiter's count when last sent)
        self.local = LocalProber(
            self._results,
            self.table.endpoint_path,
            setup.probe,
            setup.scheduler,
            FailureLogLimiter(0.0),  # (failures are sent to the owner, who logs them)
            self.table.table,
        )
        self.failure_log = FailureLogLimiter(setup.failure_log_rate)

    def _results(self, now: float, results: Sequence[tuple[int, ProbeResult]]) -> None:
        failure_log = self.failure_log
        table = self.table.table
        if failure_log.rate:
            for key, result in results:
                if (
                    result.outcome is not Outcome.OK
                    and result.outcome is not Outcome.DEGRADED
                    and failure_log.allow()
                ):
                    self.failures.append((table.endpoint_path(key), result.describe()))
            if self.failures:
                self._send(Failures(list(self.failures), failure_log.suppressed - self.left_out))
                self.left_out = failure_log.suppressed
                self.failures.clear()
        decided = []
        for r in flips(table.on_results(now, results)):
            slot = table.slot_of_path(r.path)
            if slot is not None:
                decided.append(Decided(r.path, r.current, r.time, r.reason, table.observed(slot)))
        if decided:
            self._send(Flips(decided))

    def _send(self, message: FromWorker) -> None:
        write(self.writer, message)

    def probe(self, m: Probe) -> bool:
        """Probe what the owner put, stop what it took away (module doc);
        False: the message is refused (and nothing changed)."""
        now = time.time()
        try:
            checks = {ResourcePath.parse(p): (c, _secrets(s)) for p, (c, s) in m.checks.items()}
            result = self.table.change(now, checks, (p for p, _, _ in m.put), m.gone)
        except ValueError as exc:  # (the owner is this program: a bug, not a peer's error)
            log.error("a Probe message refused: %s", exc)
            return False
        scheduler = self.local.scheduler
        for slot in result.removed:
            if slot in self.mine:
                self.mine.discard(slot)
                self.local.remove(slot)
        resume = {p: (state, since) for p, state, since in m.put}
        for t in result.added:
            path = endpoint_path(t.backend_service, t.ip, t.port)
            state, since = resume.get(path, (0, now))
            self.table.resume(now, t.slot, HealthState(state), since)
            self.mine.add(t.slot)
            scheduler.upsert(t.slot, spec_of(t))
        for t in result.changed:
            scheduler.upsert(t.slot, spec_of(t))
        if len(m.put) >= FREEZE_AFTER:
            # a shard's objects live as long as it does: out of the collector's
            # sight, a full collection of a large one would stall probes by
            # tens of ms (unfrozen first, so that the last ones' cycles go)
            gc.unfreeze()
            gc.collect()
            gc.freeze()
        return True

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
                table = self.table.table
                self._send(
                    Observations(
                        [
                            (table.endpoint_path(s), table.observed(s))
                            for s in self.mine
                            if s % every == part
                        ]
                    )
                )


def _secrets(values: dict[str, str]) -> Mapping[ResourcePath, str]:
    return {ResourcePath.parse(p): v for p, v in values.items()} if values else NO_SECRETS


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
            m = expect(message, Probe, HistoryWanted)
            if isinstance(m, HistoryWanted):
                items, cut = history_export(worker.local.history, HISTORY_FRAME)
                write(writer, Histories(m.request, items, cut))
            elif not isinstance(m, Probe) or not worker.probe(m):
                # the owner and this worker no longer agree on what it holds
                # (the owner sends a backend service's check once): it ends,
                # and is started again with its whole shard
                log.error("probe worker %d: a message it cannot take; starting afresh", setup.index)
                break
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
