"""A prober's table (health/probed.py): endpoints given, never the world.

A probe worker holds its shard in it; what it decides must be what the
serving engine would have decided from the same results."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from healthgate.health.engine import HealthEngine
from healthgate.health.probed import ProbedTable, flips
from healthgate.health.states import HealthState, Outcome, ProbeResult
from healthgate.model.names import ResourcePath, endpoint_path
from healthgate.model.resources import HealthCheck
from tests.helpers import example_world, resources

WORLD = resources(example_world(fast=True))
ENGINE = HealthEngine()
ENGINE.apply(WORLD, 0.0)
TARGETS = list(ENGINE.targets())
BS = TARGETS[0].backend_service
CHECK = TARGETS[0].check
PATHS = [endpoint_path(t.backend_service, t.ip, t.port) for t in TARGETS if t.backend_service == BS]
OK = ProbeResult(Outcome.OK, 0.001, 200)
FAIL = ProbeResult(Outcome.REFUSED, 0.001)


Checks = dict[ResourcePath, tuple[HealthCheck, dict[ResourcePath, str]]]


def given_checks(check: HealthCheck = CHECK) -> Checks:
    return {BS: (check, {})}


def test_endpoints_put_are_probed_and_keep_their_state_when_put_again() -> None:
    table = ProbedTable()
    result = table.change(0.0, given_checks(), PATHS, [])
    assert sorted(endpoint_path(t.backend_service, t.ip, t.port) for t in result.added) == sorted(
        PATHS
    )
    slot = result.added[0].slot
    table.resume(0.0, slot, HealthState.HEALTHY, -5.0)
    assert table.table.state(slot) is HealthState.HEALTHY and table.table.since(slot) == -5.0
    again = table.change(1.0, {}, PATHS, [])  # (no check given: it has it)
    assert not again.added and not again.removed and not again.changed
    assert table.table.state(slot) is HealthState.HEALTHY


@pytest.mark.parametrize(
    ("gone", "put", "left"),
    [
        ([0], [], [1]),  # one stopped
        ([0], [0], [0, 1]),  # stopped and put in one message: still probed (gone first)
        ([0, 1], [], []),  # all stopped: the backend service is forgotten
    ],
)
def test_endpoints_gone_are_stopped(gone: list[int], put: list[int], left: list[int]) -> None:
    table = ProbedTable()
    first = table.change(0.0, given_checks(), PATHS[:2], [])
    slots = {endpoint_path(t.backend_service, t.ip, t.port): t.slot for t in first.added}
    result = table.change(1.0, {}, [PATHS[i] for i in put], [PATHS[i] for i in gone])
    removed = {slots[PATHS[i]] for i in gone if i not in put}
    assert set(result.removed) == removed
    assert table.endpoint_count() == len(left)
    assert all(table.slot_of_path(PATHS[i]) is not None for i in left)
    if not left:
        assert BS not in table.checks()
        with pytest.raises(ValueError, match="no health check given"):
            table.change(2.0, {}, PATHS[:1], [])


def test_an_endpoint_path_finds_its_slot_while_its_backend_service_is_there() -> None:
    """slot_of_path remembers a backend service's path as text: forgotten
    when the backend service goes, so a path of it finds nothing then, and
    the new slot when it comes back."""
    table = ProbedTable()
    first = table.change(0.0, given_checks(), PATHS[:2], []).added
    slots = {endpoint_path(t.backend_service, t.ip, t.port): t.slot for t in first}
    assert [table.slot_of_path(p) for p in PATHS[:2]] == [slots[p] for p in PATHS[:2]]
    bs_text = PATHS[0].rpartition("/endpoints/")[0]
    for bad in (
        f"{bs_text}/endpoints/127.0.0.1:notaport",  # the name does not parse
        f"{bs_text}/endpoints/203.0.113.9:80",  # no such endpoint
        "projects/nope/regions/r/backendServices/x/endpoints/127.0.0.1:80",  # no such service
        "projects/NOT A PATH/endpoints/127.0.0.1:80",  # the service's path does not parse
        "no endpoints here",
    ):
        assert table.slot_of_path(bad) is None, bad
    table.change(1.0, {}, [], PATHS[:2])  # all gone: the backend service is forgotten
    assert table.slot_of_path(PATHS[0]) is None
    back = table.change(2.0, given_checks(), PATHS[:1], []).added
    assert table.slot_of_path(PATHS[0]) == back[0].slot
    assert table.slot_of_path(PATHS[1]) is None


def test_a_changed_check_probes_the_kept_endpoints_anew_under_its_thresholds() -> None:
    table = ProbedTable()
    slot = table.change(0.0, given_checks(), PATHS[:1], []).added[0].slot
    stricter = CHECK.model_copy(update={"healthy_threshold": 4})
    result = table.change(1.0, given_checks(stricter), [], [])
    assert [t.slot for t in result.changed] == [slot] and result.changed[0].check == stricter
    records = []
    for i in range(4):
        records += table.table.on_results(2.0 + i, [(slot, OK)])
        assert bool(records) == (i == 3), "healthy after four successes, not two"


@pytest.mark.parametrize(
    ("put", "checks", "why"),
    [
        (["not an endpoint path"], {}, "not an endpoint path"),
        ([f"{BS}/endpoints/10.0.0.1:x"], given_checks(), "not an endpoint path"),
        ([PATHS[0]], {}, "no health check given"),
    ],
)
def test_what_does_not_parse_is_refused_and_changes_nothing(
    put: list[str], checks: Checks, why: str
) -> None:
    table = ProbedTable()
    with pytest.raises(ValueError, match=why):
        table.change(0.0, checks, put, [])
    assert table.endpoint_count() == 0 and not table.checks()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(PATHS) - 1), st.booleans()), max_size=60))
def test_its_flips_are_the_serving_engines(results: list[tuple[int, bool]]) -> None:
    """The same results, one by one, flip the same endpoints at the same
    times with the same reasons in the prober table as in the engine."""
    engine = HealthEngine()
    engine.apply(WORLD, 0.0)
    table = ProbedTable()
    added = table.change(0.0, given_checks(), PATHS, []).added
    mine = {endpoint_path(t.backend_service, t.ip, t.port): t.slot for t in added}
    theirs = {endpoint_path(t.backend_service, t.ip, t.port): t.slot for t in engine.targets()}
    for n, (i, ok) in enumerate(results):
        result = OK if ok else FAIL
        now = 1.0 + n
        want = [
            (r.path, r.current, r.time, r.reason)
            for r in flips(engine.on_results(now, [(theirs[PATHS[i]], result)]))
        ]
        got = [
            (r.path, r.current, r.time, r.reason)
            for r in flips(table.table.on_results(now, [(mine[PATHS[i]], result)]))
        ]
        assert got == want
