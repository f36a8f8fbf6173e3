"""Pushed health (SPEC §10) in the pure engine, in virtual time: a PUSH
check's endpoints take what was reported, until the TTL runs out."""

from __future__ import annotations

from typing import Any

import pytest

from healthgate.health.engine import HealthEngine
from healthgate.health.states import HealthState, RecordKind, Transition
from healthgate.model.checks import EndpointReport, report_name
from healthgate.model.names import ResourcePath
from healthgate.model.resources import Resource
from tests.helpers import example_dicts, find, resources

T0 = 1_800_000_000.0
TTL = 30
BS = ResourcePath("shop", "us-east1", "backendServices", "web")
US_NEG = "projects/web/regions/us-east1/networkEndpointGroups/shop-us"


def push_world(ttl: int = TTL) -> list[Resource]:
    dicts = example_dicts()
    hc = find(dicts, "HealthCheck", "http-8080", "us-east1")
    for k in [k for k in hc if k not in ("kind", "name", "project", "region")]:
        del hc[k]
    hc.update(type="PUSH", ttlSec=ttl)
    return resources(dicts)


def report(endpoint: str, state: str, at: float, note: str = "") -> EndpointReport:
    return EndpointReport(
        kind="EndpointReport", name=report_name("web", endpoint), project="shop",
        region="us-east1", backend_service="web", endpoint=endpoint, state=state,
        note=note, time=at, actor="batch",
    )  # fmt: skip


class World:
    def __init__(self, ttl: int = TTL) -> None:
        self.engine = HealthEngine()
        self.world: dict[ResourcePath, Resource] = {r.path: r for r in push_world(ttl)}
        self.engine.apply_change(dict(self.world), set(self.world), T0)

    def put(self, at: float, *docs: Resource) -> list[Any]:
        for d in docs:
            self.world[d.path] = d
        result = self.engine.apply_change(dict(self.world), {d.path for d in docs}, at)
        return result.records

    def states(self) -> dict[str, str]:
        return {f"{e.ip}:{e.port}": e.state.name for e in self.engine.endpoints(BS)}

    def reasons(self) -> dict[str, str]:
        return {f"{e.ip}:{e.port}": e.reason for e in self.engine.endpoints(BS)}

    def neg(self) -> HealthState:
        status = self.engine.node_status(ResourcePath.parse(US_NEG))
        assert status is not None
        return status.state


def test_nothing_is_probed_and_reports_decide() -> None:
    w = World()
    assert not [t for t in w.engine.targets() if t.backend_service == BS]
    assert set(w.states().values()) == {"UNKNOWN"}
    eps = ["127.0.1.1:8080", "127.0.1.2:8080", "127.0.1.3:8080", "127.0.1.4:8080"]
    w.put(T0 + 1, *(report(e, "HEALTHY", T0 + 1, "nightly run ok") for e in eps))
    assert set(w.states().values()) == {"HEALTHY"}
    assert w.neg() is HealthState.HEALTHY
    reason = w.reasons()[eps[0]]
    assert reason.startswith("reported HEALTHY at ") and "by batch: nightly run ok" in reason
    # a verdict at once: no thresholds
    w.put(T0 + 2, report(eps[0], "UNHEALTHY", T0 + 2), report(eps[1], "DEGRADED", T0 + 2))
    assert w.states()[eps[0]] == "UNHEALTHY" and w.states()[eps[1]] == "DEGRADED"


def test_the_ttl_runs_out_at_its_own_time() -> None:
    w = World()
    ep = "127.0.1.1:8080"
    w.put(T0 + 1, report(ep, "HEALTHY", T0 + 1))
    assert w.engine.next_report_expiry() == T0 + TTL  # (the unreported ones: since they appeared)
    records = w.engine.expire_reports(T0 + TTL)
    assert {r.path.rsplit("/", 1)[1] for r in records if isinstance(r, Transition)
            and r.kind is RecordKind.ENDPOINT} == {"127.0.1.2:8080", "127.0.1.3:8080", "127.0.1.4:8080"}  # fmt: skip
    assert w.states()[ep] == "HEALTHY"
    assert w.engine.next_report_expiry() == T0 + 1 + TTL
    w.put(T0 + 20, report(ep, "HEALTHY", T0 + 20))  # reported again: the deadline moves
    assert w.engine.expire_reports(T0 + 1 + TTL) == []
    assert w.engine.next_report_expiry() == T0 + 20 + TTL
    records = w.engine.expire_reports(T0 + 60)
    ends = [r for r in records if isinstance(r, Transition) and r.kind is RecordKind.ENDPOINT]
    assert [(r.current, r.time) for r in ends] == [(HealthState.UNHEALTHY, T0 + 20 + TTL)]
    assert "no report since" in ends[0].reason and "(ttlSec 30)" in ends[0].reason
    assert w.neg() is HealthState.UNHEALTHY  # every endpoint of it run out
    assert w.engine.next_report_expiry() is None


def test_a_restart_keeps_what_is_within_its_ttl() -> None:
    """A new engine over the stored world (reports included): a report
    within its TTL stands, one past it is UNHEALTHY at once."""
    w = World()
    w.put(
        T0 + 1,
        report("127.0.1.1:8080", "HEALTHY", T0 + 1),
        report("127.0.1.2:8080", "HEALTHY", T0 - 100),
    )
    again = HealthEngine()
    again.apply_change(dict(w.world), set(w.world), T0 + 10)
    states = {f"{e.ip}:{e.port}": e.state.name for e in again.endpoints(BS)}
    assert states["127.0.1.1:8080"] == "HEALTHY"
    assert states["127.0.1.2:8080"] == "UNHEALTHY"
    assert states["127.0.1.3:8080"] == "UNKNOWN"  # (never reported: its TTL from now)


@pytest.mark.parametrize("endpoint", ["127.0.9.9:8080", "127.0.1.1:9999"])
def test_a_report_of_no_endpoint_changes_nothing(endpoint: str) -> None:
    w = World()
    assert w.put(T0 + 1, report(endpoint, "HEALTHY", T0 + 1)) == []
    assert set(w.states().values()) == {"UNKNOWN"}


def test_from_push_to_probed_and_back() -> None:
    w = World()
    w.put(T0 + 1, report("127.0.1.1:8080", "HEALTHY", T0 + 1))
    http = next(r for r in resources(example_dicts()) if r.path.collection == "healthChecks"
                and r.region == "us-east1")  # fmt: skip
    w.world[http.path] = http
    result = w.engine.apply_change(dict(w.world), {http.path}, T0 + 2)
    assert len(result.added) == 4  # probed now
    push = next(r for r in push_world() if r.path == http.path)
    w.world[push.path] = push
    result = w.engine.apply_change(dict(w.world), {push.path}, T0 + 3)
    assert len(result.removed) == 4 and not result.added
