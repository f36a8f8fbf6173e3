"""Slow start (SPEC §9, Envoy's with aggression 1) in virtual time: an
endpoint that joins the HEALTHY set of a producer backend service gets
weight x max(slowStartMinWeightPercent, t / slowStartSec) of its share of
new connections and requests until the time is up; the others keep theirs.
Its share is read from the producer listener's own rotation."""

from __future__ import annotations

from typing import Any

import pytest

from healthgate.dataplane.choice import Balance, UpstreamChoice
from healthgate.health.engine import HealthEngine
from healthgate.model.validation import parse_resource
from tests.helpers import OK, REFUSED, example_world, feed, resources

JOINER = ("127.0.1.4", 8080)  # us-east1's fourth endpoint


def world(**fields: Any) -> list[Any]:
    docs = example_world()
    for d in docs:
        if d["kind"] == "BackendService" and d["project"] == "shop" and d["region"] == "us-east1":
            d.update(fields)
    return resources(docs)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def setup(**fields: Any) -> tuple[HealthEngine, UpstreamChoice, str, Clock]:
    engine = HealthEngine()
    engine.apply(world(**fields), 0.0)
    feed(engine, 1.0, OK, times=3)
    choice = UpstreamChoice(engine, Balance.ROUND_ROBIN, {})
    choice.resources = engine.resources
    clock = Clock()
    choice.monotonic = clock
    rule = next(str(p) for p in engine.resources if p.collection == "forwardingRules"
                and p.project == "shop" and p.region == "us-east1")  # fmt: skip
    return engine, choice, rule, clock


def joiner_share(choice: UpstreamChoice, rule: str) -> float:
    """The joiner's part of the rotation, against an equal share (1.0)."""
    rotation = choice._producer_addresses(rule)
    return rotation.count(JOINER) / len(rotation) * 4


def rejoin(engine: HealthEngine, choice: UpstreamChoice, rule: str, clock: Clock) -> None:
    assert joiner_share(choice, rule) == 1.0  # (the first look starts nobody)
    feed(engine, 2.0, REFUSED, ip_prefix="127.0.1.4", times=3)
    assert JOINER not in choice._producer_addresses(rule)
    clock.t = 100.0
    feed(engine, 3.0, OK, ip_prefix="127.0.1.4", times=3)


@pytest.mark.parametrize(
    ("elapsed", "want"),
    [
        (0.0, 0.10),
        (1.0, 0.10),
        (2.5, 0.25),
        (5.0, 0.50),
        (7.5, 0.75),
        (9.9, 0.99),
        (10.0, 1.0),
        (60.0, 1.0),
    ],
)
def test_a_rejoining_endpoint_grows_along_the_line(elapsed: float, want: float) -> None:
    engine, choice, rule, clock = setup(slowStartSec=10, slowStartMinWeightPercent=10)
    rejoin(engine, choice, rule, clock)
    # (its share of the rotation: w x f against three others of weight 128)
    share = joiner_share(choice, rule)  # at t = 0 of its start
    assert share == pytest.approx(4 * 0.1 / 3.1, abs=0.02)
    clock.t = 100.0 + elapsed
    got = joiner_share(choice, rule)
    assert got == pytest.approx(4 * want / (3 + want), abs=0.02), (elapsed, got)


def test_without_slow_start_a_rejoining_endpoint_takes_its_share_at_once() -> None:
    engine, choice, rule, clock = setup()
    rejoin(engine, choice, rule, clock)
    assert joiner_share(choice, rule) == 1.0


def test_the_minimum_weight_holds_at_the_start() -> None:
    engine, choice, rule, clock = setup(slowStartSec=100, slowStartMinWeightPercent=50)
    rejoin(engine, choice, rule, clock)
    clock.t = 110.0  # (10 % of the way: the minimum, 50 %, still holds)
    assert joiner_share(choice, rule) == pytest.approx(4 * 0.5 / 3.5, abs=0.02)


def test_the_fast_paths_plan_follows_the_growth() -> None:
    engine, choice, rule, clock = setup(slowStartSec=10)
    rejoin(engine, choice, rule, clock)
    picks = [choice.first_try(rule, consumer=False) for _ in range(310)]
    early = sum(p is not None and p[0] == JOINER for p in picks)
    clock.t = 111.0
    picks = [choice.first_try(rule, consumer=False) for _ in range(400)]
    late = sum(p is not None and p[0] == JOINER for p in picks)
    assert early <= 12 and 90 <= late <= 110, (early, late)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"slowStartSec": 3601}, "slowStartSec"),
        ({"slowStartSec": -1}, "slowStartSec"),
        ({"slowStartMinWeightPercent": 0}, "slowStartMinWeightPercent"),
        ({"slowStartMinWeightPercent": 101}, "slowStartMinWeightPercent"),
    ],
)
def test_bad_slow_start_fields_are_refused_by_name(fields: dict[str, Any], named: str) -> None:
    doc = next(
        d for d in example_world() if d["kind"] == "BackendService" and d["project"] == "shop"
    )
    resource, issues = parse_resource({**doc, **fields})
    assert resource is None and any(named in f"{i.field} {i.message}" for i in issues), issues


def test_a_global_backend_service_has_no_slow_start() -> None:
    doc = next(
        d for d in example_world() if d["kind"] == "BackendService" and d["project"] == "web"
    )
    resource, issues = parse_resource({**doc, "slowStartSec": 30})
    assert resource is None and any("slowStartSec" in f"{i.field} {i.message}" for i in issues)
