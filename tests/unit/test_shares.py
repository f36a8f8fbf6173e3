"""Routes as distributions (SPEC §6): the share arithmetic as a table, its
rounding, when a change of shares is a record, and the engine in virtual time."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from envoy.config.endpoint.v3 import endpoint_pb2
from hypothesis import given
from hypothesis import strategies as st

from healthgate.dataplane.choice import Balance, UpstreamChoice, weighted
from healthgate.health.engine import HealthEngine
from healthgate.health.routing import Candidate, Share, distribute, moved, split_text
from healthgate.health.states import HealthState, RouteChange
from healthgate.integrations.verdicts import agent_answer
from healthgate.integrations.xds import build_snapshot
from tests.helpers import OK, example_world, feed, resources

H, U, K = HealthState.HEALTHY, HealthState.UNHEALTHY, HealthState.UNKNOWN


def neg(name: str, dial: int = 100, state: HealthState = H, **kw: Any) -> Candidate:
    return Candidate(f"negs/{name}", name, f"r-{name}", kw.get("priority"), state,
                     kw.get("accepted", True), kw.get("shifted", ""), dial)  # fmt: skip


CASES = [
    # (candidates in failover order, primary, expected {name: percent})
    ([neg("a"), neg("b")], "a", {"a": 100}),  # default dials: the single choice
    ([neg("a", 70), neg("b")], "a", {"a": 70, "b": 30}),
    ([neg("a", 70), neg("b", 50)], "a", {"a": 82.35, "b": 17.65}),  # 15 % handed back
    ([neg("a", 70), neg("b", state=U)], "a", {"a": 100}),  # nobody else may take it: all back
    ([neg("a", 0), neg("b")], "a", {"b": 100}),  # a dial of 0 takes nothing
    ([neg("a", 0), neg("b", 0)], "a", {"a": 100}),  # ... but never drops traffic
    ([neg("a", 50), neg("b", state=U), neg("c")], "a", {"a": 50, "c": 50}),  # UNHEALTHY skipped
    ([neg("a", 50), neg("b", shifted="x"), neg("c")], "a", {"a": 50, "c": 50}),
    ([neg("a", 50), neg("b", accepted=False), neg("c")], "a", {"a": 50, "c": 50}),
    ([neg("a", 33), neg("b", 33), neg("c", 33)], "a", {"a": 47.19, "b": 31.62, "c": 21.19}),
    ([neg("a", state=U), neg("b", 40), neg("c")], "b", {"b": 40, "c": 60}),
    # failback off: traffic stays on b, which keeps the first share
    ([neg("a", 50), neg("b", 50)], "b", {"b": 66.67, "a": 33.33}),
    ([neg("a", 60, state=K), neg("b")], "a", {"a": 60, "b": 40}),  # UNKNOWN takes its share
    ([neg("a", 70, state=U)], "a", {"a": 100}),  # FAIL_OPEN onto an UNHEALTHY NEG: all of it
    ([neg("a")], None, {}),  # FAIL_CLOSED / nothing: no share
]


@pytest.mark.parametrize(("cands", "primary", "want"), CASES)
def test_the_share_arithmetic(
    cands: list[Candidate], primary: str | None, want: dict[str, float]
) -> None:
    shares = distribute(cands, None, f"negs/{primary}" if primary else None)
    assert {s.neg.removeprefix("negs/"): s.percent for s in shares} == want
    assert list(want) == [s.neg.removeprefix("negs/") for s in shares]  # (in order)
    assert all(s.reason for s in shares)


@given(st.lists(st.integers(0, 100), min_size=1, max_size=10))
def test_shares_always_sum_to_exactly_100(dials: list[int]) -> None:
    cands = [neg(f"n{i}", d) for i, d in enumerate(dials)]
    shares = distribute(cands, None, "negs/n0")
    assert round(sum(s.percent for s in shares) * 100) == 10_000
    assert all(0 < s.percent <= 100 and abs(round(s.percent * 100) - s.percent * 100) < 1e-6
               for s in shares)  # fmt: skip


def test_a_record_only_when_a_share_appears_goes_or_moves_five_points() -> None:
    a70, b30 = Share("a", "r", 70.0, ""), Share("b", "r", 30.0, "")
    assert not moved((a70, b30), (Share("a", "r", 74.99, ""), Share("b", "r", 25.01, "")))
    assert moved((a70, b30), (Share("a", "r", 75.0, ""), Share("b", "r", 25.0, "")))
    assert moved((a70, b30), (Share("a", "r", 100.0, ""),))
    assert split_text((a70, b30)) == "70% r, 30% r"


def _world(dial: int | None) -> list[Any]:
    docs = example_world()
    for d in docs:
        if d["kind"] == "BackendService" and d["project"] == "web" and dial is not None:
            d["backends"][0]["trafficDial"] = dial
    return resources(docs)


def test_the_engine_splits_a_dialled_route_and_records_it_once() -> None:
    engine = HealthEngine()
    engine.apply(_world(None), 0.0)
    frontend = next(iter(engine.route_table().routes))
    assert len(engine.route_table().routes[frontend].shares) <= 1
    # (every endpoint HEALTHY: both NEGs take traffic)
    feed(engine, 1.0, OK, times=3)
    result = engine.apply(_world(70), 10.0)
    route = engine.route_table().routes[frontend]
    assert [s.percent for s in route.shares] == [70.0, 30.0]
    routes = [r for r in result.records if isinstance(r, RouteChange)]
    assert len(routes) == 1 and len(routes[0].shares) == 2
    assert "shares 70% " in routes[0].reason
    # a dial moved by less than 5 points: the shares change, no record
    result = engine.apply(_world(72), 20.0)
    assert [s.percent for s in engine.route_table().routes[frontend].shares] == [72.0, 28.0]
    assert not [r for r in result.records if isinstance(r, RouteChange)]


def test_the_data_planes_choice_follows_the_shares() -> None:
    """Each region once in the targets, the shares' regions first; draws by share."""
    engine = HealthEngine()
    engine.apply(_world(None), 0.0)
    feed(engine, 1.0, OK, times=3)
    choice = UpstreamChoice(engine, Balance.ROUND_ROBIN, {})
    choice.resources = engine.resources
    frontend = next(iter(engine.route_table().routes))
    unsplit = choice.targets(frontend)
    assert len(unsplit) == len(set(unsplit)) == 2  # the route's region, then its fallback
    assert all(choice.pick(frontend) == unsplit for _ in range(20))
    engine.apply(_world(70), 10.0)
    choice.resources = engine.resources
    split = choice.targets(frontend)
    assert split == unsplit  # (us-east1 still first)
    random.seed(7)
    firsts = Counter(choice.pick(frontend)[0] for _ in range(10_000))
    assert abs(firsts[split[0]] / 10_000 - 0.70) < 0.02, firsts
    engine.apply(_world(0), 20.0)  # dialled to 0: the other region first, this one its fallback
    choice.resources = engine.resources
    assert choice.targets(frontend) == [unsplit[1], unsplit[0]]


