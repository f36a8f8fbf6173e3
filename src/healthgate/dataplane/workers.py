"""Listeners in worker processes: every core serves traffic.

With ``serve --dataplane-workers N`` the serving process opens no listener
itself. It starts N worker processes (``python -m healthgate.dataplane.workers``);
each opens *every* listener with ``SO_REUSEPORT``, so the kernel spreads new
connections (and UDP flows) over them, and each runs the same
:class:`~healthgate.dataplane.manager.DataPlane` as the serving process would,
over a snapshot of health instead of the engine.

The serving process is the only source of truth. It sends each worker, over
the worker's stdin (length-prefixed pickles; both ends are this program):

* ``settings`` once, then ``resources`` whenever they change (the listeners
  follow, as in-process);
* ``health``: the route table and, for every backend service behind a producer
  rule, its HEALTHY and all endpoints - after every batch of transitions,
  sent at once (a burst within one event-loop turn: once more at its end),
  and only when something the listeners read has changed.

Each worker reports its listeners' counters and its propagation histogram on
its stdout once a second; the serving process adds them up for ``/metrics``
and the forwarding rules' ``status.listener``. A worker whose stdin closes
(the serving process is gone) closes its listeners and exits, so no worker
outlives it; a worker that dies is started again after a second, and gets the
current resources and health first. Propagation to a worker costs one pipe
write and a wake-up (well under a millisecond here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import struct
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from healthgate.dataplane.manager import PROPAGATION_BUCKETS, DataPlane, DataPlaneSettings
from healthgate.health.engine import EndpointKey, HealthEngine, RouteTable
from healthgate.model.names import ResourcePath
from healthgate.model.resources import ForwardingRule, Resource

log = logging.getLogger("healthgate.dataplane")

_LEN = struct.Struct("!I")
RESTART_DELAY = 1.0
STATS_INTERVAL = 1.0


def _frame(message: tuple[Any, ...]) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader) -> tuple[Any, ...] | None:
    try:
        size = _LEN.unpack(await reader.readexactly(_LEN.size))[0]
        message: tuple[Any, ...] = pickle.loads(await reader.readexactly(size))
    except asyncio.IncompleteReadError:
        return None
    return message


def health_snapshot(
    engine: HealthEngine, resources: Mapping[ResourcePath, Resource]
) -> tuple[int, dict[str, Any], float, dict[ResourcePath, tuple[tuple[EndpointKey, ...], ...]]]:
    """What a worker's listeners read of health, in a form that pickles."""
    table = engine.route_table()
    endpoints: dict[ResourcePath, tuple[tuple[EndpointKey, ...], ...]] = {}
    for res in resources.values():
        if isinstance(res, ForwardingRule) and not res.is_global:
            bs = res.ref("backend_service")
            if bs is not None and bs not in endpoints:
                endpoints[bs] = (engine.healthy_endpoints(bs), engine.all_endpoints(bs))
    return table.version, dict(table.routes), table.published, endpoints


# ---------------------------------------------------------------- serving side


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: asyncio.subprocess.Process | None = None
        self.stats: dict[str, dict[str, object]] = {}
        self.propagation = [0] * (len(PROPAGATION_BUCKETS) + 1)
        self.propagation_sum = 0.0
        self.connections = 0
        self.tasks: list[asyncio.Task[None]] = []


