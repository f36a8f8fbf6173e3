"""Real traffic in the engine (health/passive.py), in virtual time: the
example world with outlier detection on us-east1's backend service and a
TRAFFIC source in its composite, fed seconds of hops per address."""

from __future__ import annotations

from typing import Any

from healthgate.health.engine import HealthEngine
from healthgate.health.evidence import Hops
from healthgate.health.states import Ejection, HealthState, Record, RouteChange, Transition
from healthgate.health.types import Counts
from healthgate.model.names import ResourcePath
from tests.helpers import OK, example_world, feed, resources

H, U = HealthState.HEALTHY, HealthState.UNHEALTHY
BS = ResourcePath.parse("projects/shop/regions/us-east1/backendServices/web")
SOURCE = "projects/shop/regions/us-east1/healthSources/web-traffic"
RULE = ("127.0.1.100", 8080)  # us-east1's producer rule
E1, E2, E3, E4 = ((f"127.0.1.{i}", 8080) for i in range(1, 5))


def world(
    outliers: dict[str, Any] | None = None, traffic: dict[str, Any] | None = None
) -> list[Any]:
    docs = example_world()
    for d in docs:
        if d["kind"] == "BackendService" and d["region"] == "us-east1" and outliers is not None:
            d["outlierDetection"] = outliers
        if (
            d["kind"] == "CompositeHealthCheck"
            and d["region"] == "us-east1"
            and traffic is not None
        ):
            d["healthSources"] = [*d["healthSources"], "healthSources/web-traffic"]
    if traffic is not None:
        docs.append(
            {
                "kind": "HealthSource",
                "project": "shop",
                "region": "us-east1",
                "name": "web-traffic",
                "sourceType": "TRAFFIC",
                "sources": ["backendServices/web"],
                "trafficPolicy": traffic,
            }
        )
    return resources(docs)


def healthy_engine(docs: list[Any]) -> HealthEngine:
    engine = HealthEngine()
    engine.apply(docs, 0.0)
    feed(engine, 1.0, OK, times=3)
    return engine


def failing(n: int, kind: str = "503") -> Hops:
    return Hops(
        0, n, n if kind in ("502", "503", "504") else 0, {kind: n}, n, n, (kind,) * min(n, 10)
    )


def route_target(engine: HealthEngine) -> str | None:
    route = next(iter(engine.route_table().routes.values()))
    return route.target


def test_an_endpoint_failing_real_requests_is_ejected_and_returns_probe_state_untouched() -> None:
    engine = healthy_engine(world(outliers={"consecutiveErrors": 5, "maxEjectionPercent": 25}))
    assert E1 in engine.healthy_endpoints(BS)
    result = engine.observe_traffic(10.0, {E1: failing(5), E2: Hops(50, 0)})
    [record] = result.records
    assert isinstance(record, Ejection) and record.phase == "EJECTED"
    assert record.reason.startswith("5 consecutive errors: 503, 503, 503, 503, 503")
    assert record.until == 40.0 and result.ejected == [E1]
    assert E1 not in engine.healthy_endpoints(BS) and len(engine.healthy_endpoints(BS)) == 3
    [status] = [s for s in engine.endpoints(BS) if s.ip == E1[0]]
    assert status.state is H and status.ejected_until == 40.0  # the probes' state stands
    assert engine.counts(BS) == Counts(4, 4, 0)  # not counted as UNHEALTHY by default
    for t in range(11, 40):
        assert engine.observe_traffic(float(t), {}).records == []
    [back] = engine.observe_traffic(40.0, {}).records
    assert isinstance(back, Ejection) and back.phase == "RETURNED"
    assert E1 in engine.healthy_endpoints(BS)


def test_the_data_plane_choice_through_a_producer_rule_address_is_not_an_endpoint() -> None:
    """Hops to the producer rule's address (a consumer front end in another
    process) feed traffic sources, never an endpoint's ejection."""
    engine = healthy_engine(world(outliers={"maxEjectionPercent": 100}))
    assert engine.observe_traffic(1.0, {RULE: failing(50)}).records == []


