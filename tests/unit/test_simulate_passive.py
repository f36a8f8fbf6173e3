"""``healthgate simulate`` with real traffic scripted (SPEC §8): a gray
failure rehearsed in virtual time, an ejection, a storm held."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from healthgate.health.states import Ejection, Hold, RouteChange, Transition
from healthgate.simulation.runner import simulate
from healthgate.simulation.scenario import Scenario
from tests.helpers import example_world, resources, run_cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def world(outliers: dict[str, Any] | None = None, traffic: bool = False) -> list[Any]:
    docs = example_world()
    for d in docs:
        if d["kind"] == "BackendService" and d["region"] == "us-east1" and outliers:
            d["outlierDetection"] = outliers
    if traffic:
        extra = list(yaml.safe_load_all((EXAMPLES / "traffic-source.yaml").read_text()))
        docs = [
            d
            for d in docs
            if not (d["kind"] == "CompositeHealthCheck" and d["region"] == "us-east1")
        ]
        docs += extra
    return resources(docs)


def test_a_gray_failure_fails_over_and_comes_back_after_hold() -> None:
    scenario = Scenario.model_validate(
        yaml.safe_load((EXAMPLES / "scenario-us-east1-gray.yaml").read_text())
    )
    result = simulate(world(traffic=True), scenario)
    routes = [(r.time, r.current) for r in result.records if isinstance(r, RouteChange)]
    assert routes[0][0] == 31.0 and str(routes[0][1]).endswith("shop-eu")
    sources = [r for r in result.records if isinstance(r, Transition) and r.name == "web-traffic"]
    assert sources[0].reason.startswith("96 of 480 requests failed (20.0 %) in 10 s: 500 ×96")
    # healed at 90 while away; the last hold ends at 110 and it stays back
    assert str(routes[-1][1]).endswith("shop-us") and routes[-1][0] == 110.0


def test_an_ejection_in_virtual_time() -> None:
    scenario = Scenario.model_validate(
        {
            "duration": 60,
            "start": "healthy",
            "traffic": {"requestsPerSecond": 40},
            "events": [{"at": 10, "select": {"endpoint": "127.0.1.1"}, "errorRate": 1.0}],
        }
    )
    result = simulate(world({"consecutiveErrors": 5, "baseEjectionTimeSec": 20}), scenario)
    ejections = [(r.time, r.phase) for r in result.records if isinstance(r, Ejection)]
    # out at 10 (its first second of errors), back at 30, out again at 31
    # (40 s: twice as long, so still out at the end)
    assert ejections == [(10.0, "EJECTED"), (30.0, "RETURNED"), (31.0, "EJECTED")]
    assert not [r for r in result.records if isinstance(r, RouteChange)]  # probes pass: no failover


def test_a_storm_is_held_in_simulate_and_shown_by_the_cli(tmp_path: Path) -> None:
    scenario = {
        "duration": 40,
        "start": "healthy",
        "stormHoldPercent": 30,
        "events": [{"at": 10, "select": {}, "fault": "refuse"}],
    }
    result = simulate(world(), Scenario.model_validate(scenario))
    assert any(isinstance(r, Hold) for r in result.records)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(scenario))
    out = run_cli(
        "simulate", "-f", str(EXAMPLES / "two-regions.yaml"), "--scenario", str(tmp_path / "s.yaml"),
        "--no-endpoints",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert " Hold " in out.stdout and "HELD" in out.stdout


def test_an_error_rate_event_is_validated_naming_the_field(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(
        yaml.safe_dump({"duration": 10, "events": [{"at": 1, "select": {}, "errorRate": 1.5}]})
    )
    out = run_cli(
        "simulate", "-f", str(EXAMPLES / "two-regions.yaml"), "--scenario", str(tmp_path / "s.yaml")
    )
    assert (out.returncode != 0 and "errorRate" in out.stderr) or "error_rate" in out.stderr
