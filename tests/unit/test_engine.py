"""The engine end to end in virtual time: endpoints to routes, and resource changes."""

from typing import Any

import pytest

from healthgate.health import graph as graph_module
from healthgate.health import policy as policy_module
from healthgate.health.engine import HealthEngine
from healthgate.health.states import HealthState, Outcome, ProbeResult, RouteChange, Transition
from healthgate.health.types import Counts
from healthgate.model.names import ResourcePath
from tests.helpers import OK, TIMEOUT, example_dicts, feed, find, non_endpoint, resources

US = "projects/web/regions/us-east1/networkEndpointGroups/shop-us"
EU = "projects/web/regions/europe-west1/networkEndpointGroups/shop-eu"
FRONT = "projects/web/global/forwardingRules/shop-frontend"
US_BS = ResourcePath("shop", "us-east1", "backendServices", "web")
US_SOURCE = "projects/shop/regions/us-east1/healthSources/web-source"
US_COMPOSITE = "projects/shop/regions/us-east1/compositeHealthChecks/web-composite"
U, H, X = HealthState.UNKNOWN, HealthState.HEALTHY, HealthState.UNHEALTHY


def settled(dicts: list[dict[str, Any]] | None = None) -> HealthEngine:
    engine = HealthEngine()
    engine.apply(resources(dicts or example_dicts()), 0.0)
    feed(engine, 1.0, OK, times=3)
    return engine


def route(engine: HealthEngine) -> str | None:
    return engine.route_table().routes[FRONT].target


def fail(
    engine: HealthEngine, now: float, ips: list[str], result: ProbeResult = TIMEOUT
) -> list[Any]:
    out = []
    for ip in ips:
        out += feed(engine, now, result, ip_prefix=ip, times=3)
    return out


def test_converges_and_routes_to_the_local_region() -> None:
    engine = settled()
    assert route(engine) == US
    status = engine.node_status(US)
    assert status is not None and status.state is H
    assert engine.counts(US_BS) == Counts(4, 4, 0)


def test_seed_policy_75_and_3_through_the_engine() -> None:
    engine = settled()
    fail(engine, 2.0, ["127.0.1.1"])  # 3 of 4 healthy: still HEALTHY
    assert engine.node_status(US_SOURCE).state is H  # type: ignore[union-attr]
    assert route(engine) == US
    records = fail(engine, 3.0, ["127.0.1.2"])  # 2 of 4: UNHEALTHY, and traffic moves
    assert engine.node_status(US_SOURCE).state is X  # type: ignore[union-attr]
    kinds = [(r.kind, getattr(r, "current", None)) for r in non_endpoint(records)]
    assert kinds == [
        ("HealthSource", X),
        ("CompositeHealthCheck", X),
        ("NetworkEndpointGroup", X),
        ("Route", EU),
    ]
    src = next(r for r in records if r.kind == "HealthSource")
    assert (
        src.reason
        == "2 of 4 endpoints healthy (50%) < minHealthyThreshold 3 and < healthyPercentThreshold 75%"
    )
    # recovery: one endpoint back -> 3 of 4 -> failback
    back = feed(engine, 4.0, OK, ip_prefix="127.0.1.2", times=3)
    assert route(engine) == US
    assert isinstance(back[-1], RouteChange) and "failing back" in back[-1].reason


def test_route_table_snapshots_are_immutable_and_versioned() -> None:
    engine = settled()
    before = engine.route_table()
    fail(engine, 2.0, ["127.0.1."])
    after = engine.route_table()
    assert after.version > before.version
    assert before.routes[FRONT].target == US and after.routes[FRONT].target == EU
    with pytest.raises(TypeError):
        after.routes[FRONT] = before.routes[FRONT]  # type: ignore[index]


def test_dry_run_is_evaluated_and_logged_but_delivers_unknown() -> None:
    dicts = example_dicts()
    find(dicts, "CompositeHealthCheck", "web-composite", "us-east1")["mode"] = "DRY_RUN"
    engine = settled(dicts)
    assert engine.node_status(US_COMPOSITE).state is H  # type: ignore[union-attr]
    neg = engine.node_status(US)
    assert neg is not None and neg.state is U and "DRY_RUN" in neg.reason
    records = fail(engine, 2.0, ["127.0.1."])
    assert [r.kind for r in non_endpoint(records)] == ["HealthSource", "CompositeHealthCheck"]
    assert route(engine) == US  # nothing moved


