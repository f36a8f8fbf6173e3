"""The endpoint threshold machine: tables and properties."""

from hypothesis import given
from hypothesis import strategies as st

from healthgate.health.states import HealthState, Outcome
from healthgate.health.threshold import step

U, H, X = HealthState.UNKNOWN, HealthState.HEALTHY, HealthState.UNHEALTHY
D = HealthState.DEGRADED
S, F, Q = Outcome.OK, Outcome.TIMEOUT, Outcome.SUSPECT
G = Outcome.DEGRADED  # a degraded success (SPEC §9)


def run(outcomes: list[Outcome], hthr: int = 3, uthr: int = 3) -> list[HealthState]:
    state, ok, fail, clean = U, 0, 0, 0
    out = []
    for o in outcomes:
        state, ok, fail, clean = step(state, ok, fail, o, hthr, uthr, clean)
        out.append(state)
    return out


CASES = [
    # (results, healthyThreshold, unhealthyThreshold, states after each)
    ([S, S, S], 3, 3, [U, U, H]),
    ([F, F, F], 3, 3, [U, U, X]),
    ([S, S, F, S, S, S], 3, 3, [U, U, U, U, U, H]),  # a failure resets the success run
    ([S, S, S, F, F, S, F, F, F], 3, 3, [U, U, H, H, H, H, H, H, X]),
    ([F, F, S, S], 2, 2, [U, X, X, H]),
    ([S, S, Q, S], 3, 3, [U, U, U, H]),  # a suspect result is no evidence either way
    ([F, Q, F], 2, 2, [U, U, X]),
    ([S] * 10, 10, 2, [U] * 9 + [H]),
    ([S, S, F, F], 2, 3, [U, H, H, H]),  # separate thresholds
    (
        [Outcome.REFUSED, Outcome.RESET, Outcome.STATUS],
        3,
        3,
        [U, U, X],
    ),  # every failure kind counts
    ([Outcome.NOT_CHECKED] * 2, 2, 2, [U, H]),
    # SPEC §9: the last healthyThreshold results successes, any degraded -> DEGRADED
    ([G, G, G], 3, 3, [U, U, D]),
    ([S, S, G], 3, 3, [U, U, D]),
    ([G, S, S], 3, 3, [U, U, D]),
    ([S, S, S, G, S, S, S], 3, 3, [U, U, H, D, D, D, H]),  # back after 3 clean ones
    ([S, S, S, G, S, F, S, S], 3, 3, [U, U, H, D, D, D, D, D]),  # (a failure: no change yet)
    ([G, G, G, F, F, F], 3, 3, [U, U, D, D, D, X]),  # DEGRADED -> UNHEALTHY
    ([F, F, G, G], 2, 2, [U, X, X, D]),  # UNHEALTHY -> DEGRADED
    ([F, F, G, S], 2, 2, [U, X, X, D]),
    ([F, F, G, S, S], 2, 2, [U, X, X, D, H]),  # UNHEALTHY -> DEGRADED -> HEALTHY
    ([S, S, F, G, S], 2, 2, [U, H, H, H, D]),  # (the degraded one in the last 2)
    ([S, S, F, G, S, S], 2, 2, [U, H, H, H, D, H]),
    ([G, Q, G, Q, G], 3, 3, [U, U, U, U, D]),  # a suspect result is no evidence
    ([S, S, G, S, S, S], 3, 3, [U, U, D, D, D, H]),
]


def test_threshold_table() -> None:
    for outcomes, hthr, uthr, expected in CASES:
        assert run(outcomes, hthr, uthr) == expected, (outcomes, hthr, uthr)


results = st.lists(st.sampled_from([S, F, Q]), max_size=60)
with_degraded = st.lists(st.sampled_from([S, F, Q, G]), max_size=60)
thresholds = st.integers(min_value=2, max_value=10)


@given(results, thresholds, thresholds)
def test_state_follows_the_last_full_run(outcomes: list[Outcome], hthr: int, uthr: int) -> None:
    """Reference model: the state is decided by the most recent run of
    `threshold` consecutive (non-suspect) equal results; UNKNOWN before any."""
    states = run(outcomes, hthr, uthr)
    relevant: list[Outcome] = []
    for i, o in enumerate(outcomes):
        if o is not Q:
            relevant.append(o)
        expected = U
        # scan runs in order; every completed run sets the state
        run_kind, run_len = None, 0
        for r in relevant:
            run_len = run_len + 1 if r is run_kind else 1
            run_kind = r
            if r is S and run_len >= hthr:
                expected = H
            if r is F and run_len >= uthr:
                expected = X
        assert states[i] is expected


@given(results, thresholds, thresholds)
def test_never_flips_on_a_single_result(outcomes: list[Outcome], hthr: int, uthr: int) -> None:
    states = run(outcomes, hthr, uthr)
    for i in range(1, len(states)):
        if states[i] is not states[i - 1] and states[i] is not U:
            # the flip needs `threshold` equal results ending here
            need = hthr if states[i] is H else uthr
            kind = S if states[i] is H else F
            tail = [o for o in outcomes[: i + 1] if o is not Q][-need:]
            assert tail == [kind] * need


@given(with_degraded, thresholds, thresholds)
def test_degraded_follows_the_last_full_run(outcomes: list[Outcome], hthr: int, uthr: int) -> None:
    """Reference model (SPEC §9): a run of ``hthr`` successes ending here sets
    DEGRADED if any of those ``hthr`` was degraded, HEALTHY otherwise; a run
    of ``uthr`` failures sets UNHEALTHY; anything else keeps the state."""
    states = run(outcomes, hthr, uthr)
    expected = U
    relevant: list[Outcome] = []
    for i, o in enumerate(outcomes):
        if o is not Q:
            relevant.append(o)
            tail = relevant[-hthr:]
            if len(tail) == hthr and all(r in (S, G) for r in tail):
                expected = D if G in tail else H
            fails = relevant[-uthr:]
            if len(fails) == uthr and all(r is F for r in fails):
                expected = X
        assert states[i] is expected, (outcomes[: i + 1], states[i], expected)


@given(results, thresholds, thresholds)
def test_nothing_is_degraded_without_degraded_successes(
    outcomes: list[Outcome], hthr: int, uthr: int
) -> None:
    assert D not in run(outcomes, hthr, uthr)
