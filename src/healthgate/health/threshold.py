"""The endpoint threshold machine (SPEC §2.1).

An endpoint starts UNKNOWN. ``healthyThreshold`` consecutive successes make it
HEALTHY; ``unhealthyThreshold`` consecutive failures make it UNHEALTHY. A
result resets the opposite run. A SUSPECT result (taken while the prober
lagged) is no evidence either way: it changes nothing.

The whole machine is this table, written as one function so that the engine
and the property tests share it::

    result   | success run   | failure run   | state becomes
    ---------+---------------+---------------+------------------------------
    success  | +1 (capped)   | 0             | HEALTHY when run >= healthy
    failure  | 0             | +1 (capped)   | UNHEALTHY when run >= unhealthy
    suspect  | unchanged     | unchanged     | unchanged
"""

from __future__ import annotations

from healthgate.health.states import HealthState, Outcome

RUN_CAP = 255  # runs are stored in one byte; thresholds are at most 10

UNKNOWN = HealthState.UNKNOWN
HEALTHY = HealthState.HEALTHY
UNHEALTHY = HealthState.UNHEALTHY


def step(
    state: HealthState,
    ok_run: int,
    fail_run: int,
    outcome: Outcome,
    healthy_threshold: int,
    unhealthy_threshold: int,
) -> tuple[HealthState, int, int]:
    """One probe result in; the new (state, success run, failure run) out."""
    if outcome in (Outcome.OK, Outcome.NOT_CHECKED):
        ok_run = min(ok_run + 1, RUN_CAP)
        if state != HEALTHY and ok_run >= healthy_threshold:
            state = HEALTHY
        return state, ok_run, 0
    if outcome == Outcome.SUSPECT:
        return state, ok_run, fail_run
    fail_run = min(fail_run + 1, RUN_CAP)
    if state != UNHEALTHY and fail_run >= unhealthy_threshold:
        state = UNHEALTHY
    return state, 0, fail_run
