"""Consumer route choice: priority, locality, failback, all-unhealthy."""

from dataclasses import replace

import pytest

from healthgate.health.routing import Candidate, choose, order
from healthgate.health.states import HealthState

U, H, X = HealthState.UNKNOWN, HealthState.HEALTHY, HealthState.UNHEALTHY


def negs(us: HealthState, eu: HealthState, asia: HealthState = H) -> list[Candidate]:
    return [
        Candidate("p/us", "shop-us", "us-east1", None, us),
        Candidate("p/eu", "shop-eu", "europe-west1", None, eu),
        Candidate("p/asia", "shop-asia", "asia-east1", None, asia),
    ]


def test_order_priority_then_locality_then_name() -> None:
    c = negs(H, H)
    assert [x.name for x in order(c, "us-east1")] == ["shop-us", "shop-asia", "shop-eu"]
    assert [x.name for x in order(c, "europe-west1")] == ["shop-eu", "shop-asia", "shop-us"]
    assert [x.name for x in order(c, None)] == ["shop-asia", "shop-eu", "shop-us"]
    prio = [replace(c[0], priority=5), replace(c[1], priority=1), c[2]]
    # explicit priorities first (lower first); a NEG without one comes after them all
    assert [x.name for x in order(prio, "us-east1")] == ["shop-eu", "shop-us", "shop-asia"]


@pytest.mark.parametrize(
    ("us", "eu", "asia", "current", "failback", "fail_open", "target", "mode"),
    [
        (H, H, H, None, True, True, "p/us", "normal"),  # local first
        (U, H, H, None, True, True, "p/us", "normal"),  # UNKNOWN is not a failure
        (X, H, H, None, True, True, "p/asia", "normal"),  # next by name among remote
        (X, H, H, "p/us", True, True, "p/asia", "normal"),  # failover
        (X, U, X, "p/us", True, True, "p/eu", "normal"),  # failover to UNKNOWN rather than nothing
        (H, H, H, "p/asia", True, True, "p/us", "normal"),  # failback
        (U, H, H, "p/asia", True, True, "p/asia", "normal"),  # UNKNOWN is not a recovery
        (H, H, H, "p/asia", False, True, "p/asia", "normal"),  # failback off: stay
        (
            H,
            H,
            X,
            "p/asia",
            False,
            True,
            "p/us",
            "normal",
        ),  # failback off, current failed: first eligible
        (X, X, X, "p/us", True, True, "p/us", "fail-open"),  # FAIL_OPEN keeps the first
        (X, X, X, "p/eu", True, True, "p/us", "fail-open"),
        (X, X, X, "p/us", True, False, None, "fail-closed"),
        (X, H, X, "p/us", True, False, "p/eu", "normal"),
        (H, H, H, "p/gone", True, True, "p/us", "normal"),  # current left the service
    ],
)
def test_route_choice(
    us: HealthState,
    eu: HealthState,
    asia: HealthState,
    current: str | None,
    failback: bool,
    fail_open: bool,
    target: str | None,
    mode: str,
) -> None:
    choice = choose(negs(us, eu, asia), "us-east1", current, failback, fail_open)
    assert (choice.target, choice.mode) == (target, mode)
    assert choice.reason


def test_unaccepted_connection_is_never_a_candidate() -> None:
    c = negs(H, H)
    c[0] = replace(c[0], accepted=False)
    assert choose(c, "us-east1", None, True, True).target == "p/asia"
    everything_down = [replace(x, state=X) for x in c]
    # FAIL_OPEN does not open a connection the producer refused
    assert choose(everything_down, "us-east1", None, True, True).target == "p/asia"
    none = [replace(x, accepted=False) for x in c]
    assert choose(none, "us-east1", None, True, True).target is None
