"""Probing on every core: worker processes that each own a shard of endpoints.

``serve --probe-workers N`` runs the probes in N processes (a
:class:`ProbePool`). Each worker holds the whole world in a *prober* engine of
its own (as a cluster node does, cluster/node.py), probes the endpoints it is
given that rendezvous hashing (cluster/placement.py, the same function that
shares endpoints among a cluster's nodes) puts in its shard, runs the
threshold machine on them, and sends only their **flips**, a tick's worth at
a time (and, over every 10 seconds, what it observed of each endpoint - its
runs and last result - for the API's details: a slow side path, not per
probe: every second up to 2,000 endpoints, a tenth of the shard a second
above that), and the probe failures to log, at most the owner's rate. What the pool is given to probe is the owner's choice: every endpoint
(:class:`WorkerProbing`, the embedded server: the flipped endpoint's state is
set in the serving engine with ``EndpointTable.set_state`` and everything
above the endpoints happens there, once), or a cluster node's share
(cluster/node.py: a flip becomes the node's opinion, as its own prober's
flips do).

A worker that dies (``kill -9``) is started again with the world and the
current states of what it probed, so it resumes where the dead one was
(HEALTHY stays HEALTHY until the thresholds say otherwise): no transition, no
UNKNOWN.

Two one-way pipes per worker (pickled messages), each read by a thread with
blocking reads (an event loop's reader makes a descriptor non-blocking, and
a large world then fails half-sent or half-read):

    parent -> worker   ("world", resources)
                       ("assign", paths or None, states)  None: every endpoint;
                                                          states: path -> (state, since)
    worker -> parent   ("flips", [(path, state, since, reason, Observed), ...])
                       ("stats", Report)  running totals, every second
                       ("observed", [(path, Observed), ...])  each endpoint's runs and
                                      last result, every few seconds (when asked for)
                       ("failed", [(path, description), ...], suppressed)  probe
                                      failures to log, at most the owner's rate
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, cast

from healthgate.cluster.placement import rendezvous
from healthgate.controlplane.health_service import FailureLogLimiter, HealthService, ProbeStats
from healthgate.health.endpoints import EndpointTable, Observed
from healthgate.health.engine import ApplyResult, HealthEngine, endpoint_name
from healthgate.health.states import HealthState, Outcome, ProbeResult, Record, Transition
from healthgate.model.resources import Resource
from healthgate.probes.batch import BatchProber
from healthgate.probes.prober import Prober, ProbeSettings
from healthgate.probes.scheduler import ProbeScheduler, SchedulerSettings

log = logging.getLogger("healthgate.probe_workers")

# an endpoint's flip: its path, new state, when, why, and what its probes had
# shown then (the runs the reason counts, the last result)
Flip = tuple[str, str, float, str, Observed]


# a shard up to this size sends what it observed of every endpoint every second
OBSERVE_WHOLE = 2_000


# the default's most workers: each holds the whole world, and three held
# 50,000 kept-alive endpoints at 1 s in 0.7-0.8 cores (docs/benchmarks.md);
# more are there for the asking (--probe-workers N)
DEFAULT_MAX = 8


def default_workers(clustered: bool) -> int:
    """``--probe-workers`` unset: one worker per core the process may run on
    for the embedded server, at most ``DEFAULT_MAX`` (each holds the whole
    world: ~47 MB for a small one); none on a single core (a worker there
    only adds a process and a pipe) and none for a cluster node (a cluster
    spreads its probes over nodes; a node takes workers when told to)."""
    if clustered:
        return 0
    cores = len(os.sched_getaffinity(0))
    return min(cores, DEFAULT_MAX) if cores > 1 else 0


def worker_name(index: int) -> str:
    return f"w{index}"


@dataclass(slots=True)
class Report:
    """A worker's running totals, sent every second; the pool adds them up
    (with those of workers that died) for the owner's metrics."""

    started: int = 0
    late: int = 0
    finished: int = 0
    tls_handshakes: int = 0
    tls_resumed: int = 0
    buckets: dict[Outcome, list[int]] = field(default_factory=dict)  # probe durations
    sums: dict[Outcome, float] = field(default_factory=dict)

    def add(self, other: Report) -> None:
        self.started += other.started
        self.late += other.late
        self.finished += other.finished
        self.tls_handshakes += other.tls_handshakes
        self.tls_resumed += other.tls_resumed
        for outcome, counts in other.buckets.items():
            mine = self.buckets.setdefault(outcome, [0] * len(counts))
            for i, n in enumerate(counts):
                mine[i] += n
            self.sums[outcome] = self.sums.get(outcome, 0.0) + other.sums.get(outcome, 0.0)


