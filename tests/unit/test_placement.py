"""Who probes what in a cluster (health/placement.py): rendezvous hashing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthgate.health.placement import Moves, by_region, probers, rendezvous

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


REGIONS = ("r1", "r2", "r3")
NODES = ("a", "b", "c", "d", "e", "f")
members = st.dictionaries(st.sampled_from(NODES), st.sampled_from(REGIONS), min_size=1)


@settings(max_examples=300, deadline=None)
@given(before=members, after=members)
def test_moves_names_every_endpoint_whose_probers_change(
    before: dict[str, str], after: dict[str, str]
) -> None:
    """A membership change, asked endpoint by endpoint: never short, and
    exact for the common endpoint (one vantage, its own region) unless its
    region gained its first node or lost its last, or a node changed region."""
    moves = Moves(before, after)
    was, now = by_region(before), by_region(after)
    stayed = all(after.get(n, r) == r for n, r in before.items())
    for i, e in enumerate(ENDPOINTS[:300]):
        own = REGIONS[i % 3]
        vantages = (own,) if i % 4 else (own, REGIONS[(i + 1) % 3])
        old = probers(e, own, vantages, was)
        changed = old != probers(e, own, vantages, now)
        said = moves.moves(e, own, vantages, frozenset(old.values()))
        if changed:
            assert said, (e, old)
        elif len(vantages) == 1 and stayed and (own in before.values()) == (own in after.values()):
            assert not said, (e, old)
    assert moves.regions_changed == (set(before.values()) != set(after.values()))


def test_moves_of_one_node_leaving_and_joining_again() -> None:
    four = {"a": "r1", "b": "r1", "c": "r1", "d": "r1"}
    three = {"a": "r1", "b": "r1", "c": "r1"}
    regions4, regions3 = by_region(four), by_region(three)
    owners = {e: frozenset(probers(e, "r1", ("r1",), regions4).values()) for e in ENDPOINTS}
    leaving = Moves(four, three)
    assert [e for e in ENDPOINTS if leaving.moves(e, "r1", ("r1",), owners[e])] == [
        e for e in ENDPOINTS if owners[e] == {"d"}
    ]
    back = {e: frozenset(probers(e, "r1", ("r1",), regions3).values()) for e in ENDPOINTS}
    joining = Moves(three, four)
    assert [e for e in ENDPOINTS if joining.moves(e, "r1", ("r1",), back[e])] == [
        e for e in ENDPOINTS if owners[e] == {"d"}
    ]
    assert not leaving.regions_changed and not joining.regions_changed
