"""The transition recorder on a disk that is full for a while: one log line
per attempt (no traceback), nothing lost once the disk has room again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from healthgate.controlplane.recorder import TransitionRecorder
from healthgate.health.states import HealthState, RecordKind, RouteMode, Transition
from healthgate.store.base import Guard, LogQuery, Unavailable
from healthgate.store.memory import MemoryStore
from tests.helpers import run_async


class FullForAWhile(MemoryStore):
    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def append_log(
        self, records: Sequence[Mapping[str, Any]], guard: Guard | None = None
    ) -> list[int]:
        if self.failures:
            self.failures -= 1
            raise Unavailable("/data/hg.db: cannot write (database or disk is full)")
        return super().append_log(records, guard)


def test_a_full_disk_delays_transition_records_and_loses_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = FullForAWhile(failures=2)
    record = Transition(
        1.0,
        "p",
        "r",
        RecordKind.HEALTH_SOURCE,
        "s",
        "projects/p/regions/r/healthSources/s",
        HealthState.UNKNOWN,
        HealthState.HEALTHY,
        "why",
    )

    async def go() -> None:
        recorder = TransitionRecorder(store)
        task = asyncio.create_task(recorder.run())
        recorder.on_records([record])
        await asyncio.wait_for(recorder.flush(), 10)
        task.cancel()

    with caplog.at_level(logging.ERROR, logger="healthgate.recorder"):
        run_async(go(), timeout=20)
    lines = [r for r in caplog.records if r.name == "healthgate.recorder"]
    assert len(lines) == 2 and all(r.exc_info is None for r in lines)
    assert "disk is full" in lines[0].getMessage()
    assert [e.record["name"] for e in store.query_log(LogQuery())] == ["s"]


def test_a_transition_has_one_shape_in_the_log_and_in_the_api(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import json

    from healthgate.health.states import RouteChange

    transition = Transition(
        2.5,
        "shop",
        "us-east1",
        RecordKind.HEALTH_SOURCE,
        "s",
        "projects/shop/regions/us-east1/healthSources/s",
        HealthState.HEALTHY,
        HealthState.UNHEALTHY,
        "why",
    )
    route = RouteChange(
        2.5, "web", "projects/web/global/forwardingRules/front", "a", "b", RouteMode.NORMAL, "moved"
    )
    store = MemoryStore()

    async def go() -> None:
        recorder = TransitionRecorder(store)
        task = asyncio.create_task(recorder.run())
        recorder.on_records([transition, route])
        await asyncio.wait_for(recorder.flush(), 10)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="healthgate.transitions"):
        run_async(go(), timeout=20)
    logged = [
        json.loads(r.getMessage()) for r in caplog.records if r.name == "healthgate.transitions"
    ]
    stored = [dict(e.record) for e in store.query_log(LogQuery())]
    assert logged == stored  # the API's events are these, with their id
    assert set(logged[0]) <= set(logged[1])  # a route change has every key of a transition
    assert logged[0]["timestamp"] == "1970-01-01T00:00:02.500Z"


def test_metric_labels_hold_one_kind_of_value() -> None:
    """transitions_total's `to` is a state; routes are counted by mode apart."""
    from healthgate.health.states import RouteChange

    recorder = TransitionRecorder(MemoryStore())
    recorder.on_records(
        [
            Transition(
                1.0,
                "p",
                "r",
                RecordKind.HEALTH_SOURCE,
                "s",
                "x",
                HealthState.UNKNOWN,
                HealthState.HEALTHY,
                "why",
            ),
            RouteChange(
                1.0,
                "w",
                "projects/w/global/forwardingRules/f",
                None,
                "projects/w/regions/r/networkEndpointGroups/n",
                RouteMode.NORMAL,
                "first",
            ),
        ]
    )
    assert recorder.counts == {("HealthSource", "HEALTHY"): 1, ("Route", "normal"): 1}


class AppliedButNeverAnswered(MemoryStore):
    """A frozen etcd member's trick: the first append is applied, and then
    its answer never comes (the client gives up: Unavailable)."""

    def __init__(self) -> None:
        super().__init__()
        self.lost_answers = 1

    def append_log(
        self, records: Sequence[Mapping[str, Any]], guard: Guard | None = None
    ) -> list[int]:
        ids = super().append_log(records, guard)
        if self.lost_answers:
            self.lost_answers -= 1
            raise Unavailable("etcd 127.0.0.1:2379: Deadline Exceeded")
        return ids


@pytest.mark.parametrize("idempotent", [True, False], ids=["write-ids", "without"])
def test_an_append_applied_but_never_answered_is_not_written_twice(idempotent: bool) -> None:
    """Cluster mode gives every record a write id: the retry finds the first
    attempt in the log and appends only what is not there yet."""
    store = AppliedButNeverAnswered()
    first = Transition(1.0, "p", "r", RecordKind.NEG, "n", "projects/p/regions/r/networkEndpointGroups/n",
                       HealthState.HEALTHY, HealthState.UNHEALTHY, "down")  # fmt: skip
    second = Transition(2.0, "p", "r", RecordKind.NEG, "n", first.path,
                        HealthState.UNHEALTHY, HealthState.HEALTHY, "up")  # fmt: skip

    async def go() -> None:
        recorder = TransitionRecorder(store)
        recorder.idempotent = idempotent
        task = asyncio.create_task(recorder.run())
        recorder.on_records([first])
        await asyncio.sleep(0)  # (the first batch is on its way: the second comes after)
        recorder.on_records([second])
        await asyncio.wait_for(recorder.flush(), 10)
        task.cancel()

    run_async(go(), timeout=20)
    entries = store.query_log(LogQuery())
    states = [str(e.record["to"]) for e in entries]
    if idempotent:
        assert states == ["UNHEALTHY", "HEALTHY"]
        assert all("_w" not in e.record for e in entries)  # (the write id is not read back)
    else:
        assert states.count("UNHEALTHY") == 2  # (what happened before: written twice)