class ProbePool:
    """N probe worker processes and the pipes to them (the owner's side)."""

    def __init__(
        self,
        count: int,
        probe_settings: ProbeSettings,
        scheduler_settings: SchedulerSettings,
        on_flips: Callable[[Sequence[Flip]], None],
        states: Callable[[Iterable[str] | None], dict[str, tuple[int, float]]],
        on_report: Callable[[Report], None],
        on_observed: Callable[[list[tuple[str, Observed]]], None] | None = None,
        observe_every: int = 10,
        failure_log: FailureLogLimiter | None = None,
    ) -> None:
        self.count = count
        self.probe_settings = probe_settings
        self.scheduler_settings = scheduler_settings
        self.on_flips = on_flips
        self.states = states  # the owner's current states of these paths (None: all)
        self.on_report = on_report  # every worker's totals, added up
        # what the probes of each endpoint showed (its runs, its last result),
        # every few seconds: the API's and the dashboard's per-endpoint details
        self.on_observed = on_observed
        self.observe_every = observe_every if on_observed is not None else 0
        # the owner's limiter: each worker sends at most its rate of failures
        # (and how many it left out), the limiter holds all of them to it
        self.failure_log = failure_log or FailureLogLimiter(0.0)
        self.procs: list[Any] = [None] * count
        self.conns: list[Connection | None] = [None] * count  # to each worker
        self.restarts = 0
        self._world: list[Resource] = []
        self._paths: frozenset[str] | None = None  # what to probe (None: every endpoint)
        self._reports: dict[int, Report] = {}
        self._base = Report()  # of workers that died
        self._closing = False
        self._ctx = multiprocessing.get_context("spawn")

    def start(self) -> None:
        for i in range(self.count):
            self._spawn(i)

    def _spawn(self, index: int) -> None:
        down_r, down_w = self._ctx.Pipe(duplex=False)  # parent -> worker
        up_r, up_w = self._ctx.Pipe(duplex=False)  # worker -> parent
        proc = self._ctx.Process(
            target=worker_main,
            args=(
                down_r,
                up_w,
                index,
                self.count,
                self.probe_settings,
                self.scheduler_settings,
                self.observe_every,
                self.failure_log.rate,
            ),
            name=f"healthgate-probe-{worker_name(index)}",
            daemon=True,
        )
        proc.start()
        down_r.close()
        up_w.close()
        self.procs[index], self.conns[index] = proc, down_w
        loop = asyncio.get_running_loop()
        threading.Thread(
            target=self._read, args=(loop, index, up_r), name=f"probe-{index}", daemon=True
        ).start()
        down_w.send(("world", self._world))
        down_w.send(("assign", self._paths, self.states(self._paths)))
        log.info("probe worker %s started (pid %d)", worker_name(index), proc.pid)

    def _read(self, loop: asyncio.AbstractEventLoop, index: int, conn: Connection) -> None:
        """A thread per worker: its messages, handed to the event loop."""
        try:
            while True:
                message = conn.recv()
                loop.call_soon_threadsafe(self._take, index, message)
        except (EOFError, OSError):
            with contextlib.suppress(RuntimeError):  # the loop is closed: serve stopped
                loop.call_soon_threadsafe(self._lost, index, conn)
        finally:
            conn.close()

    def _send(self, message: tuple[Any, ...]) -> None:
        for conn in self.conns:
            if conn is not None:
                with contextlib.suppress(OSError):  # (a dead worker: restarted with it all)
                    conn.send(message)

    def world(self, resources: Sequence[Resource]) -> None:
        """The resources changed: every worker gets them (and finds its changes)."""
        self._world = list(resources)
        self._send(("world", self._world))

    def assign(self, paths: Iterable[str] | None) -> None:
        """Probe these endpoint paths (None: every endpoint of the world). A
        path new to the pool resumes from the owner's state of it."""
        chosen = None if paths is None else frozenset(paths)
        if chosen == self._paths and chosen is not None:
            return
        new = None if chosen is None or self._paths is None else chosen - self._paths
        self._paths = chosen
        self._send(("assign", chosen, self.states(new)))

    def _lost(self, index: int, conn: Connection) -> None:
        proc = self.procs[index]
        last = self._reports.pop(index, None)
        if last is not None:
            self._base.add(last)
        down = self.conns[index]
        if down is not None:
            down.close()
        self.conns[index] = None
        if proc is not None:
            proc.join(1)
        if self._closing:
            return
        code = proc.exitcode if proc is not None else None
        log.warning("probe worker %s exited (%s): starting it again", worker_name(index), code)
        self.restarts += 1
        self._spawn(index)

    def _take(self, index: int, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "flips":
            self.on_flips(message[1])
        elif kind == "observed":
            if self.on_observed is not None:
                self.on_observed(message[1])
        elif kind == "failed":
            failure_log = self.failure_log
            for path, description in message[1]:
                failure_log.failed(path, description)
            failure_log.suppressed += message[2]
        elif kind == "stats":
            self._reports[index] = message[1]
            total = Report()
            for report in (self._base, *self._reports.values()):
                total.add(report)
            self.on_report(total)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None]

    async def close(self) -> None:
        self._closing = True
        for i, conn in enumerate(self.conns):
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()  # the worker sees the end of its pipe and exits
                self.conns[i] = None
        for proc in self.procs:
            if proc is not None:
                await asyncio.to_thread(proc.join, 2)
                if proc.is_alive():
                    proc.kill()
                    await asyncio.to_thread(proc.join, 2)


