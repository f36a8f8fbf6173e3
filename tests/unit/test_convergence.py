"""Convergence receipts decided in virtual time (health/convergence.py):
who applied a decision when, who is expected to, who lags."""

from __future__ import annotations

import pytest

from healthgate.health.convergence import ConvergenceTracker, Decision
from healthgate.health.states import ConvergencePhase

FE = "projects/web/global/forwardingRules/shop"
US = "projects/web/regions/us-east1/networkEndpointGroups/shop-us"
EU = "projects/web/regions/europe-west1/networkEndpointGroups/shop-eu"


def decision(generation: int, at: float) -> Decision:
    return Decision(FE, "web", generation, at, frozenset({US, EU}), "shop-us -> shop-eu")


def receipts(t: ConvergenceTracker, now: float) -> dict[str, float | None]:
    status = t.status(FE, now)
    assert status is not None
    return {f"{r['dataPlane']}/{r['instance']}": r["appliedAfterMs"] for r in status["receipts"]}


def test_each_kind_of_data_plane_applies_in_its_own_way() -> None:
    t = ConvergenceTracker(alert_after=30)
    # seen before the decision (each is then expected)
    t.holds("healthgate", "serve", {FE: 0}, 99.0)
    t.holds("envoy", "edge-envoy", {FE: 0}, 99.0)
    t.served("dns", "serve", FE, 99.0)
    t.answered("edge-1", US, 98.0)
    t.answered("edge-1", EU, 99.0)
    t.decided(decision(7, 100.0))
    assert receipts(t, 100.0) == {
        "dns/serve": None, "envoy/edge-envoy": None, "haproxy/edge-1": None,
        "healthgate/serve": None,
    }  # fmt: skip
    t.holds("healthgate", "serve", {FE: 7}, 100.002)  # this process's listeners: at once
    t.holds("envoy", "edge-envoy", {FE: 6}, 100.01)  # an older version's ACK: not yet
    t.holds("envoy", "edge-envoy", {FE: 7}, 100.02)
    t.answered("edge-1", US, 100.5)  # one NEG asked: HAProxy still routes on the other's old state
    assert receipts(t, 100.6)["haproxy/edge-1"] is None
    t.answered("edge-1", EU, 100.9)
    t.served("dns", "serve", FE, 101.3)
    assert receipts(t, 102.0) == {
        "healthgate/serve": 2.0, "envoy/edge-envoy": 20.0, "haproxy/edge-1": 900.0,
        "dns/serve": 1300.0,
    }  # fmt: skip
    assert t.check(200.0) == []  # (everyone applied: nobody lags)
    assert t.histograms["haproxy"].counts[6] == 1  # (0.9 s: the 1 s bucket)


def test_an_instance_that_does_not_apply_in_time_lags_once_then_catches_up() -> None:
    t = ConvergenceTracker(alert_after=30)
    t.holds("envoy", "edge-envoy", {FE: 0}, 95.0)
    t.decided(decision(3, 100.0))
    assert t.check(129.9) == []
    (late,) = t.check(130.0)
    assert (late.phase, late.data_plane, late.instance) == (
        ConvergencePhase.LAGGING, "envoy", "edge-envoy"
    )  # fmt: skip
    assert "has not applied the decision" in late.reason and "after 30 s" in late.reason
    assert t.check(140.0) == []  # (once per decision and instance)
    assert t.lagging_now()["envoy"] == 1
    t.holds("envoy", "edge-envoy", {FE: 3}, 150.0)
    (back,) = t.check(151.0)
    assert back.phase is ConvergencePhase.CAUGHT_UP and "after 50.0 s" in back.reason
    assert t.lagging_now()["envoy"] == 0
    # the next decision starts afresh
    t.decided(decision(4, 200.0))
    assert receipts(t, 200.0) == {"envoy/edge-envoy": None}


# (last seen before the decision at 100, expected?)
EXPECTED = [(99.0, True), (100.0 - 120.0, True), (100.0 - 120.1, False)]


@pytest.mark.parametrize(("seen", "expected"), EXPECTED)
def test_who_is_expected_is_who_served_the_front_end_lately(seen: float, expected: bool) -> None:
    t = ConvergenceTracker(alert_after=30, expect_within=120)
    t.served("dns", "serve", FE, seen)
    t.decided(decision(1, 100.0))
    assert (t.expected(FE) == [("dns", "serve")]) is expected
    assert len(t.check(131.0)) == (1 if expected else 0)


def test_memory_is_bounded_whatever_instances_claim_to_be() -> None:
    t = ConvergenceTracker(alert_after=30)
    t.decided(decision(1, 100.0))
    for i in range(5000):
        t.answered(f"haproxy-{i}", US, 100.0 + i / 1000)
    assert len(t.asked) == 1000 and len(t.seen[FE]) == 1000
    t.check(100.0 + 1000.0)  # (long gone: forgotten)
    assert t.asked == {} and t.seen[FE] == {}


def test_a_front_end_without_a_decision_has_no_status() -> None:
    t = ConvergenceTracker()
    t.holds("healthgate", "serve", {FE: 0}, 1.0)
    assert t.status(FE, 2.0) is None
