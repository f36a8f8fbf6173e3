"""The leader deletes the opinions of endpoints gone from the world
(cluster/sweeper.py), against a real etcd member: only at the second look
that finds them unchanged, never one written meanwhile, never without the
leader's election key."""

from __future__ import annotations

import json

import pytest

from healthgate.cluster.opinions import OPINIONS, Opinion, opinion_key, parse_opinion
from healthgate.cluster.sweeper import OpinionSweeper
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


def leader(client: EtcdClient) -> Guard:
    created, revision = client.create(ELECTION, b"n1", 0)
    assert created
    return Guard(ELECTION, revision)


def test_opinions_of_endpoints_gone_are_deleted_at_the_second_look(client: EtcdClient) -> None:
    say(client, ENDPOINTS)
    guard = leader(client)
    world = set(ENDPOINTS[:40])
    sweeper = OpinionSweeper(client, lambda: held(client), world.__contains__, lambda: guard)
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
    sweeper = OpinionSweeper(client, lambda: held(client), lambda _path: False, lambda: guard)
    sweeper.due(sweeper.look())
    due = sweeper.due(sweeper.look())
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
        client, lambda: held(client), lambda _path: False, lambda: guard if leading[0] else None
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