class WorkerProbing(HealthService):
    """The embedded server's side: the engine, fed by the workers' flips."""

    def __init__(
        self,
        workers: int,
        probe_settings: ProbeSettings | None = None,
        scheduler_settings: SchedulerSettings | None = None,
        failure_log_rate: float = 0.0,
    ) -> None:
        super().__init__(probe_settings, scheduler_settings, failure_log_rate=failure_log_rate)
        self.pool = ProbePool(
            workers,
            probe_settings or ProbeSettings(),
            scheduler_settings or SchedulerSettings(),
            self._flips,
            self._states,
            self.take_report,
            self._observed,
            failure_log=self.failure_log,
        )

    def start(self) -> None:
        self.pool.start()

    def _states(self, paths: Iterable[str] | None) -> dict[str, tuple[int, float]]:
        """The current states of every endpoint that has one (the pool
        probes every endpoint: a new path starts from UNKNOWN anyway)."""
        out: dict[str, tuple[int, float]] = {}
        engine = self.engine
        for bs in engine.backend_services():
            for ep in engine.endpoints(bs):
                if ep.state is not HealthState.UNKNOWN:
                    out[f"{bs}/endpoints/{endpoint_name(ep.ip, ep.port)}"] = (
                        int(ep.state),
                        ep.since,
                    )
        return out

    def _observed(self, items: list[tuple[str, Observed]]) -> None:
        table = self.engine.table
        for path, seen in items:
            slot = table.slot_of_path(path)
            if slot is not None:
                table.set_observed(slot, seen)

    def _flips(self, flips: Sequence[Flip]) -> None:
        self.emit(apply_flips(self.engine.table, flips))

    async def close(self) -> None:
        await self.pool.close()

    def apply(self, resources: Iterable[Resource]) -> ApplyResult:
        world = list(resources)
        result = self.engine.apply(world, self.clock())
        self.pool.world(world)
        self.emit(result.records)
        return result

    def pids(self) -> list[int]:
        return self.pool.pids()


def apply_flips(table: EndpointTable, flips: Sequence[Flip]) -> list[Record]:
    """The workers' flips set in an engine's endpoint table: its records."""
    records: list[Record] = []
    for path, state, since, reason, seen in flips:
        slot = table.slot_of_path(path)
        if slot is not None:
            records += table.set_state(since, slot, HealthState[state], reason)
            table.set_observed(slot, seen)  # (setting a state clears the runs)
    return records


# ---------------------------------------------------------------------- the worker


def worker_main(
    down: Connection,
    up: Connection,
    index: int,
    count: int,
    probe_settings: ProbeSettings,
    scheduler_settings: SchedulerSettings,
    observe_every: int = 0,
    failure_log_rate: float = 0.0,
) -> None:
    """A probe worker process: its shard of the endpoints, until the pipe closes."""
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(
            _worker(
                down,
                up,
                index,
                count,
                probe_settings,
                scheduler_settings,
                observe_every,
                failure_log_rate,
            )
        )


