"""A cluster node that takes an endpoint over starts from the stored opinion,
or from UNKNOWN - never from a state its prober engine kept from an earlier
time it probed the endpoint (ClusterHealth without etcd: only the prober
engine, the placement and the opinions queued for writing are used)."""

from __future__ import annotations

from typing import Any, cast

from healthgate.cluster.node import ClusterHealth, ClusterSettings, opinion_key
from healthgate.health.states import HealthState, Outcome, ProbeResult
from healthgate.model.resources import Resource
from healthgate.model.validation import parse_resource
from tests.e2e.harness import e2e_world

US, EU = "us-east1", "europe-west1"


def resources(docs: list[dict[str, Any]]) -> list[Resource]:
    out = []
    for doc in docs:
        res, issues = parse_resource(doc)
        assert res is not None, issues
        out.append(res)
    return out


def us_slots(health: ClusterHealth) -> dict[str, int]:
    """This node's prober slots of us-east1's endpoints, by endpoint path."""
    return {path: slot for slot, (path, _) in health.mine.items() if f"/{US}/" in path}


def fail(health: ClusterHealth, slots: list[int], rounds: int = 3) -> None:
    for _ in range(rounds):
        health._on_results(0.0, [(s, ProbeResult(Outcome.REFUSED, 0.001)) for s in slots])


def test_a_state_left_from_standing_in_does_not_hide_the_first_flip() -> None:
    world = e2e_world(18080, 18090, (18100, 18101))
    health = ClusterHealth(cast(Any, None), ClusterSettings("c", EU))  # (no store needed)
    health.apply(resources(world))
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
    health._outbox.clear()
    health.apply(
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
    said = {k: v["state"] for k, v in health._outbox.items()}
    assert said == {opinion_key(path, EU): "UNHEALTHY" for path in again}