def test_accept_manual_refuses_projects_not_on_the_list() -> None:
    dicts = example_dicts()
    find(dicts, "ServiceAttachment", "web-attachment", "us-east1")["consumerAcceptLists"] = [
        {"projectIdOrNum": "other"}
    ]
    engine = settled(dicts)
    neg = engine.node_status(US)
    assert neg is not None and neg.state is U
    assert "not on the consumerAcceptLists" in neg.reason
    assert route(engine) == EU  # the refused region gets no traffic even though it is local


def test_a_neg_whose_attachment_has_no_composite_is_unknown_and_moves_nothing() -> None:
    dicts = [
        d
        for d in example_dicts()
        if not (d["kind"] == "CompositeHealthCheck" and d["region"] == "us-east1")
    ]
    engine = settled(dicts)
    neg = engine.node_status(US)
    assert neg is not None and neg.state is U and "no composite" in neg.reason
    assert route(engine) == US


def test_failback_off_stays_in_the_healthy_region() -> None:
    dicts = example_dicts()
    find(dicts, "BackendService", "shop")["failoverPolicy"] = {"failback": False}
    engine = settled(dicts)
    fail(engine, 2.0, ["127.0.1."])
    assert route(engine) == EU
    feed(engine, 3.0, OK, ip_prefix="127.0.1.", times=3)
    assert engine.node_status(US).state is H  # type: ignore[union-attr]
    assert route(engine) == EU


@pytest.mark.parametrize(
    ("policy", "target", "mode"),
    [("FAIL_OPEN", US, "fail-open"), ("FAIL_CLOSED", None, "fail-closed")],
)
def test_every_region_down(policy: str, target: str | None, mode: str) -> None:
    dicts = example_dicts()
    find(dicts, "BackendService", "shop")["failoverPolicy"] = {"whenAllUnhealthy": policy}
    engine = settled(dicts)
    fail(engine, 2.0, ["127.0.1.", "127.0.2."])
    r = engine.route_table().routes[FRONT]
    assert (r.target, r.mode) == (target, mode)


def test_unknown_moves_nothing() -> None:
    engine = settled()
    # a new policy needing 4 of 4 while one endpoint is still UNKNOWN -> source UNKNOWN
    dicts = example_dicts()
    neg = find(dicts, "NetworkEndpointGroup", "web-neg", "us-east1")
    neg["endpoints"].append({"ipAddress": "127.0.1.5", "port": 8080})
    find(dicts, "HealthAggregationPolicy", "strict")["healthyPercentThreshold"] = 100
    engine.apply(resources(dicts), 5.0)
    assert engine.node_status(US_SOURCE).state is U  # type: ignore[union-attr]
    assert engine.node_status(US).state is U  # type: ignore[union-attr]
    assert route(engine) == US


def test_disabled_check_counts_endpoints_healthy_not_checked() -> None:
    dicts = example_dicts()
    find(dicts, "HealthCheck", "http-8080", "europe-west1")["enabled"] = False
    engine = HealthEngine()
    engine.apply(resources(dicts), 0.0)
    eu_targets = [t for t in engine.targets() if t.ip.startswith("127.0.2.")]
    assert eu_targets == []
    eps = engine.endpoints(ResourcePath("shop", "europe-west1", "backendServices", "web"))
    assert {e.state for e in eps} == {H} and all("not checked" in e.reason for e in eps)
    assert engine.node_status(EU).state is H  # type: ignore[union-attr]
    # enabling it again: endpoints wait for probes, logged as transitions
    find(dicts, "HealthCheck", "http-8080", "europe-west1")["enabled"] = True
    result = engine.apply(resources(dicts), 10.0)
    assert len(result.added) == 2
    assert [
        (r.kind, r.current)
        for r in result.records
        if isinstance(r, Transition) and r.kind == "Endpoint"
    ] == [("Endpoint", U)] * 2


