"""Gradual failover and ramped failback (SPEC §6), in the engine's virtual time.

* spill PROPORTIONAL: a degraded NEG keeps min(1, 1.4 x its healthy
  fraction) of what is left; the composite carries its healthyFraction;
* failbackRampSec: a NEG eligible again grows from 0 to its full share
  along a straight line; the log has the ramp's start and end (or its
  abandonment) and one route record - none per step; a restart resumes
  the ramp from the stored states; ``simulate`` shows it.
"""

from __future__ import annotations

from typing import Any

import pytest

from healthgate.controlplane.ramp_gate import RampGate
from healthgate.controlplane.saved_states import decode_states, encode_record_states
from healthgate.health.engine import HealthEngine
from healthgate.health.evidence import Hops
from healthgate.health.routing import Candidate, distribute
from healthgate.health.states import HealthState, RampChange, RampPhase, Record, RouteChange
from healthgate.simulation.runner import simulate
from healthgate.simulation.scenario import Scenario
from tests.helpers import OK, REFUSED, example_world, feed, resources

H, U = HealthState.HEALTHY, HealthState.UNHEALTHY
US_PREFIX = "127.0.1."  # the example's us-east1 endpoints (4); europe-west1's are 127.0.2.x


def cand(name: str, fraction: float | None = None, ramp: float = 1.0, dial: int = 100) -> Candidate:
    factor = 1.0 if fraction is None else min(1.0, 1.4 * fraction)
    return Candidate(f"negs/{name}", name, f"r-{name}", None, H, True, "", dial, factor, fraction,
                     ramp)  # fmt: skip


CASES = [
    # (candidates in failover order, expected {name: percent})
    ([cand("a", 1.0), cand("b", 1.0)], {"a": 100}),
    ([cand("a", 0.75), cand("b", 1.0)], {"a": 100}),  # 0.75 x 1.4 > 1: overprovisioned
    ([cand("a", 0.5), cand("b", 1.0)], {"a": 70, "b": 30}),
    # a takes 35 %, b 70 % of the 65 left; the 19.5 left go back 35 : 45.5
    ([cand("a", 0.25), cand("b", 0.5)], {"a": 43.48, "b": 56.52}),
    ([cand("a", 0.5)], {"a": 100}),  # nobody else may take it: all of it stays
    ([cand("a", 0.5, dial=50), cand("b", 1.0)], {"a": 35, "b": 65}),  # dial x factor
    ([cand("a", ramp=0.25), cand("b")], {"a": 25, "b": 75}),  # a ramp a quarter of the way
    ([cand("a", ramp=0.0), cand("b")], {"b": 100}),  # a ramp at its start takes nothing
    ([cand("a", 0.5, ramp=0.5), cand("b")], {"a": 35, "b": 65}),
]


@pytest.mark.parametrize(("cands", "want"), CASES)
def test_the_factor_and_the_ramp_in_the_arithmetic(
    cands: list[Candidate], want: dict[str, float]
) -> None:
    shares = distribute(cands, None, "negs/a")
    assert {s.neg.removeprefix("negs/"): s.percent for s in shares} == want


def _world(**policy: Any) -> list[Any]:
    docs = example_world()
    for d in docs:
        if d["kind"] == "BackendService" and d["project"] == "web":
            d["failoverPolicy"] = {**d["failoverPolicy"], **policy}
        if d["kind"] == "HealthAggregationPolicy" and d["region"] == "us-east1":
            # us-east1 stays HEALTHY down to one endpoint of four
            d["healthyPercentThreshold"], d["minHealthyThreshold"] = 25, 1
    return resources(docs)


def _fail(engine: HealthEngine, now: float, ips: list[str]) -> list[Record]:
    out: list[Record] = []
    for ip in ips:
        out += feed(engine, now, REFUSED, ip, times=3)
    return out


def _percents(engine: HealthEngine) -> dict[str, float]:
    route = next(iter(engine.route_table().routes.values()))
    return {s.region: s.percent for s in route.shares}


