"""Multi-vantage quorum (health/vantage.py): a table of cases, then every
combination of up to five vantages against the rule written out plainly."""

from __future__ import annotations

import itertools

import pytest

from healthgate.health.states import HealthState
from healthgate.health.vantage import vantages_of, verdict

H, U, X = HealthState.HEALTHY, HealthState.UNHEALTHY, HealthState.UNKNOWN
E, W, A = "us-east1", "europe-west1", "asia-east1"


@pytest.mark.parametrize(
    ("opinions", "live", "previous", "want", "reason_has"),
    [
        # one vantage (no vantageRegions): it decides alone
        ({E: U}, {E}, H, U, "UNHEALTHY as seen from us-east1"),
        ({E: H}, {E}, U, H, "HEALTHY as seen from us-east1"),
        ({E: X}, {E}, H, H, "no vantage has an opinion yet: HEALTHY is kept"),
        ({E: U}, set(), H, H, "no live vantage"),
        ({}, set(), X, X, "UNKNOWN is kept"),
    ],
)
def test_one_vantage(
    opinions: dict[str, HealthState],
    live: set[str],
    previous: HealthState,
    want: HealthState,
    reason_has: str,
) -> None:
    state, reason = verdict(opinions, (E,), live, previous)
    assert state is want
    assert reason_has in reason


@pytest.mark.parametrize(
    ("opinions", "live", "previous", "want", "reason_has"),
    [
        # three live vantages: two say UNHEALTHY -> a quorum
        ({E: U, W: U, A: H}, {E, W, A}, H, U, "UNHEALTHY from 2 of 3 live vantages"),
        # one dissenting vantage: no failover
        ({E: H, W: U, A: H}, {E, W, A}, H, H, "europe-west1 saw it UNHEALTHY, short of a quorum"),
        ({E: U, W: H, A: H}, {E, W, A}, H, H, "short of a quorum of 2"),
        # a dead vantage has no opinion: 2 live, both must agree
        ({E: U, W: U, A: H}, {E, W}, H, U, "UNHEALTHY from 2 of 2"),
        ({E: U, W: H, A: U}, {E, W}, H, H, "HEALTHY from europe-west1"),
        # one live vantage of three decides alone
        ({E: U, W: H, A: H}, {E}, H, U, "UNHEALTHY from 1 of 1"),
        # a live vantage still UNKNOWN is no opinion, but it counts for the quorum
        (
            {E: U, W: X, A: X},
            {E, W, A},
            H,
            H,
            "us-east1 saw it UNHEALTHY, short of a quorum of 2 (no opinion yet from "
            "europe-west1, asia-east1): HEALTHY is kept",
        ),
        ({E: U, W: U, A: X}, {E, W, A}, H, U, "2 of 3"),
        # nobody alive: the last state is kept
        ({E: U, W: U, A: U}, set(), H, H, "no live vantage"),
        # recovery: one HEALTHY is enough once the quorum of UNHEALTHY is gone
        ({E: H, W: U, A: X}, {E, W, A}, U, H, "HEALTHY from us-east1"),
    ],
)
def test_three_vantages(
    opinions: dict[str, HealthState],
    live: set[str],
    previous: HealthState,
    want: HealthState,
    reason_has: str,
) -> None:
    state, reason = verdict(opinions, (E, W, A), live, previous)
    assert state is want
    assert reason_has in reason


def test_every_combination_follows_the_rule() -> None:
    regions = ["r0", "r1", "r2", "r3", "r4"]
    checked = 0
    for n in range(1, 6):
        vantages = regions[:n]
        for states in itertools.product([H, U, X, None], repeat=n):
            opinions = {r: s for r, s in zip(vantages, states, strict=True) if s is not None}
            for alive in itertools.product([True, False], repeat=n):
                live = {r for r, a in zip(vantages, alive, strict=True) if a}
                for previous in (H, U, X):
                    got, _ = verdict(opinions, vantages, live, previous)
                    said = [opinions.get(r, X) for r in vantages if r in live]
                    if said.count(U) > len(said) / 2:
                        want = U
                    elif H in said:
                        want = H
                    else:
                        want = previous
                    assert got is want, (opinions, live, previous)
                    checked += 1
    assert checked > 100_000


def test_the_own_region_always_votes_first_and_once() -> None:
    assert vantages_of(E, [W, E, A]) == (E, W, A)
    assert vantages_of(E, []) == (E,)


D = HealthState.DEGRADED


@pytest.mark.parametrize(
    ("opinions", "live", "want", "reason_has"),
    [
        # SPEC §9: up is HEALTHY when one live vantage sees it HEALTHY ...
        ({E: D, W: H, A: D}, {E, W, A}, H, "HEALTHY from europe-west1"),
        # ... DEGRADED when every one that sees it up sees it DEGRADED
        ({E: D, W: D, A: U}, {E, W, A}, D, "DEGRADED from europe-west1, us-east1"),
        ({E: D, W: U, A: U}, {E, W, A}, U, "UNHEALTHY from 2 of 3"),
        ({E: D, W: U, A: X}, {E, W, A}, D, "short of a quorum"),
        ({E: D}, {E}, D, "DEGRADED as seen from us-east1"),
    ],
)
def test_degraded_opinions(
    opinions: dict[str, HealthState], live: set[str], want: HealthState, reason_has: str
) -> None:
    vantages = tuple(opinions)
    state, reason = verdict(opinions, vantages, live, HealthState.HEALTHY)
    assert state is want
    assert reason_has in reason