def test_envoy_and_haproxy_get_the_shares() -> None:
    """The xDS snapshot carries the shares as locality weights in priority 0
    (it used to fail on the agent's weighted answer), and the agent answers
    with each NEG's share."""
    engine = HealthEngine()
    engine.apply(_world(None), 0.0)
    feed(engine, 1.0, OK, times=3)
    engine.apply(_world(70), 10.0)
    snapshot = build_snapshot(engine, engine.resources)
    (raw,) = snapshot.assignments.values()
    cla = endpoint_pb2.ClusterLoadAssignment()
    cla.ParseFromString(raw)
    weights = {
        (e.locality.region, e.priority, e.load_balancing_weight.value) for e in cla.endpoints
    }
    assert weights == {("us-east1", 0, 7000), ("europe-west1", 0, 3000)}
    route = next(iter(engine.route_table().routes.values()))
    assert [agent_answer(engine, s.neg) for s in route.shares] == ["up 70%", "up 30%"]


WEIGHTS = [
    # (weights, rotation it must give, by letter)
    ([128, 128], "ab"),  # equal (the default): as they are
    ([3, 1], "aaba"),  # smooth: spread out, in proportion
    ([2, 1, 1], "abca"),
    ([0, 5], "b"),  # weight 0 drains: no new connection
    ([0, 0], ""),
    ([255, 1], "255a 1b"),  # 256 slots, one for b (counted)
]


@pytest.mark.parametrize(("weights", "want"), WEIGHTS)
def test_endpoint_weights_as_a_rotation(weights: list[int], want: str) -> None:
    items = [((chr(97 + i), 1), w) for i, w in enumerate(weights)]
    got = "".join(a for a, _ in weighted(items))
    if " " in want:
        counts = Counter(got)
        assert " ".join(f"{counts[c]}{c}" for c in sorted(counts)) == want
    else:
        assert got == want


def test_a_weighted_rotation_never_retries_one_endpoint_twice() -> None:
    engine = HealthEngine()
    docs = example_world()
    for d in docs:
        if d["kind"] == "NetworkEndpointGroup" and d.get("endpoints"):
            for ep, w in zip(d["endpoints"], (3, 1, 1), strict=False):
                ep["weight"] = w
    engine.apply(resources(docs), 0.0)
    feed(engine, 1.0, OK, times=3)
    for balance in Balance:
        choice = UpstreamChoice(engine, balance, {})
        choice.resources = engine.resources
        rule = next(str(p) for p in engine.resources if p.collection == "forwardingRules"
                    and p.project == "shop")  # fmt: skip
        for _ in range(10):
            tries = choice.producer_upstreams(rule, 3)
            assert len(tries) == len(set(tries)) == 3, (balance, tries)