def test_three_bad_endpoints_of_four_with_a_25_percent_cap_eject_one() -> None:
    engine = healthy_engine(world(outliers={"maxEjectionPercent": 25}))
    records = engine.observe_traffic(5.0, {E1: failing(5), E2: failing(5), E3: failing(5)}).records
    phases = sorted(r.phase for r in records if isinstance(r, Ejection))
    assert phases == ["DETECTED", "DETECTED", "EJECTED"]
    assert len(engine.healthy_endpoints(BS)) == 3


def test_count_as_unhealthy_moves_the_aggregation() -> None:
    # us-east1's policy: 75 % and at least 3 healthy of 4
    engine = healthy_engine(world(outliers={"maxEjectionPercent": 50, "countAsUnhealthy": True}))
    records = engine.observe_traffic(5.0, {E1: failing(5), E2: failing(5)}).records
    assert engine.counts(BS) == Counts(4, 2, 0)
    sources = [r for r in records if isinstance(r, Transition) and r.kind == "HealthSource"]
    assert [(s.name, s.current) for s in sources] == [("web-source", U)]
    assert route_target(engine) == "projects/web/regions/europe-west1/networkEndpointGroups/shop-eu"


def test_a_region_whose_probes_pass_but_traffic_fails_fails_over_and_comes_back() -> None:
    engine = healthy_engine(world(traffic={"windowSec": 10, "minimumRequests": 100, "holdSec": 20}))
    us = "projects/web/regions/us-east1/networkEndpointGroups/shop-us"
    assert route_target(engine) == us
    out: list[Record] = []
    for t in (2.0, 3.0):  # 60 requests a second, every one a 500
        out += engine.observe_traffic(t, {E1: failing(30, "500"), E2: failing(30, "500")}).records
    [source] = [r for r in out if isinstance(r, Transition) and r.kind == "HealthSource"]
    assert source.current is U and source.time == 3.0
    assert source.reason.startswith("120 of 120 requests failed (100.0 %) in 10 s: 500 ×120")
    [composite] = [r for r in out if isinstance(r, Transition) and r.kind == "CompositeHealthCheck"]
    assert composite.reason.startswith("health source web-traffic is UNHEALTHY: 120 of 120")
    [route] = [r for r in out if isinstance(r, RouteChange)]
    assert route.current is not None and route.current.endswith("shop-eu")
    # the traffic moved away: too little to judge from t = 12 (the second at
    # t = 2 leaves the window); holdSec later, probes are trusted again
    out = []
    for t in range(4, 32):
        out += engine.observe_traffic(float(t), {}).records
    assert out == []
    out = engine.observe_traffic(32.0, {}).records
    [source] = [r for r in out if isinstance(r, Transition) and r.kind == "HealthSource"]
    assert source.current is H and "trusting probes again" in source.reason
    assert route_target(engine) == us


def test_cluster_mode_leaves_the_state_to_the_quorum() -> None:
    engine = healthy_engine(world(traffic={"windowSec": 10, "minimumRequests": 10}))
    engine.passive.local_traffic = False
    result = engine.observe_traffic(2.0, {E1: failing(20, "500")})
    assert result.records == [] and result.verdicts[SOURCE].state is U
    assert engine.node_status(SOURCE).state is H  # type: ignore[union-attr]
    records = engine.set_traffic(3.0, SOURCE, U, "2 of 3 nodes ...")
    assert any(isinstance(r, RouteChange) for r in records)
    assert engine.node_status(SOURCE).state is U  # type: ignore[union-attr]


def test_nothing_watched_costs_nothing() -> None:
    engine = healthy_engine(world())
    assert not engine.passive.watching(1.0)
    assert engine.observe_traffic(1.0, {E1: failing(100)}).records == []
