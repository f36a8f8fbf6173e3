"""Shifts in the pure engine, in virtual time (SPEC §6): a shifted NEG takes
no traffic, as if UNHEALTHY, with a reason naming who, until when and why;
a producer's shift of a region moves every consumer of it; a shift never
sends traffic to an UNHEALTHY NEG; shifts end by themselves, recorded at
their own expireTime."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from healthgate.controlplane import health_service
from healthgate.controlplane.health_service import HealthService, RecordsTo
from healthgate.health.routing import Candidate, choose
from healthgate.health.shifts import affected
from healthgate.health.states import HealthState, Record, RouteChange, ShiftEnded
from healthgate.model.resources import Shift
from tests.helpers import OK, example_dicts, feed, resources, run_async
from tests.unit.test_engine import EU, FRONT, US, fail, route, settled

H, X = HealthState.HEALTHY, HealthState.UNHEALTHY


def shift(project: str, away: str, until: float, name: str = "s1", **kw: Any) -> dict[str, Any]:
    return {
        "kind": "Shift", "project": project, "name": name, "awayFrom": away,
        "expireTime": until, "created": 1.0, "actor": "alice", "comment": "deploy 42", **kw,
    }  # fmt: skip


# a resource that moves nothing: a world change that is not a shift's
SPARE = {
    "kind": "HealthAggregationPolicy",
    "project": "shop",
    "region": "us-east1",
    "name": "spare",
}


def with_shifts(*shifts: dict[str, Any]) -> list[Any]:
    return resources([*example_dicts(), *shifts])


@pytest.mark.parametrize(
    ("shift_doc", "moved"),
    [
        (shift("web", "us-east1", 1_000.0), True),  # the consumer's NEGs in a region
        (shift("web", US, 1_000.0), True),  # one NEG by path
        (shift("shop", "us-east1", 1_000.0), True),  # the producer's attachment in a region
        (
            shift("shop", "projects/shop/regions/us-east1/serviceAttachments/web-attachment", 1e3),
            True,
        ),
        (shift("shop", "europe-west1", 1_000.0), False),  # not where traffic goes
        (shift("other", "us-east1", 1_000.0), False),  # another project's shift reaches nothing
        (shift("web", US, 5.0), False),  # expired already
    ],
)
def test_a_shift_moves_traffic_as_unhealthy_would(shift_doc: dict[str, Any], moved: bool) -> None:
    engine = settled()
    assert route(engine) == US
    records = engine.apply(with_shifts(shift_doc), 10.0).records
    assert route(engine) == (EU if moved else US)
    routes = [r for r in records if isinstance(r, RouteChange)]
    if moved:
        assert "is shifted away by alice until" in routes[0].reason
        assert "deploy 42" in routes[0].reason
        # the NEG itself stays as healthy as it is: only its traffic moved
        assert engine.node_status(US).state is H  # type: ignore[union-attr]
    else:
        assert routes == []


def test_a_shift_ends_by_itself_recorded_at_its_expire_time() -> None:
    engine = settled()
    engine.apply(with_shifts(shift("web", "us-east1", 100.0)), 10.0)
    assert route(engine) == EU and engine.next_shift_expiry(10.0) == 100.0
    assert engine.expire_shifts(99.0) == []  # (not yet)
    records = engine.expire_shifts(130.0)  # the timer fired late: records say 100.0
    ends = [r for r in records if isinstance(r, ShiftEnded)]
    assert [(e.time, e.name, e.actor) for e in ends] == [(100.0, "s1", "alice")]
    back = [r for r in records if isinstance(r, RouteChange)]
    assert [(r.time, r.current) for r in back] == [(100.0, US)]
    assert "failing back" in back[0].reason
    assert route(engine) == US and engine.next_shift_expiry(130.0) is None
    assert engine.expire_shifts(200.0) == []  # (once)


def test_a_shift_whose_end_is_past_but_not_recorded_is_still_due() -> None:
    """A world change between a shift's end and its timer's run sets the
    timer again: the end must still be due then (it once was not - the
    route stayed shifted on that node until the next shift came)."""
    engine = settled()
    engine.apply(with_shifts(shift("web", "us-east1", 100.0)), 10.0)
    # an unrelated change at 100.5: the shift's end (100.0) is not recorded yet
    engine.apply(with_shifts(shift("web", "us-east1", 100.0), SPARE), 100.5)
    assert engine.next_shift_expiry(100.5) == 100.0
    records = engine.expire_shifts(100.5)
    assert [(r.time, r.name) for r in records if isinstance(r, ShiftEnded)] == [(100.0, "s1")]
    assert route(engine) == US and engine.next_shift_expiry(100.5) is None


def test_a_shift_change_after_another_shifts_end_records_that_end_once() -> None:
    """A change of the shifts themselves landing between s1's end and its
    timer: s1's end is recorded then, at its own time, and never again."""
    engine = settled()
    engine.apply(with_shifts(shift("web", "us-east1", 100.0)), 10.0)
    later = shift("other", "us-east1", 500.0, "later")  # (another project's: reaches nothing)
    records = engine.apply(with_shifts(shift("web", "us-east1", 100.0), later), 100.5).records
    assert [(r.time, r.name) for r in records if isinstance(r, ShiftEnded)] == [(100.0, "s1")]
    assert route(engine) == US and engine.next_shift_expiry(100.5) == 500.0
    assert not [r for r in engine.expire_shifts(101.0) if isinstance(r, ShiftEnded)]
    # ... and a shift extended after its end but before its timer did not end
    engine.apply(with_shifts(shift("web", "us-east1", 200.0), later), 150.0)
    records = engine.apply(with_shifts(shift("web", "us-east1", 900.0), later), 201.0).records
    assert not [r for r in records if isinstance(r, ShiftEnded)] and route(engine) == EU