async def _worker(
    down: Connection,
    up: Connection,
    index: int,
    count: int,
    probe_settings: ProbeSettings,
    scheduler_settings: SchedulerSettings,
    observe_every: int,
    failure_log_rate: float,
) -> None:
    me = worker_name(index)
    names = [worker_name(i) for i in range(count)]
    engine = HealthEngine()
    mine: dict[int, str] = {}  # slot -> endpoint path
    outbox: list[Flip] = []
    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    probe_stats = ProbeStats()
    failure_log = FailureLogLimiter(failure_log_rate)
    failures: list[tuple[str, str]] = []
    left_out = [0]  # failures not sent (the limiter's count when last sent)

    def sink(_t: float, results: list[tuple[Hashable, ProbeResult]]) -> None:
        probe_stats.observe(results)
        if failure_log.rate:
            for key, result in results:
                if result.outcome is not Outcome.OK and failure_log.allow():
                    failures.append((engine.endpoint_path(cast(int, key)), result.describe()))
            if failures:
                with contextlib.suppress(OSError):  # (the owner is gone: seen below)
                    up.send(("failed", list(failures), failure_log.suppressed - left_out[0]))
                left_out[0] = failure_log.suppressed
                failures.clear()
        records = engine.on_results(time.time(), cast("list[tuple[int, ProbeResult]]", results))
        table = engine.table
        for r in records:
            if isinstance(r, Transition) and r.kind == "Endpoint":
                slot = table.slot_of_path(r.path)
                if slot is not None:
                    outbox.append((r.path, r.current.name, r.time, r.reason, table.observed(slot)))
        if outbox:
            try:
                up.send(("flips", list(outbox)))
            except OSError:
                done.set()
            outbox.clear()

    prober = Prober(probe_settings)
    scheduler = ProbeScheduler(prober, sink, scheduler_settings, batch=BatchProber(probe_settings))

    given: list[frozenset[str] | None] = []  # what to probe, once told (None: everything)

    def place(states: dict[str, tuple[int, float]], changed: set[int]) -> None:
        """Probe the given endpoints of this worker's shard; stop the rest."""
        if not given:
            return  # (the first "assign" follows the world at once)
        paths = given[0]
        seen = set()
        for t in engine.targets():
            path = f"{t.backend_service}/endpoints/{endpoint_name(t.ip, t.port)}"
            if (paths is not None and path not in paths) or rendezvous(path, names) != me:
                continue
            seen.add(t.slot)
            if t.slot not in mine:
                resumed = states.get(path)
                if resumed is not None:  # a worker started again, a share moved: go on from there
                    engine.table.set_state(resumed[1], t.slot, HealthState(resumed[0]), "resumed")
                else:  # not a state left from an earlier time this worker probed it
                    engine.table.set_state(time.time(), t.slot, HealthState.UNKNOWN, "assigned")
                mine[t.slot] = path
                scheduler.upsert(t.slot, HealthService.spec_of(t))
            elif t.slot in changed:
                scheduler.upsert(t.slot, HealthService.spec_of(t))
        for slot in [s for s in mine if s not in seen]:
            del mine[slot]
            scheduler.remove(slot)

    def world(resources: list[Resource]) -> None:
        result = engine.apply(resources, time.time())
        for slot in result.removed:
            scheduler.remove(slot)
            mine.pop(slot, None)
        place({}, {t.slot for t in result.changed})
        # the world's objects live as long as it does: out of the collector's
        # sight, a full collection of a large one would stall probes by tens of
        # ms (unfrozen first, so that the last world's cycles are collected)
        gc.unfreeze()
        gc.collect()
        gc.freeze()

    def assign(paths: frozenset[str] | None, states: dict[str, tuple[int, float]]) -> None:
        given[:] = [paths]
        place(states, set())

    def read() -> None:
        """A thread: the owner's messages, handed to the loop."""
        try:
            while True:
                message = down.recv()
                if message[0] == "world":
                    loop.call_soon_threadsafe(world, message[1])
                elif message[0] == "assign":
                    loop.call_soon_threadsafe(assign, message[1], message[2])
        except (EOFError, OSError):
            # the owner is gone (or stopping): so is this worker
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(done.set)

    threading.Thread(target=read, name="from-serve", daemon=True).start()
    scheduler.start()

    async def report() -> None:
        seconds = 0
        while True:
            await asyncio.sleep(1.0)
            seconds += 1
            s = scheduler.stats
            report = Report(
                s.started,
                s.late_starts,
                s.finished,
                prober.tls_handshakes,
                prober.tls_resumed,
                probe_stats.buckets,
                probe_stats.sums,
            )
            try:
                up.send(("stats", report))
                if failure_log.suppressed > left_out[0]:
                    up.send(("failed", [], failure_log.suppressed - left_out[0]))
                    left_out[0] = failure_log.suppressed
                if observe_every:
                    # a small shard whole every second; a large one a tenth
                    # (say) of it a second, not all at once
                    every = observe_every if len(mine) > OBSERVE_WHOLE else 1
                    part = seconds % every
                    table = engine.table
                    up.send(
                        (
                            "observed",
                            [(p, table.observed(s)) for s, p in mine.items() if s % every == part],
                        )
                    )
            except OSError:
                done.set()
                return

    reporter = asyncio.create_task(report())
    await done.wait()
    reporter.cancel()
    await scheduler.close()
    os._exit(0)
