"""Probing on every core: worker processes that each own a shard of endpoints.

``serve --probe-workers N`` runs the probes in N processes. Each worker
holds the whole world in a *prober* engine of its own (as a cluster node
does, cluster/node.py), probes the endpoints that rendezvous hashing
(cluster/placement.py, the same function that shares endpoints among a
cluster's nodes) gives its shard, runs the threshold machine on them, and
sends only their **flips** to the serving process, a tick's worth at a time.
The serving process sets each flipped endpoint's state in its own engine
(``EndpointTable.set_state``, as a cluster node does with the vantages'
quorum) and everything above the endpoints - sources, composites, routes,
the log - happens there, once.

A worker that dies (``kill -9``) is started again with the world and the
current states of its shard's endpoints, so it resumes where the dead one
was (HEALTHY stays HEALTHY until the thresholds say otherwise): no
transition, no UNKNOWN.

Two one-way pipes per worker (pickled messages), each read by a thread with
blocking reads (an event loop's reader makes a descriptor non-blocking, and
a large world then fails half-sent or half-read):

    parent -> worker   ("world", resources, states)  states: endpoint path -> (state, since)
    worker -> parent   ("flips", [(path, state, since, reason), ...])
                       ("stats", started, late, finished, in_flight)
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
from collections.abc import Hashable, Iterable, Sequence
from multiprocessing.connection import Connection
from typing import Any, cast

from healthgate.cluster.placement import rendezvous
from healthgate.controlplane.health_service import HealthService
from healthgate.health.engine import ApplyResult, HealthEngine, endpoint_name
from healthgate.health.states import HealthState, ProbeResult, Transition
from healthgate.model.resources import Resource
from healthgate.probes.batch import BatchProber
from healthgate.probes.prober import Prober, ProbeSettings
from healthgate.probes.scheduler import ProbeScheduler, SchedulerSettings

log = logging.getLogger("healthgate.probe_workers")

Flip = tuple[str, str, float, str]


def worker_name(index: int) -> str:
    return f"w{index}"


class WorkerProbing(HealthService):
    """The serving process's side: the engine, fed by the workers' flips."""

    def __init__(
        self,
        workers: int,
        probe_settings: ProbeSettings | None = None,
        scheduler_settings: SchedulerSettings | None = None,
        failure_log_rate: float = 0.0,
    ) -> None:
        super().__init__(probe_settings, scheduler_settings, failure_log_rate=failure_log_rate)
        self.count = workers
        self.probe_settings = probe_settings or ProbeSettings()
        self.scheduler_settings = scheduler_settings or SchedulerSettings()
        self.procs: list[Any] = [None] * workers
        self.conns: list[Connection | None] = [None] * workers  # to each worker
        self.restarts = 0
        self._world: list[Resource] = []
        self._stats: dict[int, tuple[int, int, int, int]] = {}
        self._stats_base = (0, 0, 0)  # of workers that died
        self._closing = False
        self._ctx = multiprocessing.get_context("spawn")

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        for i in range(self.count):
            self._spawn(i)

    def _spawn(self, index: int) -> None:
        down_r, down_w = self._ctx.Pipe(duplex=False)  # parent -> worker
        up_r, up_w = self._ctx.Pipe(duplex=False)  # worker -> parent
        proc = self._ctx.Process(
            target=worker_main,
            args=(down_r, up_w, index, self.count, self.probe_settings, self.scheduler_settings),
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
        down_w.send(("world", self._world, self._states()))
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

    def _states(self) -> dict[str, tuple[int, float]]:
        """Every endpoint's current state, for a (re)started worker to resume from."""
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

    def _lost(self, index: int, conn: Connection) -> None:
        proc = self.procs[index]
        started, late, finished, _ = self._stats.pop(index, (0, 0, 0, 0))
        b = self._stats_base
        self._stats_base = (b[0] + started, b[1] + late, b[2] + finished)
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
            self._flips(message[1])
        elif kind == "stats":
            self._stats[index] = message[1:]
            self._fold_stats()

    def _fold_stats(self) -> None:
        stats = self.scheduler.stats
        b = self._stats_base
        stats.started = b[0] + sum(s[0] for s in self._stats.values())
        stats.late_starts = b[1] + sum(s[1] for s in self._stats.values())
        stats.finished = b[2] + sum(s[2] for s in self._stats.values())
        self.results = stats.finished

    def _flips(self, flips: Sequence[Flip]) -> None:
        engine = self.engine
        records = []
        for path, state, since, reason in flips:
            slot = engine.table.slot_of_path(path)
            if slot is not None:
                records += engine.table.set_state(since, slot, HealthState[state], reason)
        self.emit(records)

    async def close(self) -> None:
        self._closing = True
        for i, conn in enumerate(self.conns):
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()  # the worker sees the end of its pipe and exits
                self.conns[i] = None
        for proc in self.procs:
            if proc is not None:
                proc.join(2)
                if proc.is_alive():
                    proc.kill()
                    proc.join(2)

    # ------------------------------------------------------------------ resources

    def apply(self, resources: Iterable[Resource]) -> ApplyResult:
        self._world = list(resources)
        result = self.engine.apply(self._world, self.clock())
        for conn in self.conns:
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(("world", self._world, {}))
        self.emit(result.records)
        return result

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None]