def test_proportional_spill_follows_the_healthy_fraction() -> None:
    engine = HealthEngine()
    engine.apply(_world(spill="PROPORTIONAL"), 0.0)
    feed(engine, 1.0, OK, times=3)
    assert _percents(engine) == {"us-east1": 100.0}
    records = _fail(engine, 10.0, ["127.0.1.1"])  # 3 of 4: 0.75 x 1.4 > 1
    assert _percents(engine) == {"us-east1": 100.0}
    assert not [r for r in records if isinstance(r, RouteChange)]
    records = _fail(engine, 20.0, ["127.0.1.2"])  # 2 of 4: 70 %
    assert _percents(engine) == {"us-east1": 70.0, "europe-west1": 30.0}
    assert len([r for r in records if isinstance(r, RouteChange)]) == 1
    share = next(iter(engine.route_table().routes.values())).shares[0]
    assert "healthyFraction 0.50 x overprovisioningFactor 1.4 = factor 0.70" in share.reason
    _fail(engine, 30.0, ["127.0.1.3"])  # 1 of 4: 35 %
    assert _percents(engine) == {"us-east1": 35.0, "europe-west1": 65.0}
    # the composite (and the producer's rule it is attached to) carry the fraction
    composite = engine.node_status(
        "projects/shop/regions/us-east1/compositeHealthChecks/web-composite"
    )
    assert composite is not None and composite.state is H and composite.fraction == 0.25
    # ALL_OR_NOTHING (the default) ignores it: the seeds' behaviour
    engine.apply(_world(), 40.0)
    assert _percents(engine) == {"us-east1": 100.0}


def _ramping(seconds: int = 100) -> tuple[HealthEngine, list[Record]]:
    """us-east1 fails at 10 and is back at 50 (its NEG HEALTHY at 50)."""
    engine = HealthEngine()
    engine.apply(_world(failbackRampSec=seconds), 0.0)
    feed(engine, 1.0, OK, times=3)
    log: list[Record] = _fail(engine, 10.0, [US_PREFIX])
    assert _percents(engine) == {"europe-west1": 100.0}
    log += feed(engine, 50.0, OK, US_PREFIX, times=3)
    return engine, log


def test_a_ramp_follows_its_line_and_is_logged_at_its_start_and_end() -> None:
    engine, log = _ramping()
    ramps = [r for r in log if isinstance(r, RampChange)]
    assert [(r.phase, r.time, r.start) for r in ramps] == [(RampPhase.STARTED, 50.0, 50.0)]
    back = [r for r in log if isinstance(r, RouteChange)][-1]
    assert back.time == 50.0 and "failing back" in back.reason  # where traffic is going
    assert _percents(engine) == {"europe-west1": 100.0}  # ... from 0
    assert engine.next_ramp_step(50.0) == pytest.approx(50.5)
    steps: list[Record] = []
    for at, want in ((75.0, 25.0), (100.0, 50.0), (125.0, 75.0)):
        steps += engine.step_ramps(at)
        assert _percents(engine) == {"us-east1": want, "europe-west1": 100 - want}
    assert steps == []  # no record per step
    ended = engine.step_ramps(160.0)
    assert [(r.phase, r.time) for r in ended if isinstance(r, RampChange)] == [
        (RampPhase.ENDED, 150.0)
    ]
    assert not [r for r in ended if isinstance(r, RouteChange)]
    assert _percents(engine) == {"us-east1": 100.0}
    assert engine.next_ramp_step(160.0) is None


def test_a_ramp_is_abandoned_when_its_neg_fails_and_restarts_at_its_next_recovery() -> None:
    engine, _ = _ramping()
    engine.step_ramps(80.0)
    records = _fail(engine, 90.0, [US_PREFIX])
    ramps = [r for r in records if isinstance(r, RampChange)]
    assert [(r.phase, r.time) for r in ramps] == [(RampPhase.ABANDONED, 90.0)]
    assert "40% of the way" in ramps[0].reason
    assert _percents(engine) == {"europe-west1": 100.0}
    records = feed(engine, 120.0, OK, US_PREFIX, times=3)
    assert [(r.phase, r.start) for r in records if isinstance(r, RampChange)] == [
        (RampPhase.STARTED, 120.0)
    ]
    engine.step_ramps(170.0)
    assert _percents(engine) == {"us-east1": 50.0, "europe-west1": 50.0}


def test_a_restart_resumes_the_ramp_from_the_stored_states() -> None:
    _, log = _ramping()
    # what the store holds: the states the records folded into
    endpoints, nodes, routes, ramps = decode_states(encode_record_states(log))
    assert [list(r.values()) for r in ramps.values()] == [[50.0]]
    restarted = HealthEngine()
    restarted.apply(_world(failbackRampSec=100), 75.0)
    again = restarted.restore(75.0, endpoints, nodes, routes, ramps)
    assert _percents(restarted) == {"us-east1": 25.0, "europe-west1": 75.0}
    assert not [r for r in again if r.kind in ("Route", "Ramp")]  # nothing new to record
    assert [r.phase for r in restarted.step_ramps(150.0) if isinstance(r, RampChange)] == [
        RampPhase.ENDED
    ]