class WorkerPool:
    """The serving process's side: starts the workers and feeds them. Offers
    what the server uses of an in-process :class:`DataPlane`."""

    def __init__(self, engine: HealthEngine, settings: DataPlaneSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.workers = [_Worker(i) for i in range(settings.workers)]
        self._resources: Mapping[ResourcePath, Resource] = {}
        self._last_health: Any = None
        self._publish_pending = False
        self._publish_dirty = False
        self._closing = False

    # -- what the server calls
    async def start(self) -> None:
        for worker in self.workers:
            await self._spawn(worker)

    async def sync(self, resources: Mapping[ResourcePath, Resource]) -> None:
        self._resources = resources
        frame = _frame(("resources", dict(resources)))
        for worker in self.workers:
            self._send(worker, frame)
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
        frame = _frame(("health", *snapshot))
        for worker in self.workers:
            self._send(worker, frame)

    def _send(self, worker: _Worker, frame: bytes) -> None:
        proc = worker.proc
        if proc is not None and proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.write(frame)

    async def close(self, grace: float = 0.0) -> None:
        self._closing = True
        for worker in self.workers:
            proc = worker.proc
            if proc is None:
                continue
            if proc.stdin is not None:
                proc.stdin.close()  # the worker closes its listeners and exits
            try:
                async with asyncio.timeout(grace + 5):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        for worker in self.workers:
            for task in worker.tasks:
                task.cancel()
            await asyncio.gather(*worker.tasks, return_exceptions=True)

    # -- what /metrics and the API read
    @property
    def propagation(self) -> list[int]:
        return [sum(col) for col in zip(*(w.propagation for w in self.workers), strict=True)]

    @property
    def propagation_sum(self) -> float:
        return sum(w.propagation_sum for w in self.workers)

    def listener_stats(self) -> dict[str, dict[str, int]]:
        """The counters of :meth:`status`, summed over the workers."""
        return {
            path: {
                k: v for k, v in merged.items() if isinstance(v, int) and not isinstance(v, bool)
            }
            for path, merged in self.status().items()
        }

    def status(self) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        for worker in self.workers:
            for path, status in worker.stats.items():
                merged = out.setdefault(path, {})
                for key, value in status.items():
                    if isinstance(value, int) and not isinstance(value, bool):
                        previous = merged.get(key, 0)
                        merged[key] = (previous if isinstance(previous, int) else 0) + value
                    elif key not in merged or (key == "error" and value):
                        merged[key] = value
        return out

    def collect(self) -> Iterator[Metric]:
        """Connections per worker process (the pool is a Collector)."""
        family = CounterMetricFamily(
            "healthgate_worker_connections",
            "Connections accepted per data-plane worker",
            labels=["worker"],
        )
        for w in self.workers:
            family.add_metric([str(w.index)], w.connections)
        yield family

    # -- processes
    async def _spawn(self, worker: _Worker) -> None:
        worker.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "healthgate.dataplane.workers",
            str(worker.index),
            logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        self._send(worker, _frame(("settings", self.settings)))
        self._send(worker, _frame(("resources", dict(self._resources))))
        self._send(worker, _frame(("health", *health_snapshot(self.engine, self._resources))))
        worker.tasks = [t for t in worker.tasks if not t.done()]
        worker.tasks.append(asyncio.create_task(self._watch(worker, worker.proc)))
        log.info("data-plane worker %d started (pid %d)", worker.index, worker.proc.pid)

    async def _watch(self, worker: _Worker, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while (message := await _read_frame(proc.stdout)) is not None:
            if message[0] == "stats":
                _, worker.stats, worker.propagation, worker.propagation_sum = message
                worker.connections = sum(
                    int(s.get("connections", 0))  # type: ignore[call-overload]
                    for s in worker.stats.values()
                )
        code = await proc.wait()
        if self._closing:
            return
        log.error("data-plane worker %d exited (%s); starting it again", worker.index, code)
        await asyncio.sleep(RESTART_DELAY)
        if not self._closing:
            await self._spawn(worker)


# ---------------------------------------------------------------- worker side


class HealthSnapshot:
    """The health a worker's listeners read: the last one the serving process sent."""

    def __init__(self) -> None:
        self.table = RouteTable(0, {})
        self.endpoints: dict[ResourcePath, tuple[tuple[EndpointKey, ...], ...]] = {}
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
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    w_transport, w_protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(sys.stdout.fileno(), "wb", buffering=0)
    )
    writer = asyncio.StreamWriter(w_transport, w_protocol, None, loop)
    view = HealthSnapshot()
    first = await _read_frame(reader)
    if first is None or first[0] != "settings":
        return
    settings: DataPlaneSettings = first[1]
    dp = DataPlane(view, settings)

    async def report() -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL)
            writer.write(_frame(("stats", dp.status(), dp.propagation, dp.propagation_sum)))

    reporter = loop.create_task(report())
    try:
        while (message := await _read_frame(reader)) is not None:
            if message[0] == "resources":
                await dp.sync(message[1])
            elif message[0] == "health":
                _, version, routes, published, endpoints = message
                before = view.table.routes
                view.table = RouteTable(version, routes, published)
                view.endpoints = endpoints
                view.generation += 1
                changed = [f for f, r in routes.items() if before.get(f) != r]
                if changed:
                    dp.routes_changed(changed)
    finally:
        reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporter
        writer.write(_frame(("stats", dp.status(), dp.propagation, dp.propagation_sum)))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        await dp.close()
        log.info("data-plane worker %d stopped", index)


def main() -> None:
    import signal

    import uvloop

    logging.basicConfig(
        level=sys.argv[2].upper() if len(sys.argv) > 2 else "INFO",
        format=f"%(asctime)s worker[{sys.argv[1]}] %(levelname)s %(name)s: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the serving process decides when we stop
    uvloop.run(run_worker(int(sys.argv[1])))


if __name__ == "__main__":
    main()