def test_the_timer_set_again_after_a_shifts_end_still_ends_it() -> None:
    run_async(_timer_set_again())


async def _timer_set_again() -> None:
    """The same on a running loop (HealthService's one timer): a change
    lands after the end, before the timer ran; the end comes at once."""
    now = [99.999]
    health = HealthService(clock=lambda: now[0])
    got: list[Record] = []
    health.listen(RecordsTo(got.extend))
    health.apply(resources(example_dicts()), 0.0)
    feed(health.engine, 1.0, OK, times=3)
    health.apply(with_shifts(shift("web", "us-east1", 100.0)), 10.0)
    assert route(health.engine) == EU
    now[0] = 100.5  # the end has passed; its timer has not run yet
    health.apply(with_shifts(shift("web", "us-east1", 100.0), SPARE))
    for _ in range(100):  # (a timer due now: the loop runs it within a few turns)
        await asyncio.sleep(0.001)
        if route(health.engine) == US:
            break
    assert route(health.engine) == US
    assert [r.name for r in got if isinstance(r, ShiftEnded)] == ["s1"]
    await health.close()


def test_the_timer_outlives_an_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An error while ending a shift is logged and tried again (a timer that
    died with it would end nothing of this process again)."""
    monkeypatch.setattr(health_service, "RETRY_EXPIRY", 0.01)
    run_async(_timer_after_an_error(monkeypatch))
    assert "could not move on" in caplog.text


async def _timer_after_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [99.999]
    health = HealthService(clock=lambda: now[0])
    health.apply(resources(example_dicts()), 0.0)
    feed(health.engine, 1.0, OK, times=3)
    health.apply(with_shifts(shift("web", "us-east1", 100.0)), 10.0)
    real = health.engine.expire_shifts
    calls = []

    def once_broken(at: float) -> list[Record]:
        calls.append(at)
        if len(calls) == 1:
            raise RuntimeError("broken once")
        return real(at)

    monkeypatch.setattr(health.engine, "expire_shifts", once_broken)
    now[0] = 100.5
    health.schedule_timers()
    for _ in range(200):
        await asyncio.sleep(0.005)
        if route(health.engine) == US:
            break
    assert route(health.engine) == US and len(calls) >= 2
    await health.close()


def test_a_longer_shift_outlives_a_shorter_one() -> None:
    engine = settled()
    docs = [shift("web", "us-east1", 100.0, "short"), shift("shop", "us-east1", 300.0, "long")]
    engine.apply(with_shifts(*docs), 10.0)
    records = engine.expire_shifts(150.0)
    assert [r.name for r in records if isinstance(r, ShiftEnded)] == ["short"]
    assert route(engine) == EU  # (still shifted by the longer one)
    records = engine.expire_shifts(301.0)
    assert route(engine) == US


def test_a_shift_never_sends_traffic_to_an_unhealthy_neg() -> None:
    engine = settled()
    fail(engine, 2.0, ["127.0.2."])  # europe-west1 UNHEALTHY
    engine.apply(with_shifts(shift("web", "us-east1", 1_000.0)), 10.0)
    assert route(engine) == US  # the shifted one keeps it: the other is UNHEALTHY
    reason = engine.route_table().routes[FRONT].reason
    assert "every other backend is UNHEALTHY" in reason and "shifted away by alice" in reason
    feed(engine, 11.0, OK, ip_prefix="127.0.2.", times=3)  # europe-west1 back: the shift applies
    assert route(engine) == EU


def test_removing_a_shift_brings_traffic_back() -> None:
    engine = settled()
    engine.apply(with_shifts(shift("web", "us-east1", 1_000.0)), 10.0)
    assert route(engine) == EU
    engine.apply(resources(example_dicts()), 20.0)
    assert route(engine) == US


def test_what_a_shift_covers() -> None:
    world = {r.path: r for r in with_shifts()}
    producer, consumer = resources(
        [shift("shop", "us-east1", 1e3), shift("web", "europe-west1", 1e3, "s2")]
    )
    assert isinstance(producer, Shift) and isinstance(consumer, Shift)
    assert affected(producer, world) == [US]
    assert affected(consumer, world) == [EU]


@pytest.mark.parametrize(
    ("states", "shifted", "current", "target"),
    [
        ((H, H), (True, False), "a", "b"),  # failover away from a shifted current
        ((H, H), (False, True), "a", "a"),
        ((H, H), (True, False), "b", "b"),  # no failback to a shifted NEG
        ((H, X), (True, False), "a", "a"),  # nothing else: the shifted, healthy one keeps it
        ((X, H), (True, False), "a", "b"),
        ((X, X), (True, False), "a", "a"),  # all UNHEALTHY: FAIL_OPEN as before
    ],
)
def test_choice_table(
    states: tuple[HealthState, HealthState],
    shifted: tuple[bool, bool],
    current: str,
    target: str,
) -> None:
    cands = [
        Candidate(name, name, region, prio, state, True, "shifted away by x" if s else "")
        for name, region, prio, state, s in zip(
            ("a", "b"), ("r1", "r2"), (0, 1), states, shifted, strict=True
        )
    ]
    choice = choose(cands, None, current, failback=True, fail_open=True)
    assert choice.target == target, choice