def test_adding_an_endpoint_touches_only_that_endpoint() -> None:
    engine = settled()
    before = {e.ip: (e.state, e.since) for e in engine.endpoints(US_BS)}
    dicts = example_dicts()
    find(dicts, "NetworkEndpointGroup", "web-neg", "us-east1")["endpoints"].append(
        {"ipAddress": "127.0.1.9", "port": 8080}
    )
    result = engine.apply(resources(dicts), 50.0)
    assert (
        [t.ip for t in result.added] == ["127.0.1.9"]
        and result.removed == []
        and result.changed == []
    )
    after = {e.ip: (e.state, e.since) for e in engine.endpoints(US_BS)}
    assert after.pop("127.0.1.9")[0] is U
    assert after == before
    assert engine.counts(US_BS) == Counts(5, 4, 1)
    # 4 of 5 = 80 % >= 75 % and >= 3: still HEALTHY, nothing logged above endpoints
    assert non_endpoint(result.records) == []


def test_removing_an_endpoint_frees_its_slot() -> None:
    engine = settled()
    dicts = example_dicts()
    find(dicts, "NetworkEndpointGroup", "web-neg", "us-east1")["endpoints"].pop()
    result = engine.apply(resources(dicts), 50.0)
    assert len(result.removed) == 1
    assert engine.counts(US_BS) == Counts(3, 3, 0)
    assert engine.endpoint_count() == 5


def test_changing_a_policy_reevaluates_only_its_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = settled()
    calls: list[tuple[int, int, int]] = []
    real = policy_module.evaluate

    def spy(policy: Any, total: int, healthy: int, unknown: int, degraded: int = 0) -> Any:
        calls.append((total, healthy, unknown))
        return real(policy, total, healthy, unknown, degraded)

    monkeypatch.setattr(graph_module, "evaluate", spy)
    dicts = example_dicts()
    find(dicts, "HealthAggregationPolicy", "strict")["minHealthyThreshold"] = 4
    engine.apply(resources(dicts), 9.0)
    assert calls == [(4, 4, 0)]  # only us-east1's source, not europe-west1's


def test_one_flip_costs_only_its_own_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    """A world of 200 backend services: a flip evaluates one source, not 200."""
    world: list[dict[str, Any]] = []
    for i in range(200):
        region = f"r{i}"
        world += [
            {
                "kind": "HealthCheck",
                "project": "p",
                "region": region,
                "name": "hc",
                "type": "TCP",
                "port": 80,
            },
            {
                "kind": "NetworkEndpointGroup",
                "project": "p",
                "region": region,
                "name": "neg",
                "networkEndpointType": "GCE_VM_IP_PORT",
                "endpoints": [{"ipAddress": f"127.1.{i}.{j}", "port": 80} for j in range(1, 4)],
            },
            {
                "kind": "BackendService",
                "project": "p",
                "region": region,
                "name": "bs",
                "loadBalancingScheme": "INTERNAL",
                "healthChecks": ["hc"],
                "backends": [{"group": "neg"}],
            },
            {"kind": "HealthAggregationPolicy", "project": "p", "region": region, "name": "pol"},
            {
                "kind": "HealthSource",
                "project": "p",
                "region": region,
                "name": "src",
                "sources": ["bs"],
                "healthAggregationPolicy": "pol",
            },
        ]
    engine = HealthEngine()
    engine.apply(resources(world), 0.0)
    feed(engine, 1.0, OK, times=3)
    calls: list[Any] = []
    real = policy_module.evaluate

    def spy(*args: Any) -> Any:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(graph_module, "evaluate", spy)
    slot = engine.slot_of(ResourcePath("p", "r7", "backendServices", "bs"), "127.1.7.1", 80)
    assert slot is not None
    engine.on_result(2.0, slot, TIMEOUT)
    engine.on_result(2.0, slot, TIMEOUT)
    assert calls == []  # no flip yet: no evaluation at all
    engine.on_result(2.0, slot, TIMEOUT)
    assert len(calls) == 1


def test_health_status_keeps_last_result_and_reason() -> None:
    engine = settled()
    slot = engine.slot_of(US_BS, "127.0.1.3", 8080)
    assert slot is not None
    for _ in range(3):
        engine.on_result(7.0, slot, ProbeResult(Outcome.STATUS, 0.004, 503, "expected 200"))
    ep = next(e for e in engine.endpoints(US_BS) if e.ip == "127.0.1.3")
    assert ep.state is X and ep.since == 7.0 and ep.last_time == 7.0
    assert ep.last_result is not None and ep.last_result.status == 503
    assert (
        ep.reason
        == "3 consecutive failed probes (unhealthyThreshold 3); last: HTTP 503 (expected 200)"
    )


