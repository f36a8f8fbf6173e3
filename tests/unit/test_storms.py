"""Failover storms held (SPEC §8), in the engine's virtual time: a table of
storms and of real regional outages over the example world (us-east1: four
endpoints, europe-west1: two; six probed in all)."""

from __future__ import annotations

from typing import Any

import pytest

from healthgate.health.engine import HealthEngine
from healthgate.health.states import Hold, HoldPhase, Record, RouteChange
from healthgate.health.storms import StormSettings
from tests.helpers import OK, REFUSED, example_world, feed, resources

US = "projects/web/regions/us-east1/networkEndpointGroups/shop-us"
EU = "projects/web/regions/europe-west1/networkEndpointGroups/shop-eu"


def engine_with(percent: float, window: float = 30.0) -> HealthEngine:
    engine = HealthEngine()
    engine.set_storm_settings(StormSettings(percent, window))
    engine.apply(resources(example_world()), 0.0)
    feed(engine, 1.0, OK, times=3)
    return engine


def target(engine: HealthEngine) -> str | None:
    return next(iter(engine.route_table().routes.values())).target


def fail(engine: HealthEngine, now: float, prefix: str, result: Any = REFUSED) -> list[Record]:
    return feed(engine, now, result, prefix, times=3)


def holds(records: list[Record]) -> list[HoldPhase]:
    return [r.phase for r in records if isinstance(r, Hold)]


def at_once(engine: HealthEngine, now: float, result: Any = REFUSED) -> list[Record]:
    """Every endpoint of both regions fails in the same tick, the regions'
    results interleaved (a checker whose own network broke)."""
    targets = sorted(engine.targets(), key=lambda t: (t.ip.split(".")[3], t.ip))
    out: list[Record] = []
    for _ in range(3):
        for t in targets:
            out += engine.on_result(now, t.slot, result)
    return out


CASES = [
    # (name, percent, [(time, endpoint prefix or "*" for both at once, result)],
    #  holds, route at the end)
    ("a region failing alone is never held", 30, [(10, "127.0.1.", REFUSED)], [], EU),
    ("both regions at once: held, the route stays", 30, [(10, "*", REFUSED)], [HoldPhase.HELD], US),
    (
        "one region, then the other within the window: held, the first failover undone",
        30,
        [(10, "127.0.1.", REFUSED), (11, "127.0.2.", REFUSED)],
        [HoldPhase.HELD],
        US,
    ),
    (
        "off (0): no hold; all UNHEALTHY fails open on the first",
        0,
        [(10, "*", REFUSED)],
        [],
        US,
    ),
    (
        "a storm, then the regions come back: lifted, nothing moved",
        30,
        [(10, "*", REFUSED), (20, "*", OK)],
        [HoldPhase.HELD, HoldPhase.LIFTED],
        US,
    ),
    (
        "a storm, europe comes back: still more than the percentage, held",
        30,
        [(10, "*", REFUSED), (20, "127.0.2.", OK)],
        [HoldPhase.HELD],
        US,
    ),
    (
        "two regions, but not within the window: a regional outage, then another",
        30,
        [(10, "127.0.1.", REFUSED), (100, "127.0.2.", REFUSED)],
        [],
        US,  # (every NEG UNHEALTHY: fail open on the first)
    ),
    (
        "at or under the percentage is no storm",
        50,
        [(10, "127.0.1.1", REFUSED), (10, "127.0.1.2", REFUSED), (11, "127.0.2.1", REFUSED)],
        [],
        US,  # (us-east1 failed over at 10, europe-west1 too at 11: fail open on the first)
    ),
]


@pytest.mark.parametrize(
    ("name", "percent", "steps", "want_holds", "want_route"), CASES, ids=[c[0] for c in CASES]
)
def test_storms_and_regional_outages(
    name: str, percent: float, steps: list[Any], want_holds: list[HoldPhase], want_route: str
) -> None:
    engine = engine_with(percent)
    records: list[Record] = []
    for t, prefix, result in steps:
        if prefix == "*":
            records += at_once(engine, float(t), result)
        else:
            records += fail(engine, float(t), prefix, result)
    assert holds(records) == want_holds, name
    assert target(engine) == want_route, name
    if HoldPhase.HELD in want_holds:
        # the NEGs' records still say what was seen; a route that moved
        # before the storm was one moved back, saying so
        assert any(getattr(r, "kind", "") == "NetworkEndpointGroup" for r in records)
        routes = [r for r in records if isinstance(r, RouteChange)]
        assert not routes or "held: failover storm" in routes[-1].reason, name
        if steps[0][1] == "*":
            assert routes == [], name


def test_the_hold_record_names_the_regions_and_the_counts() -> None:
    engine = engine_with(30)
    records = fail(engine, 10.0, "127.0.1.") + fail(engine, 11.0, "127.0.2.")
    [hold] = [r for r in records if isinstance(r, Hold)]
    assert hold.regions == ("europe-west1", "us-east1") and hold.probed == 6
    assert hold.reason.startswith("5 of 6 probed endpoints (83.3 %) turned UNHEALTHY within 30 s")
    assert hold.project == "web"  # (the consumer's log has it)
    assert [h.hold_id for h in engine.holds()] == [hold.hold_id]


def test_an_admin_release_lets_routes_follow_and_starts_no_new_hold_from_the_same_storm() -> None:
    engine = engine_with(30)
    fail(engine, 10.0, "127.0.1.")
    fail(engine, 11.0, "127.0.2.")
    feed(engine, 12.0, OK, "127.0.2.", times=3)  # europe back, us-east1 still down: 4 of 6
    assert target(engine) == US
    [hold] = engine.holds()
    records = engine.release_hold(13.0, hold.hold_id, "alice")
    assert records is not None
    [released] = [r for r in records if isinstance(r, Hold)]
    assert released.phase is HoldPhase.RELEASED and released.actor == "alice"
    assert released.held == ("projects/web/global/forwardingRules/shop-frontend",)
    assert target(engine) == EU
    assert engine.release_hold(14.0, hold.hold_id, "alice") is None  # (gone)
    more = feed(engine, 14.0, REFUSED, "127.0.2.1", times=3)  # (the same storm goes on)
    assert holds(more) == []


def test_lifted_when_fewer_than_the_percentage_are_unhealthy() -> None:
    engine = engine_with(30)
    fail(engine, 10.0, "127.0.1.")
    fail(engine, 11.0, "127.0.2.")
    records = feed(engine, 20.0, OK, "127.0.1.", times=3)  # 2 of 6 down: 33 %, held still
    records += feed(engine, 21.0, OK, "127.0.2.1", times=3)  # 1 of 6: 16.7 %
    assert holds(records) == [HoldPhase.LIFTED]
    assert target(engine) == US


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="storm-hold-percent"):
        StormSettings(101)
    with pytest.raises(ValueError, match="storm-hold-window"):
        StormSettings(10, 0)
