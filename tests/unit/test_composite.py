"""The composite truth table over every combination of 1-10 sources."""

import itertools

from healthgate.health.composite import combine
from healthgate.health.states import HealthState

STATES = list(HealthState)
THREE = [HealthState.UNKNOWN, HealthState.HEALTHY, HealthState.UNHEALTHY]


def test_truth_table_for_one_to_ten_sources() -> None:
    """Every combination of the four states for 1-8 sources, and of the
    seeds' three for 9 and 10 (4^10 alone would be a million)."""
    checked = 0
    for n in range(1, 11):
        states = STATES if n <= 8 else THREE
        for combo in itertools.product(states, repeat=n):
            sources = [(f"s{i}", s, "why") for i, s in enumerate(combo)]
            state, reason = combine(sources)
            if HealthState.UNHEALTHY in combo:
                assert state is HealthState.UNHEALTHY
                first_bad = combo.index(HealthState.UNHEALTHY)
                assert f"s{first_bad} is UNHEALTHY" in reason
            elif HealthState.UNKNOWN in combo:
                assert state is HealthState.UNKNOWN
            elif HealthState.DEGRADED in combo:  # (SPEC §9)
                assert state is HealthState.DEGRADED
                assert f"s{combo.index(HealthState.DEGRADED)} is DEGRADED" in reason
            else:
                assert state is HealthState.HEALTHY
            checked += 1
    assert checked == sum(4**n for n in range(1, 9)) + 3**9 + 3**10


def test_no_sources_is_unknown() -> None:
    assert combine([])[0] is HealthState.UNKNOWN


def test_reason_names_the_failing_sources() -> None:
    _, reason = combine(
        [
            ("a", HealthState.HEALTHY, ""),
            ("b", HealthState.UNHEALTHY, "1 of 4"),
            ("c", HealthState.UNHEALTHY, ""),
        ]
    )
    assert reason == "health source b is UNHEALTHY: 1 of 4 (also UNHEALTHY: c)"