def test_destination_state_follows_composite() -> None:
    engine = settled()
    fr = "projects/shop/regions/us-east1/forwardingRules/web-fr"
    assert engine.destination_state(fr).state is H  # type: ignore[union-attr]
    fail(engine, 2.0, ["127.0.1."])
    assert engine.destination_state(fr).state is X  # type: ignore[union-attr]


def test_removing_the_consumer_side_drops_the_route() -> None:
    engine = settled()
    dicts = [d for d in example_dicts() if d["project"] != "web"]
    engine.apply(resources(dicts), 3.0)
    assert FRONT not in engine.route_table().routes


# ---------------------------------------------------------------------- what other data planes read


@pytest.mark.parametrize(
    ("broken", "when_all", "expected"),
    [
        ((), "FAIL_OPEN", ("up", "up")),
        (("127.0.1.",), "FAIL_OPEN", ("down", "up")),
        (("127.0.1.", "127.0.2."), "FAIL_OPEN", ("up", "down")),  # the first keeps the traffic
        (("127.0.1.", "127.0.2."), "FAIL_CLOSED", ("down", "down")),
    ],
)
def test_agent_answers_follow_neg_states_and_when_all_unhealthy(
    broken: tuple[str, ...], when_all: str, expected: tuple[str, str]
) -> None:
    from healthgate.integrations.verdicts import agent_answer

    dicts = example_dicts()
    find(dicts, "BackendService", "shop", "global")["failoverPolicy"] = {
        "whenAllUnhealthy": when_all
    }
    engine = settled(dicts)
    for prefix in broken:
        feed(engine, 5.0, TIMEOUT, prefix, times=3)
    assert (agent_answer(engine, US), agent_answer(engine, EU)) == expected
    assert agent_answer(engine, US.replace("shop-us", "nope")) == "maint"


def test_failover_order_is_priority_then_locality_then_name() -> None:
    engine = settled()
    order = engine.graph.failover_order("projects/web/global/forwardingRules/shop-frontend")
    assert [c.name for c, _ in order] == ["shop-us", "shop-eu"]
    assert order[0][1] == "projects/shop/regions/us-east1/serviceAttachments/web-attachment"


@pytest.mark.parametrize(
    ("broken", "when_all", "expected"),
    [
        ((), "FAIL_OPEN", ["HEALTHY", "HEALTHY"]),
        (("127.0.1.",), "FAIL_OPEN", ["UNHEALTHY", "HEALTHY"]),
        (("127.0.1.", "127.0.2."), "FAIL_OPEN", ["HEALTHY", "UNHEALTHY"]),
        (("127.0.1.", "127.0.2."), "FAIL_CLOSED", ["UNHEALTHY", "UNHEALTHY"]),
    ],
)
def test_envoy_snapshot_one_locality_per_region_in_failover_order(
    broken: tuple[str, ...], when_all: str, expected: list[str]
) -> None:
    from envoy.config.cluster.v3 import cluster_pb2
    from envoy.config.core.v3 import health_check_pb2
    from envoy.config.endpoint.v3 import endpoint_pb2

    from healthgate.integrations.xds import build_snapshot

    dicts = example_dicts()
    find(dicts, "BackendService", "shop", "global")["failoverPolicy"] = {
        "whenAllUnhealthy": when_all
    }
    world = resources(dicts)
    engine = settled(dicts)
    for prefix in broken:
        feed(engine, 5.0, TIMEOUT, prefix, times=3)
    snap = build_snapshot(engine, {r.path: r for r in world})
    assert list(snap.clusters) == ["web/shop"]
    cluster = cluster_pb2.Cluster.FromString(snap.clusters["web/shop"])
    assert cluster.type == cluster_pb2.Cluster.EDS
    assert cluster.common_lb_config.healthy_panic_threshold.value == 0.0  # never panic
    cla = endpoint_pb2.ClusterLoadAssignment.FromString(snap.assignments["web/shop"])
    assert cla.policy.overprovisioning_factor.value == 100  # fail over whole, not gradually
    assert [(e.priority, e.locality.region) for e in cla.endpoints] == [
        (0, "us-east1"),
        (1, "europe-west1"),
    ]
    states = [
        health_check_pb2.HealthStatus.Name(e.lb_endpoints[0].health_status) for e in cla.endpoints
    ]
    assert states == expected
