"""Who probes what in a cluster (health/placement.py): rendezvous hashing."""

from __future__ import annotations

import pytest

from healthgate.health.placement import by_region, probers, rendezvous

ENDPOINTS = [
    f"projects/p/regions/r/backendServices/b/endpoints/10.0.{i // 256}.{i % 256}:80"
    for i in range(4000)
]


def test_the_share_is_even_and_the_same_on_every_call() -> None:
    nodes = ["a", "b", "c", "d"]
    owners = [rendezvous(e, nodes) for e in ENDPOINTS]
    assert owners == [rendezvous(e, list(reversed(nodes))) for e in ENDPOINTS]
    counts = {n: owners.count(n) for n in nodes}
    assert all(800 <= c <= 1200 for c in counts.values()), counts  # 1000 each, give or take


def test_a_node_leaving_moves_only_its_own_endpoints() -> None:
    before = {e: rendezvous(e, ["a", "b", "c", "d"]) for e in ENDPOINTS}
    after = {e: rendezvous(e, ["a", "b", "c"]) for e in ENDPOINTS}
    moved = [e for e in ENDPOINTS if before[e] != after[e]]
    assert moved and all(before[e] == "d" for e in moved)
    assert len(moved) == sum(1 for o in before.values() if o == "d")


def test_a_node_joining_takes_a_fair_share_from_everyone() -> None:
    before = {e: rendezvous(e, ["a", "b", "c"]) for e in ENDPOINTS}
    after = {e: rendezvous(e, ["a", "b", "c", "d"]) for e in ENDPOINTS}
    moved = [e for e in ENDPOINTS if before[e] != after[e]]
    assert all(after[e] == "d" for e in moved)
    assert 800 <= len(moved) <= 1200


def test_no_node_no_owner() -> None:
    assert rendezvous("x", []) is None


MEMBERS = {"a": "us-east1", "b": "us-east1", "c": "europe-west1"}


@pytest.mark.parametrize(
    ("members", "vantages", "want_regions", "owners_in"),
    [
        # the endpoint's own region probes it
        (MEMBERS, ("us-east1",), {"us-east1"}, {"us-east1": {"a", "b"}}),
        # a listed vantage region probes it too
        (
            MEMBERS,
            ("us-east1", "europe-west1"),
            {"us-east1", "europe-west1"},
            {"us-east1": {"a", "b"}, "europe-west1": {"c"}},
        ),
        # its own region has no live node: the others stand in
        ({"c": "europe-west1"}, ("us-east1",), {"us-east1"}, {"us-east1": {"c"}}),
        # a listed vantage with no live node has no prober (no opinion)
        ({"a": "us-east1"}, ("us-east1", "asia-east1"), {"us-east1"}, {"us-east1": {"a"}}),
        # nobody at all
        ({}, ("us-east1",), set(), {}),
    ],
)
def test_probers_per_vantage(
    members: dict[str, str],
    vantages: tuple[str, ...],
    want_regions: set[str],
    owners_in: dict[str, set[str]],
) -> None:
    got = probers("ep", "us-east1", vantages, by_region(members))
    assert set(got) == want_regions
    for region, node in got.items():
        assert node in owners_in[region]
