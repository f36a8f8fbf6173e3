"""The outcome history (health/history.py): what goes in comes back out -
every run's first ten results at their exact times, its count and its last
result - and it costs what the module doc says."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from healthgate.health.history import EXACT, EndpointHistory, OutcomeHistory, decode, runs_of
from healthgate.health.states import Outcome, ProbeResult

OK = ProbeResult(Outcome.OK, 0.012, 200)
BAD = ProbeResult(Outcome.STATUS, 0.004, 503)
TIMEOUT = ProbeResult(Outcome.TIMEOUT, 3.0)
PATH = "projects/shop/regions/us-east1/backendServices/web/endpoints/10.0.0.1:8080"


def feed(results: list[tuple[int, ProbeResult]], max_bytes: int = 1 << 30) -> EndpointHistory:
    h = EndpointHistory(PATH)
    for t, r in results:
        h.add(t, r, max_bytes)
    return h


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 5000), st.sampled_from([OK, BAD, TIMEOUT])),
        min_size=1,
        max_size=400,
    )
)
def test_every_run_comes_back_with_its_exact_results(steps: list[tuple[int, ProbeResult]]) -> None:
    t, results = 1_796_000_000_000, []
    for gap, r in steps:
        t += gap
        results.append((t, r))
    runs = decode(feed(results).encode())
    # the runs are the results grouped by (outcome, status), in order
    i = 0
    for run in runs:
        group = []
        while i < len(results) and (results[i][1].outcome, results[i][1].status) == (
            run.outcome,
            run.status,
        ):
            group.append(results[i][0])
            i += 1
            if len(group) == run.count:
                break
        assert len(group) == run.count
        assert run.firsts == tuple(group[:EXACT]) and run.last == group[-1]
        assert list(run.times())[:EXACT] == group[:EXACT] and list(run.times())[-1] == group[-1]
    assert i == len(results)
    assert sum(r.count for r in runs) == len(results)


def test_a_steady_day_costs_a_few_dozen_bytes_and_a_flapping_one_is_bounded() -> None:
    day = 24 * 3600 * 1000
    steady = feed([(t, OK) for t in range(0, day, 2000)])
    assert len(steady.encode()) < 64, len(steady.encode())
    flapping = feed([(t, OK if (t // 2000) % 2 else BAD) for t in range(0, day, 2000)], 64 * 1024)
    assert 60 * 1024 <= sum(len(s) for s in flapping.segments) <= 64 * 1024
    kept = decode(flapping.encode())
    assert kept[-1].last == day - 2000  # (the newest kept, the oldest dropped)
    assert kept[0].start > day / 2


def test_a_reused_slot_keeps_the_old_endpoint_s_history_by_path() -> None:
    history = OutcomeHistory(hours=1)
    paths = {1: PATH}
    history.record(1000.0, [(1, OK)], paths.__getitem__)
    history.record(1002.0, [(1, BAD)], paths.__getitem__)
    paths[1] = PATH.replace("10.0.0.1", "10.0.0.2")
    history.record(1004.0, [(1, OK)], paths.__getitem__)
    exported, cut = history.export()
    assert not cut
    assert [r.outcome for r in runs_of(exported[PATH])] == [Outcome.OK, Outcome.STATUS]
    assert [r.start for r in runs_of(exported[paths[1]])] == [1_004_000]
    # an hour later the old one ages out
    history.record(1004.0 + 3700, [(1, OK)], paths.__getitem__)
    assert PATH not in history.export()[0]
