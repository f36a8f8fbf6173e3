"""What a resource write causes is recorded at the commit's stored time, on
every node alike (issue 38, "Correctness in cluster mode").

Two control planes follow one store, as two cluster nodes do, each with its
own clock (one two minutes ahead). A traffic dial applied through one
of them moves the route: both record the route change at the same time -
the commit's - so that a new writer taking over finds the old writer's
record of it in the log, and does not write its own again. (Before, each
recorded it at its own clock's time.)"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from healthgate.controlplane.health_service import HealthService, RecordsTo
from healthgate.controlplane.resources import ControlPlane
from healthgate.health.states import Record, RouteChange
from healthgate.model.validation import Document
from healthgate.store.memory import MemoryStore
from tests.helpers import OK, example_world, feed, resources, run_async


def world(dial: int | None) -> list[Document]:
    docs = example_world()
    for d in docs:
        if d["kind"] == "BackendService" and d["project"] == "web" and dial is not None:
            d["backends"][0]["trafficDial"] = dial
    return [Document(r) for r in resources(docs)]


class Node:
    def __init__(self, store: MemoryStore, clock: Callable[[], float]) -> None:
        self.health = HealthService(clock=clock)
        self.control = ControlPlane(store, self.health)
        self.records: list[Record] = []
        self.health.listen(RecordsTo(self.records.extend))

    def routes(self) -> list[RouteChange]:
        return [r for r in self.records if isinstance(r, RouteChange)]


# (a node whose clock is behind the writer's records at its own now - a
# time ahead of it is never applied: NTP keeps clocks within milliseconds)
@pytest.mark.parametrize("skew", [0.0, 120.0])
def test_a_route_change_caused_by_a_write_is_timed_by_the_commit_on_every_node(
    skew: float,
) -> None:
    async def go() -> tuple[list[Any], float, float]:
        store = MemoryStore()
        a = Node(store, time.time)
        b = Node(store, lambda: time.time() + skew)
        for node in (a, b):
            await node.control.load()
            node.control.start()
        try:
            outcome = await a.control.apply(world(None))
            assert outcome.revision is not None
            await b.control.wait_for_revision(outcome.revision)
            for node in (a, b):  # every endpoint HEALTHY on both
                now = node.health.clock()
                for record_batch in (feed(node.health.engine, now, OK, times=3),):
                    node.health.emit(record_batch)
            before = time.time()
            outcome = await a.control.apply(world(70))
            after = time.time()
            assert outcome.revision is not None
            await b.control.wait_for_revision(outcome.revision)
            changes = [a.routes()[-1], b.routes()[-1]]
            return changes, before, after
        finally:
            for node in (a, b):
                await node.control.close()
                await node.health.close()

    (on_a, on_b), before, after = run_async(go())
    assert "70%" in on_a.reason and "70%" in on_b.reason
    assert on_a.time == on_b.time  # one time, whichever node computed it
    assert before <= on_a.time <= after  # ... the commit's (the store's clock)
