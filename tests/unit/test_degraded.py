"""DEGRADED (SPEC §9) through the engine in virtual time: endpoint, health
source, composite and PSC NEG states, the failover order and what a producer
listener serves. Without degradedStatusCodes nothing is DEGRADED: the other
engine tests are that half."""

from __future__ import annotations

import pytest

from healthgate.health.engine import HealthEngine
from healthgate.health.policy import PolicyParams, evaluate
from healthgate.health.routing import Candidate, choose, distribute
from healthgate.health.states import HealthState, Outcome, ProbeResult, RouteChange, Transition
from healthgate.health.types import Counts
from healthgate.model.names import ResourcePath
from tests.helpers import OK, TIMEOUT, example_dicts, feed, resources

U, H, X, D = (
    HealthState.UNKNOWN,
    HealthState.HEALTHY,
    HealthState.UNHEALTHY,
    HealthState.DEGRADED,
)
SHED = ProbeResult(Outcome.DEGRADED, 0.01, 429)
US = "projects/web/regions/us-east1/networkEndpointGroups/shop-us"
EU = "projects/web/regions/europe-west1/networkEndpointGroups/shop-eu"
FRONT = "projects/web/global/forwardingRules/shop-frontend"
US_BS = ResourcePath("shop", "us-east1", "backendServices", "web")
EU_BS = ResourcePath("shop", "europe-west1", "backendServices", "web")
US_SOURCE = "projects/shop/regions/us-east1/healthSources/web-source"
US_COMPOSITE = "projects/shop/regions/us-east1/compositeHealthChecks/web-composite"


def settled() -> HealthEngine:
    engine = HealthEngine()
    engine.apply(resources(example_dicts()), 0.0)
    feed(engine, 1.0, OK, times=3)
    return engine


def state(engine: HealthEngine, path: str) -> HealthState:
    status = engine.node_status(path)
    assert status is not None
    return status.state


def route(engine: HealthEngine) -> str | None:
    return engine.route_table().routes[FRONT].target


@pytest.mark.parametrize(
    ("pct", "minimum", "counts", "expected", "reason_part"),
    [
        # (total, healthy, unknown, degraded); degraded ones count as healthy
        (75, 3, (4, 3, 0, 1), H, "3 of 4 endpoints healthy"),  # holds without them
        (75, 3, (4, 2, 0, 1), D, "only with the degraded ones"),
        (75, 3, (4, 0, 0, 4), D, "4 of 4 (100%) hold"),
        (75, 3, (4, 1, 0, 1), X, "1 degraded"),
        (75, 3, (4, 1, 1, 1), U, "1 unknown"),  # 3 of 4 if the unknown one turns out
        (75, 3, (4, 2, 1, 1), D, "only with the degraded ones"),  # (known already)
        (75, 3, (4, 0, 1, 1), X, "even if all turn healthy"),
        (60, 1, (5, 0, 0, 3), D, "3 of 5 (60%)"),
        (60, 1, (5, 0, 0, 2), X, "< healthyPercentThreshold 60%"),
    ],
)
def test_the_policy_counts_degraded_endpoints_as_healthy(
    pct: int,
    minimum: int,
    counts: tuple[int, int, int, int],
    expected: HealthState,
    reason_part: str,
) -> None:
    got, reason = evaluate(PolicyParams(pct, minimum), *counts)
    assert got is expected, reason
    assert reason_part in reason


def test_a_degraded_region_loses_its_traffic_and_gets_it_back() -> None:
    """One us-east1 endpoint answering 429: that endpoint is DEGRADED, but 3
    of 4 hold the 75 %/3 policy alone - HEALTHY. Two: the policy holds only
    thanks to them - source, composite and NEG DEGRADED, and traffic moves to
    europe-west1 (HEALTHY). Clean answers again: back (failback on)."""
    engine = settled()
    feed(engine, 2.0, SHED, ip_prefix="127.0.1.1", times=1)
    statuses = {e.ip: e for e in engine.endpoints(US_BS)}
    assert statuses["127.0.1.1"].state is D
    assert "degradedStatusCodes" in statuses["127.0.1.1"].reason
    assert "429" in statuses["127.0.1.1"].reason
    assert state(engine, US_SOURCE) is H and route(engine) == US
    assert engine.counts(US_BS) == Counts(4, 3, 0, 1)

    records = feed(engine, 3.0, SHED, ip_prefix="127.0.1.2", times=1)
    assert state(engine, US_SOURCE) is D
    assert state(engine, US_COMPOSITE) is D
    assert state(engine, US) is D
    assert route(engine) == EU
    moved = [r for r in records if isinstance(r, RouteChange)]
    assert moved and "is DEGRADED: moving to shop-eu" in moved[-1].reason
    # the composite's reason names the degraded source
    status = engine.node_status(US_COMPOSITE)
    assert status is not None and "web-source is DEGRADED" in status.reason

    feed(engine, 4.0, OK, ip_prefix="127.0.1.", times=3)  # 3 clean answers each
    assert state(engine, US) is H
    assert route(engine) == US


