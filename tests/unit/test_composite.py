"""The composite truth table over every combination of 1-10 sources."""

import itertools

from healthgate.health.composite import combine
from healthgate.health.states import HealthState

STATES = list(HealthState)


def test_truth_table_for_one_to_ten_sources() -> None:
    checked = 0
    for n in range(1, 11):
        for combo in itertools.product(STATES, repeat=n):
            sources = [(f"s{i}", s, "why") for i, s in enumerate(combo)]
            state, reason = combine(sources)
            if HealthState.UNHEALTHY in combo:
                assert state is HealthState.UNHEALTHY
                first_bad = combo.index(HealthState.UNHEALTHY)
                assert f"s{first_bad} is UNHEALTHY" in reason
            elif HealthState.UNKNOWN in combo:
                assert state is HealthState.UNKNOWN
            else:
                assert state is HealthState.HEALTHY
            checked += 1
    assert checked == sum(3**n for n in range(1, 11))


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
