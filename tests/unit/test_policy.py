"""Three-valued backend-service health under a policy (SPEC §2.2)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from healthgate.health.policy import PolicyParams, evaluate
from healthgate.health.states import HealthState

U, H, X = HealthState.UNKNOWN, HealthState.HEALTHY, HealthState.UNHEALTHY


@pytest.mark.parametrize(
    ("pct", "minimum", "total", "healthy", "unknown", "expected", "reason_part"),
    [
        # the seeds' example: 75 % and 3 with 4 endpoints
        (75, 3, 4, 3, 0, H, "3 of 4 endpoints healthy (75%)"),
        (75, 3, 4, 2, 0, X, "2 of 4 endpoints healthy (50%) < minHealthyThreshold 3"),
        (75, 3, 4, 2, 1, U, "1 unknown"),
        (75, 3, 4, 1, 1, X, "even if all turn healthy"),
        (75, 3, 4, 4, 0, H, "4 of 4"),
        # defaults 60 % and 1
        (60, 1, 5, 3, 0, H, "(60%)"),
        (60, 1, 5, 2, 0, X, "(40%) < healthyPercentThreshold 60%"),
        (60, 1, 5, 2, 3, U, "3 unknown"),
        (60, 1, 0, 0, 0, X, "no endpoints"),
        (0, 0, 0, 0, 0, H, "0 of 0"),
        (0, 1, 3, 0, 0, X, "< minHealthyThreshold 1"),
        (100, 1, 3, 2, 0, X, "(66.6%)"),  # shown floored: never rounds up past the threshold
        (67, 1, 3, 2, 0, X, "(66.6%)"),
        (66, 1, 3, 2, 0, H, "(66.6%)"),
        (60, 1, 3, 0, 3, U, "0 of 3 endpoints healthy"),  # all unknown: waits
    ],
)
def test_policy_table(
    pct: int,
    minimum: int,
    total: int,
    healthy: int,
    unknown: int,
    expected: HealthState,
    reason_part: str,
) -> None:
    state, reason = evaluate(PolicyParams(pct, minimum), total, healthy, unknown)
    assert state is expected
    assert reason_part in reason


@st.composite
def counts(draw: st.DrawFn) -> tuple[int, int, int, int, int]:
    total = draw(st.integers(0, 40))
    healthy = draw(st.integers(0, total))
    unknown = draw(st.integers(0, total - healthy))
    return draw(st.integers(0, 100)), draw(st.integers(0, 45)), total, healthy, unknown


@given(counts())
def test_three_valued_means_every_completion_agrees(c: tuple[int, int, int, int, int]) -> None:
    """HEALTHY iff the policy holds however the unknown endpoints turn out,
    UNHEALTHY iff it holds for none, UNKNOWN otherwise."""
    pct, minimum, total, healthy, unknown = c
    policy = PolicyParams(pct, minimum)

    def holds(h: int) -> bool:  # the definition, in rationals
        pct_ok = (h / total * 100 >= pct) if total else pct == 0
        return h >= minimum and pct_ok

    outcomes = {holds(healthy + k) for k in range(unknown + 1)}
    state, _ = evaluate(policy, total, healthy, unknown)
    if outcomes == {True}:
        assert state is H
    elif outcomes == {False}:
        assert state is X
    else:
        assert state is U


@given(counts())
def test_more_healthy_never_hurts(c: tuple[int, int, int, int, int]) -> None:
    pct, minimum, total, healthy, unknown = c
    order = {X: 0, U: 1, H: 2}
    if unknown:
        before, _ = evaluate(PolicyParams(pct, minimum), total, healthy, unknown)
        after, _ = evaluate(PolicyParams(pct, minimum), total, healthy + 1, unknown - 1)
        assert order[after] >= order[before]
