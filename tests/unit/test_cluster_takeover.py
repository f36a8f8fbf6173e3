"""A cluster node that takes an endpoint over starts from the stored opinion,
or from UNKNOWN - never from a state its prober engine kept from an earlier
time it probed the endpoint (ClusterProbing without etcd: only the prober
engine, the placement and the opinions said are used)."""

from __future__ import annotations

from typing import Any, cast

from healthgate.cluster.opinions import OpinionWriter, opinion_key
from healthgate.cluster.probing import ClusterProbing, ClusterSettings
from healthgate.controlplane.health_service import HealthService
from healthgate.controlplane.probing import Feed
from healthgate.health.states import HealthState, Outcome, ProbeResult
from healthgate.model.resources import Resource
from healthgate.model.validation import parse_resource
from healthgate.probes.stats import FailureLogLimiter
from tests.e2e.harness import e2e_world

US, EU = "us-east1", "europe-west1"


def resources(docs: list[dict[str, Any]]) -> list[Resource]:
    out = []
    for doc in docs:
        res, issues = parse_resource(doc)
        assert res is not None, issues
        out.append(res)
    return out


class Said:
    """In place of the opinion writer: what the node said, by key."""

    def __init__(self) -> None:
        self.queued: dict[str, dict[str, Any]] = {}

    def say(self, path: str, vantage: str, state: HealthState, since: float, why: str) -> None:
        self.queued[opinion_key(path, vantage)] = {"state": state.name, "since": since}


def node(name: str, region: str) -> tuple[HealthService, ClusterProbing, Said]:
    made: list[ClusterProbing] = []

    def source(feed: Feed, failure_log: FailureLogLimiter) -> ClusterProbing:
        made.append(ClusterProbing(feed, ClusterSettings(name, region)))
        return made[0]

    health = HealthService(source=source)
    said = Said()
    made[0].writer = cast(OpinionWriter, said)
    return health, made[0], said


def us_slots(health: ClusterProbing) -> dict[str, int]:
    """This node's prober slots of us-east1's endpoints, by endpoint path."""
    return {path: slot for slot, (path, _) in health.mine.items() if f"/{US}/" in path}


def fail(health: ClusterProbing, slots: list[int], rounds: int = 3) -> None:
    for _ in range(rounds):
        health._on_results(0.0, [(s, ProbeResult(Outcome.REFUSED, 0.001)) for s in slots])


def test_a_state_left_from_standing_in_does_not_hide_the_first_flip() -> None:
    world = e2e_world(18080, 18090, (18100, 18101))
    service, health, said = node("c", EU)  # (no store needed)
    service.apply(resources(world))
    # us-east1 has no live node: c stands in for it, and sees its endpoints fail
    health.set_members({"c": EU})
    standing = us_slots(health)
    assert len(standing) == 4
    fail(health, list(standing.values()))
    assert {health.prober.table.state(s) for s in standing.values()} == {HealthState.UNHEALTHY}
    # us-east1's nodes are back: c hands the endpoints back
    health.set_members({"a": US, "c": EU})
    assert us_slots(health) == {}
    # then they are checked from europe-west1 too: c probes them for that vantage,
    # with no opinion of that vantage stored - from UNKNOWN, not the old UNHEALTHY
    said.queued.clear()
    service.apply(
        resources(
            [
                dict(d, vantageRegions=[EU])
                if d["kind"] == "HealthCheck" and d["region"] == US
                else d
                for d in world
            ]
        )
    )
    again = us_slots(health)
    assert set(again) == set(standing)
    assert {health.prober.table.state(s) for s in again.values()} == {HealthState.UNKNOWN}
    # so their failing again is a flip, and europe-west1's opinion is said
    fail(health, list(again.values()))
    states = {k: v["state"] for k, v in said.queued.items()}
    assert states == {opinion_key(path, EU): "UNHEALTHY" for path in again}


MEMBERSHIPS = [
    {"a": US, "b": US, "c": EU},
    {"a": US, "c": EU},  # b left
    {"a": US, "b": US, "c": EU, "d": EU},  # b back, d joined
    {"c": EU, "d": EU},  # us-east1 lost its last node: europe-west1 stands in
    {"a": US, "c": EU, "d": EU},  # ... and got one again
    {"a": EU, "c": EU},  # a node moved region (and d left)
    {"e": US},
]


def test_a_membership_change_places_only_what_it_moves_and_as_a_whole_placement_would() -> None:
    # us-east1's endpoints are also checked from europe-west1 (two vantages)
    world = resources(
        [
            dict(d, vantageRegions=[EU]) if d["kind"] == "HealthCheck" and d["region"] == US else d
            for d in e2e_world(18080, 18090, (18100, 18101))
        ]
    )
    service, health, _ = node("c", EU)
    service.apply(world)
    placed: list[int] = []
    place = health._place_targets

    def counted(targets: Any, changed: set[int]) -> set[str]:
        targets = list(targets)
        placed.append(len(targets))
        return place(targets, changed)

    health._place_targets = counted  # type: ignore[method-assign]
    total = len(list(service.engine.targets()))
    for members in MEMBERSHIPS:
        before = {slot: owners for slot, (_, owners) in health._placed.items()}
        placed.clear()
        health.set_members(members)
        fresh_service, fresh, _ = node("c", EU)
        fresh_service.apply(world)
        fresh.set_members(members)
        # (prober slots are the prober table's own: the same paths, not the same numbers)
        assert health._mine_by_path.keys() == fresh._mine_by_path.keys(), members
        assert sorted(health.mine.values()) == sorted(fresh.mine.values()), members
        assert health.shares == fresh.shares, members
        assert {s: o for s, (_, o) in health._placed.items()} == {
            s: o for s, (_, o) in fresh._placed.items()
        }, members
        moved = sum(1 for s, (_, o) in health._placed.items() if before.get(s) != o)
        assert moved <= sum(placed) <= total, members
    # b leaving moved b's endpoints only: fewer than the whole world
    health.set_members(MEMBERSHIPS[0])
    placed.clear()
    health.set_members(MEMBERSHIPS[1])
    assert 0 < sum(placed) < total
