"""A tick's probe results, on their way into the engine in one call."""

from __future__ import annotations

import logging
import random

import pytest

from healthgate.controlplane.health_service import HealthService
from healthgate.controlplane.probing import Feed, InProcessProbing
from healthgate.health.engine import HealthEngine
from healthgate.health.states import HealthState, Outcome, ProbeResult, Record
from healthgate.probes.stats import FailureLogLimiter
from tests.helpers import example_world, resources

OUTCOMES = [Outcome.OK] * 6 + [Outcome.REFUSED, Outcome.TIMEOUT, Outcome.SUSPECT, Outcome.STATUS]


def test_a_ticks_results_are_counted_logged_and_reach_the_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sources: list[InProcessProbing] = []

    def in_process(feed: Feed, failure_log: FailureLogLimiter) -> InProcessProbing:
        sources.append(InProcessProbing(feed, failure_log=failure_log))
        return sources[0]

    health = HealthService(clock=lambda: 5.0, failure_log_rate=1.0, source=in_process)
    local = sources[0].local
    ok, failed = list(health.apply(resources(example_world())).added)[:2]
    with caplog.at_level(logging.INFO, logger="healthgate.health"):
        local._on_results(
            5.0,
            [
                (ok.slot, ProbeResult(Outcome.OK, 0.004, 200)),
                (failed.slot, ProbeResult(Outcome.REFUSED, 0.001)),
                (failed.slot, ProbeResult(Outcome.REFUSED, 0.001)),
            ],
        )
    assert local.results == 3
    failures = [r.getMessage() for r in caplog.records if "probe failed" in r.getMessage()]
    assert len(failures) == 1  # one a second: the second is suppressed, and counted
    assert health.engine.endpoint_path(failed.slot) in failures[0]
    assert "connection refused" in failures[0]
    assert health.failure_log.suppressed == 1
    last = {
        key: good
        for target in (ok, failed)
        for key, good in health.engine.last_probe_ok(target.backend_service)
    }
    assert last[(ok.ip, ok.port)] is True and last[(failed.ip, failed.port)] is False


@pytest.mark.parametrize("seed", range(5))
def test_results_in_batches_do_what_they_do_one_at_a_time(seed: int) -> None:
    """on_results takes the steady state (a success for a HEALTHY endpoint)
    without the threshold machine: whatever the mix of outcomes and however
    they are batched, the records and every endpoint's state, runs, last
    result and reason are those of on_result, one result at a time."""
    rng = random.Random(seed)
    one, batched = HealthEngine(), HealthEngine()
    targets = list(one.apply(resources(example_world()), 0.0).added)
    batched.apply(resources(example_world()), 0.0)
    got_one: list[Record] = []
    got_batched: list[Record] = []
    now = 1.0
    for _ in range(60):  # ticks
        tick = [
            (t.slot, ProbeResult(rng.choice(OUTCOMES), rng.random() / 10, 200))
            for t in rng.sample(targets, rng.randint(1, len(targets)))
        ]
        for slot, result in tick:
            got_one += one.on_result(now, slot, result)
        got_batched += batched.on_results(now, tick)
        now += 1.0
    assert got_batched == got_one
    # (endpoints were HEALTHY along the way, so successes took the steady-state path)
    assert any(getattr(r, "current", None) is HealthState.HEALTHY for r in got_one)
    for bs in {t.backend_service for t in targets}:
        assert batched.endpoints(bs) == one.endpoints(bs)


def test_probe_workers_failures_are_held_to_the_owners_rate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each worker sends at most the owner's rate of failures and how many it
    left out; the owner's limiter holds all workers together to that rate and
    counts every line left out, theirs included."""
    from healthgate.controlplane.probe_workers import Failures, ProbePool
    from healthgate.probes.prober import ProbeSettings
    from healthgate.probes.scheduler import SchedulerSettings

    now = [100.0]
    failure_log = FailureLogLimiter(2.0, clock=lambda: now[0])
    pool = ProbePool(
        2,
        ProbeSettings(),
        SchedulerSettings(),
        lambda flips: None,
        lambda: (),
        lambda slot: (HealthState.UNKNOWN, 0.0),
        failure_log=failure_log,
    )
    lines = [
        (f"shop/regions/r/backendServices/web/endpoints/ep-{i}", "connection refused")
        for i in range(2)
    ]
    with caplog.at_level(logging.INFO, logger="healthgate.health"):
        pool._take(0, Failures(lines, 5))  # worker 0: two lines, five left out
        pool._take(1, Failures(lines, 0))  # worker 1, the same second: over the rate
        pool._take(1, Failures([], 3))  # its second's count of lines left out
    failures = [r.getMessage() for r in caplog.records if "probe failed" in r.getMessage()]
    assert failures == [
        "probe failed: shop/regions/r/backendServices/web/endpoints/ep-0: connection refused "
        "(0 similar lines suppressed so far)",
        "probe failed: shop/regions/r/backendServices/web/endpoints/ep-1: connection refused "
        "(0 similar lines suppressed so far)",
    ]
    assert failure_log.suppressed == 5 + 2 + 3
    now[0] += 0.5  # half a second later: one more line allowed
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="healthgate.health"):
        pool._take(1, Failures(lines, 0))
    assert [r.getMessage() for r in caplog.records] == [
        "probe failed: shop/regions/r/backendServices/web/endpoints/ep-0: connection refused "
        "(10 similar lines suppressed so far)"
    ]
    assert failure_log.suppressed == 11
