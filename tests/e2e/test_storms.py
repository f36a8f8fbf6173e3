"""Failover storms held, for real (SPEC §8): a serve with
``--storm-hold-percent 30`` and real region backends whose health checks
are cut - the backends answer 503 to the prober's address only, so real
requests still succeed (the checker's own network is the fault).

* the probes of both regions cut at once: the routes stay (a Hold record,
  the hold listed, the alert's metric set), real requests keep succeeding;
* one region's probes cut: it fails over (a region failing alone is never
  held);
* an admin releases a hold: routes follow health again, a Change record.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_passive import EU, PROBE_SOURCE, US, PassiveStack
from tests.integration.serve_proc import wait_for


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[PassiveStack]:
    s = PassiveStack(tmp_path, lambda _w: None, "--storm-hold-percent", "30")
    try:
        yield s
    finally:
        s.close()


def cut_probes(stack: PassiveStack, region: str, on: bool = True) -> None:
    stack.backends.backends.deny(region, PROBE_SOURCE, on)


def unhealthy(stack: PassiveStack, region: str) -> bool:
    neg = "shop-us" if region == US else "shop-eu"
    status = stack.api.get(f"/v1/projects/web/regions/{region}/networkEndpointGroups/{neg}").json()
    return (status.get("status") or {}).get("healthState") == "UNHEALTHY"


def holds(stack: PassiveStack) -> list[dict[str, Any]]:
    return list(stack.api.get("/v1/holds").json()["items"])


def test_probes_of_two_regions_cut_at_once_hold_the_routes(stack: PassiveStack) -> None:
    cut_probes(stack, US)
    cut_probes(stack, EU)
    wait_for(lambda: unhealthy(stack, US) and unhealthy(stack, EU), 15, what="both NEGs UNHEALTHY")
    wait_for(lambda: bool(holds(stack)), 5, what="a hold")
    [hold] = holds(stack)
    assert hold["regions"] == [EU, US] and hold["to"] == "HELD"
    assert stack.region() == US  # the route stayed (or came back) where it was
    with httpx.Client(timeout=5) as client:
        answers = [client.get(stack.front) for _ in range(50)]
    assert all(a.status_code == 200 and "region=us-east1" in a.text for a in answers)
    [record] = [e for e in stack.events("web", "Hold") if e["to"] == "HELD"]
    assert record["name"] == hold["name"] and "turned UNHEALTHY within 30 s" in record["reason"]
    assert "healthgate_storm_hold{" in stack.api.get("/metrics").text
    # the checks come back: the hold lifts by itself, nothing moved
    cut_probes(stack, US, False)
    cut_probes(stack, EU, False)
    wait_for(lambda: not holds(stack), 15, what="the hold lifted")
    assert [e["to"] for e in stack.events("web", "Hold")] == ["HELD", "LIFTED"]
    assert stack.region() == US


def test_one_region_alone_fails_over(stack: PassiveStack) -> None:
    cut_probes(stack, US)
    wait_for(lambda: stack.region() == EU, 15, what="failover to europe-west1")
    assert holds(stack) == [] and stack.events("web", "Hold") == []


def test_an_admin_release_lets_the_routes_follow(stack: PassiveStack) -> None:
    cut_probes(stack, US)
    cut_probes(stack, EU)
    wait_for(lambda: bool(holds(stack)), 15, what="a hold")
    cut_probes(stack, EU, False)  # europe back: us-east1's four of six still UNHEALTHY
    wait_for(lambda: not unhealthy(stack, EU), 15, what="europe-west1 HEALTHY again")
    [hold] = holds(stack)
    assert stack.region() == US
    released = stack.api.post(f"/v1/holds/{hold['name']}:release")
    assert released.status_code == 200, released.text  # (open access here: the local admin)
    wait_for(lambda: stack.region() == EU, 5, what="the route following health")
    changes = [e for e in stack.events("web", "Change") if e["action"] == "hold-release"]
    assert len(changes) == 1 and changes[0]["hold"] == hold["name"]
    assert [e["to"] for e in stack.events("web", "Hold")] == ["HELD", "RELEASED"]
    missing = stack.api.post(f"/v1/holds/{hold['name']}:release")
    assert missing.status_code == 404
