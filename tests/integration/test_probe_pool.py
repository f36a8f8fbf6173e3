"""Probe workers given their shards (controlplane/probe_workers.py), with
real worker processes probing real listeners on loopback: each endpoint is
probed by exactly one worker; a pool that grows, and a worker killed with
``kill -9``, move endpoints without a flip (they resume from the owner's
states); endpoints stopped are probed no more; a changed check is taken;
a worker given what it cannot take starts afresh."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Sequence

from healthgate.controlplane.probe_workers import Probe, ProbePool
from healthgate.controlplane.probing import Decided
from healthgate.health.endpoints import Observed
from healthgate.health.engine import HealthEngine, ProbeTarget
from healthgate.health.states import HealthState
from healthgate.model.names import ResourcePath, endpoint_path
from healthgate.model.resources import HealthCheck
from healthgate.probes.prober import ProbeSettings
from healthgate.probes.scheduler import SchedulerSettings
from tests.helpers import example_world, resources, run_async
from tests.integration.servers import Server, free_port, respond

ENDPOINTS = 16


def a_check_and_service(port: int | None = None) -> tuple[HealthCheck, ResourcePath]:
    """A TCP check (on the serving port, or ``port``; thresholds of 2), and a
    backend service."""
    docs = example_world(fast=True)
    for d in docs:
        if d["kind"] == "HealthCheck":
            d.pop("requestPath", None)
            d.pop("port", None)
            d.update(type="TCP")
            if port is not None:
                d["port"] = port
    engine = HealthEngine()
    engine.apply(resources(docs), 0.0)
    t = next(iter(engine.targets()))
    return t.check, t.backend_service


class Owner:
    """What the serving process keeps: its targets and their states."""

    def __init__(self, targets: list[ProbeTarget]) -> None:
        self.targets = {t.slot: t for t in targets}
        self.slots = {endpoint_path(t.backend_service, t.ip, t.port): t.slot for t in targets}
        self.states: dict[int, tuple[HealthState, float]] = {}
        self.flips: list[Decided] = []
        self.seen: dict[int, set[str]] = {}  # worker -> the paths it last observed
        self.changed = asyncio.Event()

    def on_flips(self, decided: Sequence[Decided]) -> None:
        for d in decided:
            self.flips.append(d)
            self.states[self.slots[d.path]] = (d.state, d.since)
        self.changed.set()

    def state_of(self, slot: int) -> tuple[HealthState, float]:
        return self.states.get(slot, (HealthState.UNKNOWN, 0.0))

    def observing(self, pool: ProbePool) -> None:
        take = pool._take

        def taken(index: int, message: object) -> None:
            items: list[tuple[str, Observed]] | None = getattr(message, "items", None)
            if isinstance(items, list):
                self.seen[index] = {path for path, _ in items}
                self.changed.set()
            take(index, message)

        pool.supervisor.on_message = taken  # (which worker sent it)

    async def until(self, what: str, predicate: Callable[[], bool], timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                self.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), 1.0)
        assert predicate(), what


def test_shards_move_without_a_flip_and_changes_reach_their_workers() -> None:
    check, service = a_check_and_service()

    async def go() -> None:
        async with contextlib.AsyncExitStack() as stack:
            servers = [
                await stack.enter_async_context(Server(respond(200))) for _ in range(ENDPOINTS)
            ]
            targets = [
                ProbeTarget(i, service, "127.0.0.1", s.port, check) for i, s in enumerate(servers)
            ]
            owner = Owner(targets)
            pool = ProbePool(
                2,
                ProbeSettings(),
                SchedulerSettings(),
                owner.on_flips,
                lambda: list(owner.targets.values()),
                owner.state_of,
                on_observed=lambda items: None,
                observe_every=1,
            )
            owner.observing(pool)
            await pool.start()
            try:
                pool.change(targets, [])
                paths = set(owner.slots)
                healthy = HealthState.HEALTHY

                def all_healthy() -> bool:
                    return len(owner.states) == ENDPOINTS and all(
                        s is healthy for s, _ in owner.states.values()
                    )

                def once_each(workers: int) -> Callable[[], bool]:
                    def check() -> bool:
                        seen = [owner.seen.get(i, set()) for i in range(workers)]
                        union = set().union(*seen)
                        return union == paths and sum(map(len, seen)) == len(paths)

                    return check

                await owner.until("every endpoint HEALTHY", all_healthy, 20)
                await owner.until("each endpoint probed by one of two", once_each(2), 10)
                flips = len(owner.flips)

                # the pool grows: a third of the endpoints move, without a flip
                await pool._grow(3)
                owner.seen.clear()
                await owner.until("each endpoint probed by one of three", once_each(3), 15)
                assert owner.seen[2], "the new worker took a share"
                assert len(owner.flips) == flips, owner.flips[flips:]

                # a worker killed: started again with its shard, resumed (no flip)
                pid = pool.pids()[1]
                os.kill(pid, signal.SIGKILL)
                await owner.until(
                    "a new worker", lambda: len(pool.pids()) == 3 and pool.pids()[1] != pid, 15
                )
                owner.seen.clear()
                await owner.until("each probed by one, again", once_each(3), 15)
                assert len(owner.flips) == flips, owner.flips[flips:]

                # four endpoints stopped: probed no more (so their listeners
                # may go, and nothing flips); one listener closed: it flips
                stopped = targets[:4]
                for t in stopped:
                    del owner.targets[t.slot]
                gone = [endpoint_path(t.backend_service, t.ip, t.port) for t in stopped]
                pool.change([], gone)
                paths -= set(gone)
                owner.seen.clear()
                await owner.until("the stopped ones probed no more", once_each(3), 10)
                for s in servers[:5]:
                    await s.__aexit__(None, None, None)
                down = endpoint_path(service, "127.0.0.1", servers[4].port)
                await owner.until(
                    "the closed one UNHEALTHY",
                    lambda: owner.state_of(owner.slots[down])[0] is HealthState.UNHEALTHY,
                    10,
                )
                assert {d.path for d in owner.flips[flips:]} == {down}

                # a changed check (a port where nothing listens): each worker
                # probes its share under it, and every endpoint fails
                elsewhere, _ = a_check_and_service(port=free_port())
                changed = [
                    ProbeTarget(t.slot, t.backend_service, t.ip, t.port, elsewhere)
                    for t in owner.targets.values()
                ]
                owner.targets = {t.slot: t for t in changed}
                pool.change(changed, [])
                await owner.until(
                    "every endpoint UNHEALTHY under the changed check",
                    lambda: all(
                        owner.state_of(t.slot)[0] is HealthState.UNHEALTHY for t in changed
                    ),
                    15,
                )
                owner.seen.clear()
                await owner.until("each probed by one, still", once_each(3), 10)
                settled = len(owner.flips)

                # a message a worker cannot take (an endpoint of a backend
                # service it was never given a check for): it starts afresh
                # with its whole shard, and nothing flips
                pid = pool.pids()[0]
                stranger = endpoint_path(f"{service}-other", "127.0.0.1", 1)
                pool.supervisor.send(0, Probe({}, [(stranger, 0, 0.0)], []))
                await owner.until(
                    "worker 0 started afresh",
                    lambda: pid not in pool.pids() and len(pool.pids()) == 3,
                    15,
                )
                owner.seen.clear()
                await owner.until("each probed by one, after", once_each(3), 15)
                assert len(owner.flips) == settled, owner.flips[settled:]
            finally:
                await pool.close()

    run_async(go(), timeout=120)
