"""Outlier detection (health/outliers.py) in virtual time: tables of cases
written from SPEC §8 and from Envoy's documented outlier detection."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from healthgate.health.evidence import Hops
from healthgate.health.outliers import BackendOutliers, Decision, EjectionPhase
from healthgate.model.resources import OutlierDetection

A, B, C, D = ("10.0.0.1", 80), ("10.0.0.2", 80), ("10.0.0.3", 80), ("10.0.0.4", 80)
EJECTED, RETURNED, DETECTED = EjectionPhase.EJECTED, EjectionPhase.RETURNED, EjectionPhase.DETECTED


def policy(**kw: Any) -> OutlierDetection:
    fields = {"maxEjectionPercent": 100, **kw}
    return OutlierDetection.model_validate(fields)


def errors(n: int, kind: str = "503", served: int = 0, gateway: bool = True) -> Hops:
    """A second of ``n`` errors in a row (after ``served`` successes)."""
    return Hops(served, n, n if gateway else 0, {kind: n} if n else {}, n, n if gateway else 0,
                tuple([kind] * min(n, 10)))  # fmt: skip


def ok(n: int = 1) -> Hops:
    return Hops(n, 0, 0, {}, 0, 0, ())


def run(
    det: BackendOutliers, seconds: Sequence[tuple[float, dict[tuple[str, int | None], Hops]]]
) -> list[tuple[float, Decision]]:
    out = []
    for t, hops in seconds:
        out += [(t, d) for d in det.observe(t, hops)]
    return out


def phases(decisions: list[tuple[float, Decision]]) -> list[tuple[float, Any, EjectionPhase]]:
    return [(t, d.endpoint, d.phase) for t, d in decisions]


CONSECUTIVE = [
    # (name, policy fields, seconds of A's hops, expected (time, phase))
    ("five 503s eject (Envoy: consecutive_5xx 5)", {}, [(1, errors(5))], [(1, EJECTED)]),
    ("four do not", {}, [(1, errors(4))], []),
    ("a success in between restarts the run", {}, [(1, errors(4)), (2, ok()), (3, errors(4))], []),
    ("a 500 counts as an error", {}, [(1, errors(5, "500", gateway=False))], [(1, EJECTED)]),
    ("0 turns consecutive errors off", {"consecutiveErrors": 0}, [(1, errors(50))], []),
    (
        "gateway errors alone, 500s end their run (Envoy: consecutive_gateway_failure)",
        {"consecutiveErrors": 0, "consecutiveGatewayErrors": 3},
        [(1, Hops(0, 4, 2, {"503": 2, "500": 2}, 4, 2, ())), (2, errors(3))],
        [(2, EJECTED)],
    ),
    (
        "enforcingPercent 0 records a detection only",
        {"enforcingPercent": 0},
        [(1, errors(5))],
        [(1, DETECTED)],
    ),
    (
        "a run is acted upon once: the next detection waits for a success",
        {"enforcingPercent": 0},
        [(1, errors(5)), (2, errors(6)), (3, Hops(1, 5, 5, {"503": 5}, 5, 5, ()))],
        [(1, DETECTED), (3, DETECTED)],
    ),
]


@pytest.mark.parametrize(
    ("name", "fields", "seconds", "expected"), CONSECUTIVE, ids=[c[0] for c in CONSECUTIVE]
)
def test_consecutive_errors(
    name: str, fields: dict[str, Any], seconds: list[tuple[float, Hops]], expected: list[Any]
) -> None:
    det = BackendOutliers(policy(**fields), {"neg": [A, B]}, 0.0)
    got = run(det, [(t, {A: h}) for t, h in seconds])
    assert [(t, p) for t, _, p in phases(got)] == expected, name


def test_the_reason_names_the_run_and_the_ejection_time() -> None:
    det = BackendOutliers(policy(), {"neg": [A]}, 0.0)
    run_ = Hops(0, 5, 4, {"503": 4, "reset": 1}, 5, 2, ("503", "503", "reset", "503", "503"))
    [(_, d)] = run(det, [(1, {A: run_})])
    assert d.reason == (
        "5 consecutive errors: 503, 503, reset, 503, 503; ejected for 30 s (ejection 1 in a row)"
    )
    assert d.until == 31.0 and d.detection == "consecutiveErrors"


def test_ejection_time_grows_with_ejections_in_a_row_up_to_the_max() -> None:
    """base x (times ejected in a row), capped at the max (Envoy: the ejection
    time is base_ejection_time times the times ejected, capped)."""
    det = BackendOutliers(
        policy(baseEjectionTimeSec=30, maxEjectionTimeSec=70, intervalSec=300), {"neg": [A]}, 0.0
    )
    seconds: list[tuple[float, dict[Any, Hops]]] = [(1, {A: errors(5)})]  # out until 31
    seconds += [(31, {}), (32, {A: errors(5, served=1)})]  # back, out for 60 s: until 92
    seconds += [(92, {}), (93, {A: errors(5, served=1)})]  # back, out for 70 s (the cap)
    got = run(det, seconds)
    ejections = [(t, d.until) for t, d in got if d.phase is EJECTED]
    assert ejections == [(1, 31.0), (32, 92.0), (93, 163.0)]
    assert [t for t, d in got if d.phase is RETURNED] == [31, 92]


def test_the_count_falls_by_one_for_each_interval_without_an_ejection() -> None:
    det = BackendOutliers(
        policy(baseEjectionTimeSec=10, maxEjectionTimeSec=300, intervalSec=10), {"neg": [A]}, 0.0
    )
    run(det, [(1, {A: errors(5)}), (11, {}), (12, {A: errors(5, served=1)})])  # count 2
    assert det.endpoints[A].count == 2
    # out until 32: the intervals ending at 20 and 30 find it ejected (no
    # fall, as in Envoy), those ending at 40 and 50 do not
    for t in range(13, 41):
        det.observe(float(t), {})
    assert det.endpoints[A].count == 1
    for t in range(41, 51):
        det.observe(float(t), {})
    assert det.endpoints[A].count == 0
    [(_, d)] = [x for x in run(det, [(51, {A: errors(5, served=1)})]) if x[1].phase is EJECTED]
    assert d.until == 61.0  # base x 1 again


FAILURE_PERCENTAGE = [
    # (name, fields, (requests, errors) per second over one interval, ejected?)
    ("50 % of 60 at a 50 % threshold", {"failurePercentageThreshold": 50}, [(60, 30)], True),
    ("49 % is below it", {"failurePercentageThreshold": 50}, [(100, 49)], False),
    ("too few requests to judge", {"failurePercentageThreshold": 50}, [(49, 49)], False),
    (
        "the minimum is configurable",
        {"failurePercentageThreshold": 50, "failurePercentageMinimumRequests": 10},
        [(10, 6)],
        True,
    ),
    ("0 turns it off", {"failurePercentageThreshold": 0}, [(100, 100)], False),
    (
        "summed over the interval's seconds",
        {"failurePercentageThreshold": 20},
        [(10, 1)] * 4 + [(10, 9)],
        True,
    ),
]


@pytest.mark.parametrize(
    ("name", "fields", "seconds", "ejected"),
    FAILURE_PERCENTAGE,
    ids=[c[0] for c in FAILURE_PERCENTAGE],
)
def test_failure_percentage_per_interval(
    name: str, fields: dict[str, Any], seconds: list[tuple[int, int]], ejected: bool
) -> None:
    det = BackendOutliers(policy(consecutiveErrors=0, intervalSec=10, **fields), {"neg": [A]}, 0.0)
    hops: list[tuple[float, dict[tuple[str, int | None], Hops]]] = [
        (float(t + 1), {A: Hops(total - bad, bad, 0, {"500": bad} if bad else {}, 1, 0, ())})
        for t, (total, bad) in enumerate(seconds)
    ]
    got = run(det, [*hops, *((float(t), {}) for t in range(len(seconds) + 1, 11))])
    assert [p for _, _, p in phases(got)] == ([EJECTED] if ejected else []), name
    if ejected:
        assert got[0][0] == 10.0  # at the interval's end
        assert "failed" in got[0][1].reason and "in 10 s" in got[0][1].reason


CAPS = [
    # (name, maxEjectionPercent, group size, bad endpoints, ejected at once)
    ("25 % of 4: one", 25, 4, 3, 1),
    ("10 % of 4 rounds down to 0, but one may always be ejected", 10, 4, 4, 1),
    ("50 % of 4: two", 50, 4, 4, 2),
    ("0 ejects none", 0, 4, 4, 0),
    ("100 % ejects all", 100, 3, 3, 3),
    ("10 % of 20: two", 10, 20, 5, 2),
]


@pytest.mark.parametrize(("name", "pct", "size", "bad", "ejected"), CAPS, ids=[c[0] for c in CAPS])
def test_max_ejection_percent_of_a_group(
    name: str, pct: int, size: int, bad: int, ejected: int
) -> None:
    keys = [(f"10.0.1.{i}", 80) for i in range(size)]
    det = BackendOutliers(policy(maxEjectionPercent=pct), {"neg": keys}, 0.0)
    got = run(det, [(1, {k: errors(5) for k in keys[:bad]})])
    assert sum(1 for _, d in got if d.phase is EJECTED) == ejected, name
    held = [d for _, d in got if d.phase is DETECTED]
    assert len(held) == bad - ejected
    for d in held:
        assert "maxEjectionPercent" in d.reason


def test_the_cap_is_per_group() -> None:
    det = BackendOutliers(policy(maxEjectionPercent=25), {"a": [A, B], "b": [C, D]}, 0.0)
    got = run(det, [(1, {A: errors(5), B: errors(5), C: errors(5)})])
    assert sorted(d.endpoint for _, d in got if d.phase is EJECTED) == [A, C]


def test_enforcing_percent_draws() -> None:
    draws = iter([0.1, 0.9])  # 10 < 50: enforced; 90: not
    det = BackendOutliers(policy(enforcingPercent=50), {"neg": [A, B]}, 0.0, lambda: next(draws))
    got = run(det, [(1, {A: errors(5)}), (2, {B: errors(5)})])
    assert [(d.endpoint, d.phase) for _, d in got] == [(A, EJECTED), (B, DETECTED)]


def test_an_ejected_endpoint_is_not_judged_by_hops_still_in_flight() -> None:
    det = BackendOutliers(policy(), {"neg": [A]}, 0.0)
    got = run(det, [(1, {A: errors(5)}), (2, {A: errors(9)}), (3, {A: errors(9)})])
    assert [p for _, _, p in phases(got)] == [EJECTED]


def test_regroup_keeps_state_and_drops_the_gone() -> None:
    det = BackendOutliers(policy(), {"neg": [A, B]}, 0.0)
    run(det, [(1, {A: errors(5)})])
    det.regroup({"neg": [A, C]})
    assert set(det.endpoints) == {A, C} and det.ejected() == {A: 31.0}


def test_ranges_are_validated_naming_the_field() -> None:
    from pydantic import ValidationError

    for fields, name in (
        ({"intervalSec": 0}, "interval_sec"),
        ({"intervalSec": 301}, "interval_sec"),
        ({"failurePercentageThreshold": 101}, "failure_percentage_threshold"),
        ({"maxEjectionPercent": -1}, "max_ejection_percent"),
        ({"enforcingPercent": 101}, "enforcing_percent"),
    ):
        with pytest.raises(ValidationError) as info:
            OutlierDetection.model_validate(fields)
        assert name in str(info.value) or name.replace("_", "") in str(info.value).lower()
    with pytest.raises(ValidationError, match="maxEjectionTimeSec"):
        OutlierDetection.model_validate({"baseEjectionTimeSec": 60, "maxEjectionTimeSec": 30})