def test_simulate_shows_the_ramp_in_virtual_time() -> None:
    scenario = Scenario.model_validate(
        {
            "duration": 200,
            "start": "healthy",
            "events": [
                {"at": 10, "fault": "refuse", "select": {"region": "us-east1"}},
                {"at": 60, "fault": "heal", "select": {"region": "us-east1"}},
            ],
        }
    )
    result = simulate(_world(failbackRampSec=60), scenario)
    ramps = [r for r in result.records if isinstance(r, RampChange)]
    assert [r.phase for r in ramps] == [RampPhase.STARTED, RampPhase.ENDED]
    assert ramps[1].time == ramps[0].time + 60
    assert _percents(result.engine) == {"us-east1": 100.0}


def test_the_error_gate_abandons_a_ramp_and_it_starts_again_a_window_later() -> None:
    engine, _ = _ramping()
    engine.step_ramps(70.0)
    assert _percents(engine) == {"us-east1": 20.0, "europe-west1": 80.0}
    frontend = next(iter(engine.route_table().routes))
    neg = next(n for n in engine.ramps()[frontend])
    assert engine.gated_ramps(70.0) == {}  # (no failbackMaxErrorPercent yet)
    engine.apply(_world(failbackRampSec=100, failbackMaxErrorPercent=10), 70.0)
    assert engine.gated_ramps(70.0) == {frontend: (10.0, [neg])}
    records = engine.abandon_ramp(72.0, frontend, neg, 40, 12)
    ramps = [r for r in records if isinstance(r, RampChange)]
    assert [(r.phase, r.errors, r.local) for r in ramps] == [(RampPhase.ABANDONED, (40, 12), True)]
    d = ramps[0].to_dict()
    assert d["errors"] == {"requests": 40, "failed": 12, "percent": 30.0, "windowSec": 10.0}
    assert "12 of 40" in d["reason"] and "30% > failbackMaxErrorPercent 10" in d["reason"]
    assert not [r for r in records if isinstance(r, RouteChange)]  # where it goes: unchanged
    assert _percents(engine) == {"europe-west1": 100.0}  # ... but nothing now
    assert engine.gated_ramps(75.0) == {}  # (put off: nothing to gate)
    # the success window: us-east1's check, 3 x 2 s, and at least the gate's 10 s
    assert engine.next_ramp_step(75.0) == 82.0
    assert engine.step_ramps(80.0) == []
    again = engine.step_ramps(82.0)
    assert [(r.phase, r.time) for r in again if isinstance(r, RampChange)] == [
        (RampPhase.STARTED, 82.0)
    ]
    engine.step_ramps(132.0)
    assert _percents(engine) == {"us-east1": 50.0, "europe-west1": 50.0}
    assert engine.abandon_ramp(132.0, frontend, "nope", 40, 40) == []


class _Health:
    """What the gate reads of a health service: its engine, clock and emit."""

    def __init__(self, engine: HealthEngine) -> None:
        self.engine = engine
        self.now = 0.0
        self.emitted: list[Record] = []

    def clock(self) -> float:
        return self.now

    def emit(self, records: list[Record]) -> None:
        self.emitted += records


def test_the_gate_counts_the_last_ten_seconds_and_needs_twenty() -> None:
    engine, _ = _ramping()
    engine.apply(_world(failbackRampSec=100, failbackMaxErrorPercent=25), 50.0)
    frontend = next(iter(engine.route_table().routes))
    health = _Health(engine)
    # us-east1's producer rule in the example world: 127.0.1.100:8080
    address = ("127.0.1.100", 8080)

    def second(t: int, served: int, failed: int) -> None:
        health.now = float(t)
        hops = Hops(served, failed, 0, {"503": failed} if failed else {})
        gate.observe(health.now, {frontend: {address: hops}} if served or failed else {})

    gate = RampGate(health)  # type: ignore[arg-type]
    for t, served, failed in ((51, 0, 0), (52, 5, 5), (53, 4, 4)):  # 18 tries: too few
        second(t, served, failed)
    assert health.emitted == []
    for t in range(54, 65):  # no traffic: the early failures leave the 10 s window
        second(t, 0, 0)
    for t in range(65, 76):  # 3 of 4 served from now on: 25 %, not more
        second(t, 3, 1)
    assert health.emitted == []
    second(76, 0, 10)
    [abandoned] = health.emitted
    assert isinstance(abandoned, RampChange) and abandoned.phase is RampPhase.ABANDONED
    # since the count 10 s before (t = 66): 9 x (3 served, 1 failed), then 10 failed
    assert abandoned.errors == (46, 19)
