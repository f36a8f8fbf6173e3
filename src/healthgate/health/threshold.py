"""The endpoint threshold machine (SPEC §2.1, and §9 for DEGRADED).

An endpoint starts UNKNOWN. ``healthyThreshold`` consecutive successes make it
HEALTHY; ``unhealthyThreshold`` consecutive failures make it UNHEALTHY. A
result resets the opposite run. A SUSPECT result (taken while the prober
lagged) is no evidence either way: it changes nothing.

A *degraded* success (an HTTP status in the check's ``degradedStatusCodes``)
is a success, and the machine also counts the *clean run*: the successes
since the last failure or degraded success. An endpoint whose last
``healthyThreshold`` results were successes is DEGRADED when any of them was
degraded (clean run < healthyThreshold), HEALTHY otherwise. Without degraded
successes the clean run is the success run and nothing is ever DEGRADED.

The whole machine is this table, written as one function so that the engine
and the property tests share it::

    result   | success run | failure run | clean run | state becomes
    ---------+-------------+-------------+-----------+---------------------------
    success  | +1 (capped) | 0           | +1        | when success run >= healthy:
    degraded | +1 (capped) | 0           | 0         |   DEGRADED if clean < healthy,
             |             |             |           |   else HEALTHY
    failure  | 0           | +1 (capped) | 0         | UNHEALTHY when run >= unhealthy
    suspect  | unchanged   | unchanged   | unchanged | unchanged
"""

from __future__ import annotations

from healthgate.health.states import HealthState, Outcome

RUN_CAP = 255  # runs are stored in one byte; thresholds are at most 10

UNKNOWN = HealthState.UNKNOWN
HEALTHY = HealthState.HEALTHY
UNHEALTHY = HealthState.UNHEALTHY
DEGRADED = HealthState.DEGRADED
# per-probe outcomes as globals (see the note on Outcome)
_OK = Outcome.OK
_NOT_CHECKED = Outcome.NOT_CHECKED
_DEGRADED_SUCCESS = Outcome.DEGRADED
_SUSPECT = Outcome.SUSPECT


def step(
    state: HealthState,
    ok_run: int,
    fail_run: int,
    outcome: Outcome,
    healthy_threshold: int,
    unhealthy_threshold: int,
    clean_run: int = 0,
) -> tuple[HealthState, int, int, int]:
    """One probe result in; the new (state, success run, failure run, clean run) out."""
    if outcome is _OK or outcome is _NOT_CHECKED or outcome is _DEGRADED_SUCCESS:
        ok_run = ok_run + 1 if ok_run < RUN_CAP else RUN_CAP
        if outcome is _DEGRADED_SUCCESS:
            clean_run = 0
        elif clean_run < RUN_CAP:
            clean_run += 1
        if ok_run >= healthy_threshold:
            state = DEGRADED if clean_run < healthy_threshold else HEALTHY
        return state, ok_run, 0, clean_run
    if outcome is _SUSPECT:
        return state, ok_run, fail_run, clean_run
    fail_run = fail_run + 1 if fail_run < RUN_CAP else RUN_CAP
    if state != UNHEALTHY and fail_run >= unhealthy_threshold:
        state = UNHEALTHY
    return state, 0, fail_run, 0
