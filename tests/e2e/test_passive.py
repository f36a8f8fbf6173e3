"""Real traffic as evidence, for real (SPEC §8): a serve with its front end
and real region backends that fail real requests while their health checks
pass (the checks come from their own source address, which the backends
spare: a gray failure).

* a region answering 500 to real requests and 200 to probes fails over (a
  TRAFFIC source in its composite), and after the switch no 500 reaches
  the client; healed, it comes back after holdSec;
* one endpoint failing every real request is ejected after its threshold
  and returns after the ejection time, its probe state untouched;
* three bad endpoints of four with a 25 % cap: one is ejected;
* a 503 brownout with a retry budget keeps the survivor's retried load
  within it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.harness import Backends, e2e_world, ports
from tests.helpers import run_cli
from tests.integration.serve_proc import ServeProcess, wait_for

US, EU = "us-east1", "europe-west1"
PROBE_SOURCE = "127.0.0.9"  # the prober's address: the backends spare it
FRONT = "/v1/projects/web/global/forwardingRules/shop-frontend"
US_BS = "/v1/projects/shop/regions/us-east1/backendServices/web"


class PassiveStack:
    def __init__(self, tmp: Path, edit: Any, *serve_args: str) -> None:
        backend, front, producer = ports()
        self.front = f"http://127.0.0.1:{front}/"
        self.backends = Backends(backend).__enter__()
        self.world = e2e_world(backend, front, producer)
        edit(self.world)
        self.manifest = tmp / "world.yaml"
        self.manifest.write_text(yaml.safe_dump_all(self.world))
        self.serve = ServeProcess(
            tmp / "s.db", "-f", str(self.manifest), "--probe-source", PROBE_SOURCE, *serve_args
        ).start()
        self.api = self.serve.client()
        wait_for(self.all_healthy, 30, what="every endpoint HEALTHY")

    def all_healthy(self) -> bool:
        for bs in (US_BS, "/v1/projects/shop/regions/europe-west1/backendServices/web"):
            body = self.api.get(bs + "/health").json()
            if body.get("healthy") != body.get("endpoints"):
                return False
        return self.region() == US

    def region(self) -> str | None:
        shares = (self.api.get(FRONT).json().get("status") or {}).get("route", {}).get("shares")
        return shares[0]["region"] if shares and len(shares) == 1 else None

    def restart(self, meanwhile: Any = None) -> None:
        """Stop serve, call ``meanwhile(db)``, start it again on its address."""
        self.api.close()
        self.serve.stop()
        if meanwhile is not None:
            meanwhile(self.serve.db)
        self.serve = ServeProcess(self.serve.db, *self.serve.extra, port=self.serve.port).start()
        self.api = self.serve.client()

    def gray(self, region: str, status: int, count: int | None = None) -> None:
        self.backends.backends.gray(region, status, PROBE_SOURCE, count)

    def events(self, project: str, kind: str) -> list[dict[str, Any]]:
        return list(
            self.api.get(f"/v1/projects/{project}/events", params={"kind": kind}).json()["items"]
        )

    def close(self) -> None:
        self.api.close()
        self.serve.stop()
        self.backends.__exit__(None, None, None)


def _traffic_source(world: list[dict[str, Any]], **policy: Any) -> None:
    for d in world:
        if d["kind"] == "CompositeHealthCheck" and d["region"] == US:
            d["healthSources"] = [*d["healthSources"], "healthSources/web-traffic"]
    world.append(
        {
            "kind": "HealthSource",
            "project": "shop",
            "region": US,
            "name": "web-traffic",
            "sourceType": "TRAFFIC",
            "sources": ["backendServices/web"],
            "trafficPolicy": policy,
        }
    )


def _outliers(world: list[dict[str, Any]], **policy: Any) -> None:
    for d in world:
        if d["kind"] == "BackendService" and d["project"] == "shop" and d["region"] == US:
            d["outlierDetection"] = policy


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Any]:
    made: list[PassiveStack] = []

    def build(edit: Any, *args: str) -> PassiveStack:
        made.append(PassiveStack(tmp_path, edit, *args))
        return made[-1]

    yield build
    for s in made:
        s.close()


def _requests(client: httpx.Client, url: str, n: int) -> list[tuple[int, str]]:
    out = []
    for _ in range(n):
        r = client.get(url)
        out.append((r.status_code, r.text.split()[0].removeprefix("region=") if r.text else ""))
    return out


def test_a_gray_region_fails_over_on_its_real_traffic_and_comes_back(make: Any) -> None:
    stack = make(lambda w: _traffic_source(w, windowSec=5, minimumRequests=20, holdSec=10))
    with httpx.Client(timeout=5) as client:
        assert {r for _, r in _requests(client, stack.front, 20)} == {US}
        stack.gray(US, 500)
        broke = time.monotonic()
        answers: list[tuple[float, int, str]] = []
        # requests go on until the route has moved (bounded: 15 s, 20,000 requests)
        while stack.region() != EU and time.monotonic() - broke < 15 and len(answers) < 20_000:
            for status, region in _requests(client, stack.front, 10):
                answers.append((time.monotonic() - broke, status, region))
        moved = time.monotonic() - broke
        assert stack.region() == EU, answers[-5:]
        print(f"\nfailed over {moved:.1f} s after the gray failure ({len(answers)} requests)")
        assert moved <= 5 + 2  # windowSec plus a second or two
        after = _requests(client, stack.front, 200)
        assert Counter(after) == Counter({(200, EU): 200})  # no 500 reaches the client
    [source] = [
        e
        for e in stack.events("shop", "HealthSource")
        if e["name"] == "web-traffic" and e["to"] == "UNHEALTHY"
    ]
    assert "requests failed" in source["reason"], source
    assert "500 ×" in source["reason"]
    out = run_cli(
        "describe", "fr", "shop-frontend", "--server", stack.serve.url, "--project", "web"
    )
    assert "HealthSource projects/shop/regions/us-east1/healthSources/web-traffic: UNHEALTHY" in (
        out.stdout
    ), out.stdout + out.stderr
    assert "real traffic (this node):" in out.stdout
    # healed: no traffic to judge while routed away; holdSec later probes are trusted again
    stack.gray(US, 0)
    wait_for(lambda: stack.region() == US, 20, what="back to us-east1 after holdSec")
    back = [e for e in stack.events("shop", "HealthSource") if e["name"] == "web-traffic"][-1]
    assert back["to"] == "HEALTHY" and "trusting probes again" in back["reason"], back


def test_an_endpoint_failing_real_requests_is_ejected_and_returns(make: Any) -> None:
    stack = make(
        lambda w: _outliers(w, consecutiveErrors=5, baseEjectionTimeSec=3, maxEjectionPercent=25)
    )
    bad = "127.0.1.1"
    stack.gray(US, 500, count=1)
    with httpx.Client(timeout=5) as client:
        first = _requests(client, stack.front, 40)  # round robin: 10 reach the bad one
        assert (500, US) in first
        wait_for(
            lambda: any(e["to"] == "EJECTED" for e in stack.events("shop", "Ejection")),
            5,
            what="an ejection",
        )
        [ejected] = [e for e in stack.events("shop", "Ejection") if e["to"] == "EJECTED"]
        assert ejected["name"] == f"{bad}:{stack.backends.port}"
        assert ejected["reason"].startswith("5 consecutive errors: 500, 500, 500, 500, 500")
        health = stack.api.get(US_BS + "/health").json()
        [status] = [s for s in health["healthStatus"] if s["ipAddress"] == bad]
        assert status["healthState"] == "HEALTHY" and status["ejectedUntil"], status
        assert health["ejected"] == 1
        out = run_cli(
            "describe", "fr", "shop-frontend", "--server", stack.serve.url, "--project", "web"
        )
        assert f"{bad}:{stack.backends.port}: HEALTHY" in out.stdout, out.stdout + out.stderr
        assert "ejected from real traffic until" in out.stdout
        stack.backends.backends.by_endpoint.clear()
        during = _requests(client, stack.front, 60)
        assert Counter(during) == Counter({(200, US): 60})  # none reach the ejected endpoint
        wait_for(
            lambda: any(e["to"] == "RETURNED" for e in stack.events("shop", "Ejection")),
            8,
            what="its return",
        )
    [back] = [e for e in stack.events("shop", "Ejection") if e["to"] == "RETURNED"]
    assert back["name"] == ejected["name"]
    assert ejected["ejectedUntil"] <= back["timestamp"]


def test_three_bad_endpoints_of_four_with_a_25_percent_cap_eject_one(make: Any) -> None:
    stack = make(lambda w: _outliers(w, consecutiveErrors=3, maxEjectionPercent=25))
    stack.gray(US, 500, count=3)
    with httpx.Client(timeout=5) as client:
        _requests(client, stack.front, 60)
        wait_for(lambda: len(stack.events("shop", "Ejection")) >= 3, 5, what="three detections")
    phases = Counter(e["to"] for e in stack.events("shop", "Ejection"))
    assert phases["EJECTED"] == 1 and phases["DETECTED"] >= 2, phases
    health = stack.api.get(US_BS + "/health").json()
    assert sum(1 for s in health["healthStatus"] if s.get("ejectedUntil")) == 1


def test_a_brownout_with_a_retry_budget_bounds_the_survivors_retried_load(make: Any) -> None:
    def edit(world: list[dict[str, Any]]) -> None:
        for d in world:
            if d["kind"] == "BackendService" and d["project"] == "web":
                d["failoverPolicy"] = {
                    **d.get("failoverPolicy", {}),
                    "retryBudget": {"percent": 20, "minConcurrent": 3},
                }

    stack = make(edit)
    stack.backends.backends.uncounted.add(PROBE_SOURCE)  # (the front end's load alone)
    stack.backends.backends.slow(EU, 0.3)
    stack.gray(US, 503)  # probes pass: the route stays; every request retried in europe
    clients = 30

    async def load() -> Counter[int]:
        seen: Counter[int] = Counter()
        async with httpx.AsyncClient(timeout=10) as client:

            async def one_client() -> None:
                for _ in range(6):
                    r = await client.get(stack.front)
                    seen[r.status_code] += 1

            await asyncio.gather(*(one_client() for _ in range(clients)))
        return seen

    seen = asyncio.run(load())
    peak = stack.backends.backends.peak.get(EU, 0)
    print(f"\n{clients} clients in a 503 brownout: {dict(seen)}; europe-west1 peak {peak}")
    # retries in flight <= max(3, 20 % x 30 requests in flight) = 6
    assert peak <= 6, peak
    assert seen[200] > 0 and seen[503] > 0, seen  # the budget let some through, refused others
    metrics = stack.api.get("/metrics").text
    assert "healthgate_retry_budget_exhausted_total" in metrics
