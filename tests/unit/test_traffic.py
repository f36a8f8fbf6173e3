"""TRAFFIC health sources (health/traffic.py) in virtual time: the judge's
window and hold, and the cluster quorum - tables written from SPEC §8."""

from __future__ import annotations

from typing import Any

import pytest

from healthgate.health.evidence import Hops
from healthgate.health.states import HealthState
from healthgate.health.traffic import FIRST_REASON, TrafficJudge, Verdict, quorum
from healthgate.model.resources import TrafficPolicy

HEALTHY, UNHEALTHY = HealthState.HEALTHY, HealthState.UNHEALTHY


def policy(**kw: Any) -> TrafficPolicy:
    return TrafficPolicy.model_validate(kw)


def second(requests: int, errors: int, kind: str = "500") -> list[Hops]:
    return [Hops(requests - errors, errors, 0, {kind: errors} if errors else {})]


def states(judge: TrafficJudge, seconds: list[tuple[int, int]], start: int = 1) -> list[Any]:
    out = []
    for i, (requests, errors) in enumerate(seconds):
        v = judge.observe(float(start + i), second(requests, errors))
        out.append(v.state.name[0])  # H / U
    return out


JUDGE = [
    # (name, policy fields, (requests, errors) per second, states after each)
    ("starts HEALTHY, too little to judge", {}, [(10, 10)] * 5, ["H"] * 5),
    (
        "100 requests with more than 10 % failing: UNHEALTHY",
        {},
        [(50, 6), (50, 6)],
        ["H", "U"],
    ),
    ("10 % exactly is within the threshold", {}, [(100, 10)], ["H"]),
    ("a threshold of 50 %", {"errorPercentThreshold": 50}, [(100, 50), (100, 100)], ["H", "U"]),
    (
        "the window slides: old failures leave it",
        {"windowSec": 5, "minimumRequests": 10},
        [(10, 10), (10, 0), (10, 0), (10, 0), (10, 0), (10, 0), (10, 0)],
        ["U", "U", "U", "U", "U", "H", "H"],
    ),
]


@pytest.mark.parametrize(
    ("name", "fields", "seconds", "expected"), JUDGE, ids=[c[0] for c in JUDGE]
)
def test_judge(
    name: str, fields: dict[str, Any], seconds: list[tuple[int, int]], expected: list[str]
) -> None:
    judge = TrafficJudge(policy(**fields), 0.0)
    assert states(judge, seconds) == expected, name


def test_the_reason_names_the_figures() -> None:
    judge = TrafficJudge(policy(windowSec=30), 0.0)
    judge.observe(1.0, [Hops(268, 39, 0, {"500": 39}), Hops(0, 3, 0, {"reset": 3})])
    v = judge.verdict
    assert v.state is UNHEALTHY and v.judged
    assert v.reason == (
        "42 of 310 requests failed (13.5 %) in 30 s: 500 ×39, reset ×3 "
        "(more than errorPercentThreshold 10)"
    )


def test_too_little_traffic_keeps_the_state_then_hold_trusts_probes_again() -> None:
    judge = TrafficJudge(policy(windowSec=10, holdSec=60), 0.0)
    judge.observe(1.0, second(200, 200))
    assert judge.verdict.state is UNHEALTHY
    for t in range(2, 11):  # the traffic moved away
        judge.observe(float(t), [])
    # the failures leave the window at t = 11: too little to judge from then
    for t in range(11, 71):
        v = judge.observe(float(t), [])
        assert v.state is UNHEALTHY and not v.judged, t
    v = judge.observe(71.0, [])
    assert v.state is HEALTHY and not v.judged
    assert v.reason.startswith("no traffic to judge since ") and "trusting probes again" in v.reason


def test_the_hold_starts_again_when_traffic_comes_back() -> None:
    judge = TrafficJudge(policy(windowSec=5, holdSec=10, minimumRequests=10), 0.0)
    judge.observe(1.0, second(10, 10))
    for t in range(2, 12):
        judge.observe(float(t), [])
    judge.observe(12.0, second(10, 10))  # judged again: still failing
    for t in range(13, 22):
        assert judge.observe(float(t), []).state is UNHEALTHY
    # unjudged from 17 (the window emptied): HEALTHY 10 s later
    assert judge.observe(26.0, []).state is UNHEALTHY
    assert judge.observe(27.0, []).state is HEALTHY


def test_a_first_verdict_is_healthy_trusting_probes() -> None:
    judge = TrafficJudge(policy(), 5.0)
    assert judge.verdict == Verdict(HEALTHY, False, 0, 0, FIRST_REASON, 5.0)


def v(state: HealthState, judged: bool) -> Verdict:
    return Verdict(state, judged, 100 if judged else 0, 50 if state is UNHEALTHY else 0, "r", 0.0)


QUORUM = [
    # (name, current state, [(node, state, judged)], expected)
    ("one judge, failing", HEALTHY, [("a", UNHEALTHY, True)], UNHEALTHY),
    (
        "one node's own network broken: the others succeed",
        HEALTHY,
        [("a", UNHEALTHY, True), ("b", HEALTHY, True), ("c", HEALTHY, True)],
        HEALTHY,
    ),
    ("half is not a quorum", HEALTHY, [("a", UNHEALTHY, True), ("b", HEALTHY, True)], HEALTHY),
    (
        "two of three",
        HEALTHY,
        [("a", UNHEALTHY, True), ("b", UNHEALTHY, True), ("c", HEALTHY, True)],
        UNHEALTHY,
    ),
    (
        "only nodes that carried enough traffic judge",
        HEALTHY,
        [("a", UNHEALTHY, True), ("b", HEALTHY, False), ("c", HEALTHY, False)],
        UNHEALTHY,
    ),
    (
        "nobody judges: the state stands while a node holds it",
        UNHEALTHY,
        [("a", UNHEALTHY, False), ("b", HEALTHY, False)],
        UNHEALTHY,
    ),
    (
        "nobody judges and no node holds it: HEALTHY",
        UNHEALTHY,
        [("a", HEALTHY, False), ("b", HEALTHY, False)],
        HEALTHY,
    ),
    ("no opinions at all", HEALTHY, [], HEALTHY),
]


@pytest.mark.parametrize(
    ("name", "current", "opinions", "expected"), QUORUM, ids=[c[0] for c in QUORUM]
)
def test_quorum(
    name: str,
    current: HealthState,
    opinions: list[tuple[str, HealthState, bool]],
    expected: HealthState,
) -> None:
    state, reason = quorum(current, [(n, v(s, j)) for n, s, j in opinions])
    assert state is expected, (name, reason)
    assert reason
