"""Detection windows: the formula, and the engine reproducing it exactly in virtual time."""

from typing import Any

import pytest

from healthgate.health.states import Transition
from healthgate.health.windows import failure_window, success_window, worst_case_failure_detection
from healthgate.simulation.runner import simulate
from healthgate.simulation.scenario import Scenario
from tests.helpers import resources

IP = "127.0.9.1"


def one_endpoint(timeout: int, interval: int, threshold: int, kind: str = "HTTP") -> list[Any]:
    hc: dict[str, Any] = {
        "kind": "HealthCheck",
        "project": "p",
        "region": "r",
        "name": "hc",
        "type": kind,
        "port": 80,
        "timeoutSec": timeout,
        "checkIntervalSec": interval,
        "healthyThreshold": threshold,
        "unhealthyThreshold": threshold,
    }
    return resources(
        [
            hc,
            {
                "kind": "NetworkEndpointGroup",
                "project": "p",
                "region": "r",
                "name": "neg",
                "networkEndpointType": "GCE_VM_IP_PORT",
                "endpoints": [{"ipAddress": IP, "port": 80}],
            },
            {
                "kind": "BackendService",
                "project": "p",
                "region": "r",
                "name": "bs",
                "loadBalancingScheme": "INTERNAL",
                "protocol": "HTTP",
                "healthChecks": ["hc"],
                "backends": [{"group": "networkEndpointGroups/neg"}],
            },
        ]
    )


def transitions(res: list[Any], scenario: dict[str, Any]) -> list[tuple[float, str]]:
    out = simulate(res, Scenario.model_validate(scenario))
    return [
        (round(r.time, 6), r.current.name)
        for r in out.records
        if isinstance(r, Transition) and r.kind == "Endpoint"
    ]


def test_formula_matches_the_seeds() -> None:
    assert failure_window(3, 2, 3) == 13
    assert success_window(1, 2, 3) == 7
    assert worst_case_failure_detection(3, 2, 3) == 15


def test_seed_failure_window_13s_exactly() -> None:
    # healthy from the start; the endpoint hangs from t=100, when a probe starts
    res = one_endpoint(timeout=3, interval=2, threshold=3)
    # probes (10 ms each) start at 0, 2.01, 4.02 ... k * 2.01; pick a start time
    start = 2.01 * 50
    got = transitions(
        res,
        {
            "duration": 200,
            "start": "healthy",
            "responseTime": 0.01,
            "events": [{"at": start, "fault": "hang"}],
        },
    )
    assert got == [(round(start + 13, 6), "UNHEALTHY")]


def test_seed_success_window_7s_exactly() -> None:
    res = one_endpoint(timeout=3, interval=2, threshold=3)
    # from UNKNOWN, with 1 s responses: probes at 0-1, 3-4, 6-7
    got = transitions(res, {"duration": 20, "responseTime": 1.0})
    assert got == [(round(7.0, 6), "HEALTHY")]


@pytest.mark.parametrize(
    ("timeout", "interval", "threshold"),
    [(1, 1, 2), (3, 2, 3), (5, 10, 2), (2, 50, 10), (300, 1, 4)],
)
def test_failure_window_matches_formula(timeout: int, interval: int, threshold: int) -> None:
    res = one_endpoint(timeout, interval, threshold)
    got = transitions(
        res, {"duration": 10_000, "responseTime": 0.0, "events": [{"at": 0, "fault": "hang"}]}
    )
    assert got[0] == (round(failure_window(timeout, interval, threshold), 6), "UNHEALTHY")


def test_refused_fails_fast() -> None:
    res = one_endpoint(3, 2, 3)
    got = transitions(res, {"duration": 60, "events": [{"at": 0, "fault": "refuse"}]})
    assert got[0] == (round(failure_window(0, 2, 3), 6), "UNHEALTHY")


def test_slow_answers_under_the_timeout_pass() -> None:
    res = one_endpoint(3, 2, 3)
    got = transitions(res, {"duration": 60, "events": [{"at": 0, "latency": 2.5}]})
    assert got == [(round(success_window(2.5, 2, 3), 6), "HEALTHY")]
    got = transitions(res, {"duration": 60, "events": [{"at": 0, "latency": 3.0}]})
    assert got[0] == (round(13.0, 6), "UNHEALTHY")


def test_tcp_checks_do_not_see_http_status() -> None:
    res = one_endpoint(3, 2, 3, kind="TCP")
    got = transitions(res, {"duration": 60, "events": [{"at": 0, "status": 503}]})
    assert [s for _, s in got] == ["HEALTHY"]
    res = one_endpoint(3, 2, 3, kind="HTTP")
    got = transitions(res, {"duration": 60, "events": [{"at": 0, "status": 503}]})
    assert [s for _, s in got] == ["UNHEALTHY"]