def test_a_degraded_region_keeps_traffic_when_nothing_is_healthy() -> None:
    engine = settled()
    feed(engine, 2.0, TIMEOUT, ip_prefix="127.0.2.", times=3)  # europe-west1 down
    assert state(engine, EU) is X
    feed(engine, 3.0, SHED, ip_prefix="127.0.1.", times=1)  # every us-east1 endpoint 429
    assert state(engine, US) is D
    assert route(engine) == US  # eligible: traffic stays on it
    # europe-west1 recovers: traffic leaves the degraded region for it
    feed(engine, 4.0, OK, ip_prefix="127.0.2.", times=3)
    assert route(engine) == EU


def test_degraded_to_unhealthy_and_back_through_degraded() -> None:
    engine = settled()
    feed(engine, 2.0, SHED, ip_prefix="127.0.1.", times=1)
    assert state(engine, US_SOURCE) is D
    feed(engine, 3.0, TIMEOUT, ip_prefix="127.0.1.", times=3)
    assert state(engine, US_SOURCE) is X and route(engine) == EU
    feed(engine, 4.0, SHED, ip_prefix="127.0.1.", times=3)
    assert state(engine, US_SOURCE) is D and route(engine) == EU  # (HEALTHY stays first)


def test_a_producer_serves_degraded_endpoints_only_when_no_healthy_one_is_left() -> None:
    engine = settled()
    feed(engine, 2.0, SHED, ip_prefix="127.0.1.1", times=1)
    served = engine.healthy_endpoints(US_BS)
    assert ("127.0.1.1", 8080) not in served and len(served) == 3
    feed(engine, 3.0, TIMEOUT, ip_prefix="127.0.1.2", times=3)
    feed(engine, 3.0, TIMEOUT, ip_prefix="127.0.1.3", times=3)
    feed(engine, 3.0, TIMEOUT, ip_prefix="127.0.1.4", times=3)
    assert engine.healthy_endpoints(US_BS) == (("127.0.1.1", 8080),)  # the degraded one
    feed(engine, 4.0, OK, ip_prefix="127.0.1.4", times=3)
    assert engine.healthy_endpoints(US_BS) == (("127.0.1.4", 8080),)


def test_the_failover_order_puts_degraded_negs_after_every_other() -> None:
    a = Candidate("a", "a", "r1", 1, D)
    b = Candidate("b", "b", "r2", 2, H)
    c = Candidate("c", "c", "r3", 3, D)
    # failback off: traffic on a DEGRADED NEG still moves to a HEALTHY one
    got = choose([a, b, c], "r1", "a", failback=False, fail_open=False)
    assert got.target == "b" and "is DEGRADED" in got.reason
    # no HEALTHY NEG: the first degraded one in its own order keeps it
    b_down = Candidate("b", "b", "r2", 2, X)
    assert choose([a, b_down, c], "r1", "c", failback=True, fail_open=False).target == "c"
    assert choose([a, b_down, c], "r1", None, failback=True, fail_open=False).target == "a"
    # shares: a dialled HEALTHY NEG leaves the rest to the degraded ones, in order
    b70 = Candidate("b", "b", "r2", 2, H, dial=70)
    shares = distribute([a, b70, c], "r1", "b")
    assert [(s.neg, s.percent) for s in shares] == [("b", 70.0), ("a", 30.0)]


def test_simulate_rehearses_a_degraded_region() -> None:
    """``healthgate simulate``: a region answering 429 to checks that list it
    turns DEGRADED in virtual time, its traffic moves, and comes back."""
    from healthgate.simulation.runner import simulate
    from healthgate.simulation.scenario import Scenario
    from tests.helpers import example_world

    docs = example_world()
    for d in docs:
        if d["kind"] == "HealthCheck":
            d["degradedStatusCodes"] = ["429"]
    scenario = Scenario.model_validate(
        {
            "duration": 60,
            "start": "healthy",
            "events": [
                {"at": 10, "select": {"region": "us-east1"}, "status": 429},
                {"at": 40, "select": {"region": "us-east1"}, "fault": "heal"},
            ],
        }
    )
    result = simulate(resources(docs), scenario)
    negs = [
        (r.time, r.current)
        for r in result.records
        if isinstance(r, Transition) and r.kind == "NetworkEndpointGroup" and r.name == "shop-us"
    ]
    assert [s for _, s in negs] == [D, H], negs
    routes = [(r.time, str(r.current)) for r in result.records if isinstance(r, RouteChange)]
    assert routes[0][1].endswith("shop-eu") and 10 < routes[0][0] < 20, routes
    assert routes[-1][1].endswith("shop-us") and routes[-1][0] > 40, routes
