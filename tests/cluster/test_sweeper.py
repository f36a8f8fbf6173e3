"""The leader deletes the opinions of endpoints gone from the world, and of
vantages they no longer have (cluster/sweeper.py), against a real etcd
member: only at the second look that finds them unchanged, never one
written meanwhile, never without the leader's election key."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest

from healthgate.cluster.opinions import OPINIONS, Opinion, opinion_key, parse_opinion
from healthgate.cluster.sweeper import OpinionSweeper
from healthgate.health.states import HealthState
from healthgate.store.base import Guard
from healthgate.store.etcd_client import MAX_OPS, EtcdClient
from tests.helpers import run_async

pytestmark = pytest.mark.cluster

ELECTION = "m/election/leader"
ENDPOINTS = [
    f"projects/p/regions/r1/backendServices/b/endpoints/10.0.{i // 250}.{i % 250}:80"
    for i in range(260)  # more than two transactions' worth of keys
]


def say(client: EtcdClient, paths: list[str], state: str = "HEALTHY") -> None:
    value = {"state": state, "since": 1.7e9, "reason": "probed", "node": "n1"}
    client.put(
        [(opinion_key(p, v), json.dumps(value).encode()) for p in paths for v in ("r1", "r2")]
    )


def held(client: EtcdClient) -> dict[str, dict[str, Opinion]]:
    """The opinions as a node holds them (from its watch: here, listed)."""
    out: dict[str, dict[str, Opinion]] = {}
    for kv in client.list_prefix(OPINIONS)[1]:
        path, vantage, op = parse_opinion(kv)
        assert op is not None
        out.setdefault(path, {})[vantage] = op
    return out


def stored(client: EtcdClient) -> set[str]:
    return {kv.key for kv in client.list_prefix(OPINIONS)[1]}


def vantages_in(world: set[str]) -> Callable[[str], tuple[str, ...] | None]:
    """Every endpoint of ``world`` has both vantages; the others are gone."""
    return lambda path: ("r1", "r2") if path in world else None


def leader(client: EtcdClient) -> Guard:
    created, revision = client.create(ELECTION, b"n1", 0)
    assert created
    return Guard(ELECTION, revision)


def test_opinions_of_endpoints_gone_are_deleted_at_the_second_look(client: EtcdClient) -> None:
    say(client, ENDPOINTS)
    guard = leader(client)
    world = set(ENDPOINTS[:40])
    sweeper = OpinionSweeper(client, lambda: held(client), vantages_in(world), lambda: guard)
    assert run_async(sweeper.sweep()) == 0  # first look: suspects only
    assert len(stored(client)) == 2 * len(ENDPOINTS)
    # meanwhile one endpoint is probed again (its opinion rewritten): not due yet
    back = ENDPOINTS[100]
    say(client, [back], "UNHEALTHY")
    gone = len(ENDPOINTS) - len(world) - 1
    assert run_async(sweeper.sweep()) == 2 * gone
    assert sweeper.swept == 2 * gone
    assert stored(client) == {opinion_key(p, v) for p in [*world, back] for v in ("r1", "r2")}
    # the rewritten one goes one look later, unchanged since
    assert run_async(sweeper.sweep()) == 2
    assert stored(client) == {opinion_key(p, v) for p in world for v in ("r1", "r2")}
    assert run_async(sweeper.sweep()) == 0


def test_an_opinion_written_after_the_look_is_kept_and_the_rest_deleted(
    client: EtcdClient,
) -> None:
    say(client, ENDPOINTS[: MAX_OPS // 2 + 10])  # two vantages each: more than one transaction
    guard = leader(client)
    sweeper = OpinionSweeper(client, lambda: held(client), lambda _path: None, lambda: guard)
    sweeper.due(run_async(sweeper.look()))
    due = sweeper.due(run_async(sweeper.look()))
    assert len(due) == 2 * (MAX_OPS // 2 + 10)
    # between the look and the delete: the endpoint is back and its prober writes
    say(client, [ENDPOINTS[3]], "UNHEALTHY")
    deleted = sweeper.delete(due, guard)
    assert deleted == len(due) - 2  # (its batch failed as a whole, then went key by key)
    assert stored(client) == {opinion_key(ENDPOINTS[3], v) for v in ("r1", "r2")}


def test_a_node_that_does_not_lead_deletes_nothing(client: EtcdClient) -> None:
    say(client, ENDPOINTS[:20])
    guard = leader(client)
    leading = [True]
    sweeper = OpinionSweeper(
        client, lambda: held(client), lambda _path: None, lambda: guard if leading[0] else None
    )
    run_async(sweeper.sweep())
    leading[0] = False  # deposed: it forgets what it suspected
    assert run_async(sweeper.sweep()) == 0
    leading[0] = True
    assert run_async(sweeper.sweep()) == 0  # a first look again
    # its election key gone (a lease that ended before the node noticed): nothing deleted
    client.delete(ELECTION)
    assert run_async(sweeper.sweep()) == 0
    assert len(stored(client)) == 40


def test_opinions_of_a_vantage_an_endpoint_no_longer_has_are_deleted(client: EtcdClient) -> None:
    """A health check's vantageRegions lost r2: r2's opinions of its
    endpoints count for nothing and go; r1's stay. The endpoints of
    another check that still lists r2 keep both."""
    say(client, ENDPOINTS[:20])
    guard = leader(client)
    narrowed = set(ENDPOINTS[:10])

    def vantages(path: str) -> tuple[str, ...] | None:
        return ("r1",) if path in narrowed else ("r1", "r2")

    sweeper = OpinionSweeper(client, lambda: held(client), vantages, lambda: guard)
    assert run_async(sweeper.sweep()) == 0  # first look: suspects only
    assert run_async(sweeper.sweep()) == len(narrowed)
    kept = {opinion_key(p, v) for p in ENDPOINTS[:20] for v in ("r1", "r2")}
    assert stored(client) == kept - {opinion_key(p, "r2") for p in narrowed}
    assert run_async(sweeper.sweep()) == 0


def test_a_look_lets_the_event_loop_run_between_its_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A look goes LOOK_STEP endpoints at a time and lets the loop turn in
    between (at 200,000 endpoints it is ~0.15 s of Python); an endpoint
    whose opinions went meanwhile is passed over, one that left the world
    meanwhile is found."""
    monkeypatch.setattr("healthgate.cluster.sweeper.LOOK_STEP", 10)
    op = Opinion(HealthState.HEALTHY, 1.7e9, "probed", "n1", 7)
    opinions = {p: {"r1": op} for p in ENDPOINTS[:25]}
    world = set(ENDPOINTS[:25])
    sweeper = OpinionSweeper(
        None,  # type: ignore[arg-type]  # (a look reads no store)
        lambda: opinions,
        vantages_in(world),
        lambda: None,
    )
    turns = []

    async def look_beside_others() -> dict[str, int]:
        async def other() -> None:
            for i in range(5):
                turns.append(i)
                if i == 0:  # between the look's first and second steps
                    del opinions[ENDPOINTS[15]]
                    world.discard(ENDPOINTS[20])
                await asyncio.sleep(0)

        task = asyncio.create_task(other())  # (its first turn comes at the look's first yield)
        found = await sweeper.look()
        await task
        return found

    found = run_async(look_beside_others())
    assert found == {opinion_key(ENDPOINTS[20], "r1"): 7}
    assert len(turns) == 5