# ---------------------------------------------------------------------- the worker


def worker_main(
    down: Connection,
    up: Connection,
    index: int,
    count: int,
    probe_settings: ProbeSettings,
    scheduler_settings: SchedulerSettings,
) -> None:
    """A probe worker process: its shard of the endpoints, until the pipe closes."""
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(_worker(down, up, index, count, probe_settings, scheduler_settings))


async def _worker(
    down: Connection,
    up: Connection,
    index: int,
    count: int,
    probe_settings: ProbeSettings,
    scheduler_settings: SchedulerSettings,
) -> None:
    me = worker_name(index)
    names = [worker_name(i) for i in range(count)]
    engine = HealthEngine()
    mine: dict[int, str] = {}  # slot -> endpoint path
    outbox: list[Flip] = []
    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    def sink(_t: float, results: list[tuple[Hashable, ProbeResult]]) -> None:
        records = engine.on_results(time.time(), cast("list[tuple[int, ProbeResult]]", results))
        for r in records:
            if isinstance(r, Transition) and r.kind == "Endpoint":
                outbox.append((r.path, r.current.name, r.time, r.reason))
        if outbox:
            try:
                up.send(("flips", list(outbox)))
            except OSError:
                done.set()
            outbox.clear()

    scheduler = ProbeScheduler(
        Prober(probe_settings), sink, scheduler_settings, batch=BatchProber(probe_settings)
    )

    def world(resources: list[Resource], states: dict[str, tuple[int, float]]) -> None:
        result = engine.apply(resources, time.time())
        for slot in result.removed:
            scheduler.remove(slot)
            mine.pop(slot, None)
        changed = {t.slot for t in result.changed}
        seen = set()
        for t in engine.targets():
            path = f"{t.backend_service}/endpoints/{endpoint_name(t.ip, t.port)}"
            if rendezvous(path, names) != me:
                continue
            seen.add(t.slot)
            if t.slot not in mine:
                resumed = states.get(path)
                if resumed is not None:  # a worker started again: go on from there
                    engine.table.set_state(resumed[1], t.slot, HealthState(resumed[0]), "resumed")
                mine[t.slot] = path
                scheduler.upsert(t.slot, HealthService.spec_of(t))
            elif t.slot in changed:
                scheduler.upsert(t.slot, HealthService.spec_of(t))
        for slot in [s for s in mine if s not in seen]:
            del mine[slot]
            scheduler.remove(slot)
        # the world's objects live as long as it does: out of the collector's
        # sight, a full collection of a large one would stall probes by tens of ms
        gc.collect()
        gc.freeze()

    def read() -> None:
        """A thread: the serving process's messages, handed to the loop."""
        try:
            while True:
                message = down.recv()
                if message[0] == "world":
                    loop.call_soon_threadsafe(world, message[1], message[2])
        except (EOFError, OSError):
            # the serving process is gone (or stopping): so is this worker
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(done.set)

    threading.Thread(target=read, name="from-serve", daemon=True).start()
    scheduler.start()

    async def report() -> None:
        while True:
            await asyncio.sleep(1.0)
            s = scheduler.stats
            try:
                up.send(("stats", s.started, s.late_starts, s.finished, scheduler.in_flight))
            except OSError:
                done.set()
                return

    reporter = asyncio.create_task(report())
    await done.wait()
    reporter.cancel()
    await scheduler.close()
    os._exit(0)
