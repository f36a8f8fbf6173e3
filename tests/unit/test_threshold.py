"""The endpoint threshold machine: tables and properties."""

from hypothesis import given
from hypothesis import strategies as st

from healthgate.health.states import HealthState, Outcome
from healthgate.health.threshold import step

U, H, X = HealthState.UNKNOWN, HealthState.HEALTHY, HealthState.UNHEALTHY
S, F, Q = Outcome.OK, Outcome.TIMEOUT, Outcome.SUSPECT


def run(outcomes: list[Outcome], hthr: int = 3, uthr: int = 3) -> list[HealthState]:
    state, ok, fail = U, 0, 0
    out = []
    for o in outcomes:
        state, ok, fail = step(state, ok, fail, o, hthr, uthr)
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
]


def test_threshold_table() -> None:
    for outcomes, hthr, uthr, expected in CASES:
        assert run(outcomes, hthr, uthr) == expected, (outcomes, hthr, uthr)


results = st.lists(st.sampled_from([S, F, Q]), max_size=60)
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
