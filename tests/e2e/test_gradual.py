"""Gradual failover and ramped failback for real (SPEC §6): a serve with its
front end and real region backends.

* spill PROPORTIONAL: two of us-east1's four endpoints fail (503): its
  healthy fraction 0.5 gives it 0.5 x 1.4 = 70 % of new requests;
* failbackRampSec: us-east1 fails, then recovers; its share of real
  requests grows along the line, the log holds the ramp's start and end and
  one route record for the failback (none per step); a restart in the
  middle of a ramp resumes it from the stored start.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.test_shares import BS, Stack
from tests.helpers import run_cli
from tests.integration.serve_proc import wait_for

US, EU = "us-east1", "europe-west1"

# timed to a fraction of a second: run alone on the machine (tests/conftest.py)
pytestmark = pytest.mark.serial


class GradualStack(Stack):
    def policy(self, **fields: Any) -> None:
        bs = self.api.get(BS).json()
        bs["failoverPolicy"] = {**(bs.get("failoverPolicy") or {}), **fields}
        for key in ("selfLink", "creationTimestamp", "updateTimestamp", "status"):
            bs.pop(key, None)
        resp = self.api.put(BS, json=bs)
        assert resp.is_success, resp.text
        for doc in self.world:  # (serve applies its manifest again when it starts)
            if doc["kind"] == "BackendService" and doc["project"] == "web":
                doc["failoverPolicy"] = bs["failoverPolicy"]
        self.manifest.write_text(yaml.safe_dump_all(self.world))

    def events(self, kind: str, after: int = 0) -> list[dict[str, Any]]:
        items = self.api.get("/v1/projects/web/events", params={"kind": kind}).json()["items"]
        return [e for e in items if e["id"] > after]

    def last_id(self) -> int:
        items = self.api.get("/v1/projects/web/events").json()["items"]
        return max((e["id"] for e in items), default=0)

    def ramp_start(self) -> float | None:
        ramps = self.route().get("ramps") or []
        return datetime.fromisoformat(ramps[0]["start"]).timestamp() if ramps else None

    def fail_us(self) -> None:
        self.backends.set_mode(US, "refuse")
        wait_for(lambda: self.shares() == {EU: 100.0}, 20, what="failover to europe-west1")


PROBE_SOURCE = "127.0.0.9"  # (so that a backend can fail real requests, not probes)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[GradualStack]:
    s = GradualStack(tmp_path, "--probe-source", PROBE_SOURCE)
    try:
        yield s
    finally:
        s.close()


def test_proportional_spill_with_real_requests(stack: GradualStack) -> None:
    policy = stack.api.get("/v1/projects/shop/regions/us-east1/healthAggregationPolicies").json()
    doc = policy["items"][0]
    for key in ("selfLink", "creationTimestamp", "updateTimestamp", "status"):
        doc.pop(key, None)
    doc["healthyPercentThreshold"], doc["minHealthyThreshold"] = 25, 1
    url = f"/v1/projects/shop/regions/us-east1/healthAggregationPolicies/{doc['name']}"
    assert stack.api.put(url, json=doc).is_success
    stack.policy(spill="PROPORTIONAL")
    failed = stack.backends.run(stack.backends.backends.set_mode(US, "503", count=2))
    assert failed == 2
    wait_for(lambda: stack.shares() == {US: 70.0, EU: 30.0}, 30, what="70/30 by healthy fraction")
    composite = "/v1/projects/shop/regions/us-east1/compositeHealthChecks/web-composite"
    status = stack.api.get(composite).json()["status"]
    assert status["healthState"] == "HEALTHY" and status["healthyFraction"] == 0.5
    seen = stack.split(1_000)
    us = 100 * seen[US] / 1_000
    print(f"\nhealthy fraction 0.5: {dict(seen)} = {us:.1f}% us-east1")
    assert abs(us - 70) <= 5, seen  # (1,000 draws of 0.7: one standard deviation is 1.4)


def test_a_ramped_failback_follows_its_line(stack: GradualStack) -> None:
    seconds = 8
    stack.policy(failbackRampSec=seconds)
    stack.fail_us()
    after = stack.last_id()
    stack.backends.set_mode(US, "ok")
    wait_for(lambda: stack.ramp_start() is not None, 20, what="the ramp's start")
    start = stack.ramp_start()
    assert start is not None
    seen: list[tuple[float, str]] = []
    with httpx.Client(timeout=5) as client:
        while (now := time.time()) < start + seconds + 1 and len(seen) < 100_000:
            region = client.get(stack.front).text.split()[0].removeprefix("region=")
            seen.append((now, region))
    points = {}
    for at in (0.25, 0.5, 0.75):
        mid = start + at * seconds
        window = [r for t, r in seen if abs(t - mid) <= 0.4]
        points[at] = (100 * Counter(window)[US] / max(1, len(window)), len(window))
    print(f"\nramp over {seconds} s: {points}")
    for at, (us, n) in points.items():
        assert n >= 200, points
        # the window's mean of the line is the line at its middle; steps are
        # 0.6 points; n >= 200 draws: one standard deviation <= 3.5 points
        assert abs(us - at * 100) <= 10, points
    assert points[0.25][0] < points[0.5][0] < points[0.75][0], points
    wait_for(lambda: stack.shares() == {US: 100.0}, 10, what="the ramp's end")
    ramps = stack.events("Ramp", after)
    assert [e["to"] for e in ramps] == ["STARTED", "ENDED"], ramps
    assert ramps[1]["time"] == pytest.approx(ramps[0]["time"] + seconds)
    routes = stack.events("Route", after)
    assert len(routes) == 1 and routes[0]["to"].endswith("shop-us"), routes  # one, no steps


def test_a_restart_in_the_middle_of_a_ramp_resumes_it(stack: GradualStack) -> None:
    seconds = 60
    stack.policy(failbackRampSec=seconds)
    stack.fail_us()
    stack.backends.set_mode(US, "ok")
    wait_for(lambda: stack.ramp_start() is not None, 20, what="the ramp's start")
    start = stack.ramp_start()
    after = stack.last_id()
    stack.api.close()
    stack.serve.stop()
    stack.serve.start()
    stack.api = stack.serve.client()
    assert stack.ramp_start() == start
    wait_for(stack.both_healthy, 20, what="both regions HEALTHY again")
    us = stack.shares().get(US, 0.0)
    line = 100 * (time.time() - (start or 0)) / seconds
    assert abs(us - line) <= 5, (us, line)  # (shares move every 0.3 s)
    assert stack.events("Route", after) == []  # nothing recorded again
    assert stack.events("Ramp", after) == []
    # describe explains each share: the ramp's part in it, and the ramp
    out = run_cli(
        "describe", "fr", "shop-frontend", "--server", stack.serve.url, "--project", "web"
    )
    assert out.returncode == 0, out.stderr
    assert "share " in out.stdout and "% us-east1: shop-us: failback ramp " in out.stdout, (
        out.stdout
    )
    assert "ramp shop-us: " in out.stdout and "of 60 s since" in out.stdout, out.stdout


def test_the_error_gate_abandons_a_ramp_that_fails_real_requests(stack: GradualStack) -> None:
    # us-east1 comes back for its probes, but answers every real request 503
    stack.policy(failbackRampSec=30, failbackMaxErrorPercent=20)
    stack.fail_us()
    after = stack.last_id()
    stack.backends.backends.deny(US, "127.0.0.1")  # (the front end's address; probes pass)
    stack.backends.set_mode(US, "ok")
    wait_for(lambda: stack.ramp_start() is not None, 20, what="the ramp's start")
    errors = 0
    with httpx.Client(timeout=5) as client:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not stack.events("Ramp", after)[1:]:
            for _ in range(200):  # (GETs: a 503 is retried in europe-west1)
                errors += client.get(stack.front).status_code != 200
    ramps = stack.events("Ramp", after)
    assert [e["to"] for e in ramps] == ["STARTED", "ABANDONED"], ramps
    figures = ramps[1]["errors"]
    print(f"\nabandoned: {figures}; {errors} requests failed at the client")
    assert figures["requests"] >= 20 and figures["percent"] > 20, figures
    assert "failbackMaxErrorPercent 20" in ramps[1]["reason"]
    assert errors == 0  # the front end retried each one in europe-west1
    assert stack.shares() == {EU: 100.0}
    # fixed: a success window later (10 s at least) the ramp starts again
    stack.backends.backends.deny(US, "127.0.0.1", on=False)
    wait_for(lambda: len(stack.events("Ramp", after)) == 3, 20, what="the ramp again")
    again = stack.events("Ramp", after)[2]
    assert again["to"] == "STARTED"
    assert again["time"] == pytest.approx(ramps[1]["time"] + 10, abs=0.01)
