"""The dashboard's charts in headless Chromium (issue 44): the demo's front
end carries its load generator's traffic; a region is broken during the
test, and the stacked requests move to the other region at the Route
marker of the decision; a reload mid-incident shows what came before; the
page loads nothing from anywhere but the API. And a project of 500 front
ends and 50,000 endpoints opens within 2 s, its strips counted."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from playwright.sync_api import Page, expect, sync_playwright

from tests.browser.demo import running_demo
from tests.browser.test_dashboard import ARTIFACTS, CHROMIUM, FLAGS
from tests.integration.serve_proc import ServeProcess, wait_for

FRONT = "projects/web/global/forwardingRules/shop-frontend"


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[str]:
    with running_demo(tmp_path) as demo:
        yield demo.url


def chart(page: Page) -> dict[str, Any]:
    """What the page has drawn of the front end (its charts' data)."""
    out: dict[str, Any] = page.evaluate(f"() => window.healthgateCharts[{FRONT!r}] || null") or {}
    return out


def per_second(c: dict[str, Any], region: str) -> list[int]:
    series = c.get("series") or {}
    return list(series.get("regions", {}).get(region, {}).get("requests", []))


def test_the_charts_show_a_failover_at_its_marker_and_survive_a_reload(demo: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        seen: list[str] = []
        page.on("request", lambda r: seen.append(r.url))
        page.goto(demo + "/")
        # the load generator's requests, charted on us-east1
        wait_for(lambda: sum(per_second(chart(page), "us-east1")[-10:]) > 90, 30,
                 what="us-east1 carrying traffic on the chart for seconds")  # fmt: skip
        expect(page.locator(".charts canvas.c-requests")).to_have_count(1)
        route = page.locator(f'.charts[data-charts="{FRONT}"] .marker.k-Route')
        before = route.count()  # (the demo's first route, when it started)
        page.locator('.card[data-region="us-east1"] button[data-mode="refuse"]').click()
        expect(route).to_have_count(before + 1, timeout=20_000)
        assert "failing over to shop-asia-east1" in (route.last.get_attribute("title") or "")
        decided = float(route.last.get_attribute("data-time") or 0)
        # the stacked series moves to asia-east1 at the marker
        wait_for(lambda: sum(per_second(chart(page), "asia-east1")[-3:]) > 5, 20,
                 what="asia-east1 carrying the traffic")  # fmt: skip
        # (seconds after the move, live from the event stream)
        wait_for(lambda: chart(page).get("now", 0) >= decided + 8, 20, what="8 s charted after")
        c = chart(page)
        start = c["series"]["start"]
        us, asia = per_second(c, "us-east1"), per_second(c, "asia-east1")
        moved = next(start + i for i, n in enumerate(asia) if n > 0)
        assert abs(moved - decided) <= 2.5, (moved, decided)
        after = int(decided) + 3 - start  # (a second is counted at its end: one more)
        assert sum(us[after:]) == 0 and sum(asia[after:]) > 20, (us[after:], asia[after:])
        earlier = us[: int(decided) - 2 - start]  # (us-east1 carried it before the marker)
        assert sum(earlier) > 20, (us, asia, start, decided)
        page.screenshot(path=str(ARTIFACTS / "dashboard-charts-incident.png"), full_page=True)
        # the endpoints' strip shows us-east1's going down
        strip = page.locator(f'.charts[data-charts="{FRONT}"] .strip[data-region="us-east1"]')
        expect(strip).to_have_attribute("data-endpoints", "3")
        us_strip = chart(page)["endpoints"]["us-east1"]["endpoints"]
        assert all(ep["changes"] and ep["changes"][-1][1] == "UNHEALTHY" for ep in us_strip)

        # a reload mid-incident: the history is there at once, markers too
        page.reload()
        wait_for(lambda: chart(page).get("series"), 10, what="the chart after a reload")
        c = chart(page)
        assert sum(per_second(c, "us-east1")[: int(decided) - 2 - c["series"]["start"]]) > 20
        expect(route).to_have_count(before + 1, timeout=10_000)
        # heal: traffic comes back, at the failback's marker
        page.locator('.card[data-region="us-east1"] button[data-mode="heal"]').click()
        expect(route).to_have_count(before + 2, timeout=30_000)
        wait_for(lambda: sum(per_second(chart(page), "us-east1")[-3:]) > 5, 20,
                 what="us-east1 carrying the traffic again")  # fmt: skip
        browser.close()
    outside = [u for u in seen if not u.startswith(demo + "/")]
    assert seen and outside == [], outside
    ui = httpx.get(demo + "/ui/", timeout=5)
    assert "default-src 'self'" in ui.headers["content-security-policy"]


def big_world(fronts: int = 500, endpoints: int = 50_000) -> list[dict[str, Any]]:
    """A producer with two regions of 50 services each (endpoints unprobed:
    their checks disabled), and a consumer with ``fronts`` front ends over
    them - every front end reaching one service in each region."""
    per_service = endpoints // 100
    docs: list[dict[str, Any]] = []
    for r, region in enumerate(("us-east1", "europe-west1")):
        base = {"project": "big", "region": region}
        docs.append({**base, "kind": "HealthCheck", "name": "hc", "type": "TCP", "port": 8080,
                     "enabled": False})  # fmt: skip
        docs.append({**base, "kind": "HealthAggregationPolicy", "name": "pol",
                     "healthyPercentThreshold": 50})  # fmt: skip
        for s in range(50):
            svc = f"svc-{s}"
            eps = [{"ipAddress": f"10.{r + 1}.{(s * per_service + i) // 250}.{(s * per_service + i) % 250 + 1}",
                    "port": 8080} for i in range(per_service)]  # fmt: skip
            docs += [
                {**base, "kind": "NetworkEndpointGroup", "name": svc,
                 "networkEndpointType": "GCE_VM_IP_PORT", "endpoints": eps},
                {**base, "kind": "BackendService", "name": svc, "protocol": "HTTP",
                 "loadBalancingScheme": "INTERNAL_MANAGED", "healthChecks": ["hc"],
                 "backends": [{"group": f"networkEndpointGroups/{svc}"}]},
                {**base, "kind": "HealthSource", "name": svc, "sources": [f"backendServices/{svc}"],
                 "healthAggregationPolicy": "pol"},
                {**base, "kind": "ForwardingRule", "name": svc, "IPAddress": f"10.{r + 1}.250.{s + 1}",
                 "ports": [80], "loadBalancingScheme": "INTERNAL_MANAGED",
                 "backendService": f"backendServices/{svc}"},
                {**base, "kind": "CompositeHealthCheck", "name": svc, "healthSources": [svc],
                 "healthDestination": f"forwardingRules/{svc}"},
                {**base, "kind": "ServiceAttachment", "name": svc,
                 "targetService": f"forwardingRules/{svc}"},
            ]  # fmt: skip
    for f in range(fronts):
        name, svc = f"front-{f:03d}", f"svc-{f % 50}"
        negs = []
        for region in ("us-east1", "europe-west1"):
            neg = f"{name}-{region}"
            negs.append({"group": f"regions/{region}/networkEndpointGroups/{neg}"})
            docs.append({"kind": "NetworkEndpointGroup", "project": "shop", "region": region,
                         "name": neg, "networkEndpointType": "PRIVATE_SERVICE_CONNECT",
                         "pscTargetService": f"projects/big/regions/{region}/serviceAttachments/{svc}"})  # fmt: skip
        docs += [
            {"kind": "BackendService", "project": "shop", "name": name, "protocol": "HTTP",
             "loadBalancingScheme": "EXTERNAL_MANAGED", "backends": negs},
            {"kind": "ForwardingRule", "project": "shop", "name": name,
             "IPAddress": f"10.9.{f // 250}.{f % 250 + 1}", "portRange": "80",
             "loadBalancingScheme": "EXTERNAL_MANAGED", "backendService": f"backendServices/{name}",
             "dataPlaneRegion": "us-east1"},
        ]  # fmt: skip
    return docs


@pytest.mark.serial  # (a load time: alone on the machine, tests/conftest.py)
def test_a_project_of_500_front_ends_and_50000_endpoints_opens_within_2_s(tmp_path: Path) -> None:
    manifest = tmp_path / "big.yaml"
    manifest.write_text(yaml.safe_dump_all(big_world()))
    serve = ServeProcess(tmp_path / "big.db", "-f", str(manifest), "--no-dataplane",
                         "--allow-addresses", "10.0.0.0/8").start(wait=False)  # fmt: skip
    try:
        serve.wait_ready(120)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(serve.url + "/")  # (warm: the browser's own start-up is not the page's)
            expect(page.locator(".frontend")).to_have_count(10, timeout=30_000)
            started = time.monotonic()
            page.reload()
            expect(page.locator(".frontend")).to_have_count(10, timeout=10_000)
            wait_for(
                lambda: page.evaluate(
                    "() => Object.values(window.healthgateCharts).filter(c => c.loaded).length"
                ) >= 10
                and page.locator(".strip[data-endpoints='counted']").count() >= 20,
                10, 0.02, "the first page's charts and strips",
            )  # fmt: skip
            opened = time.monotonic() - started
            print(f"\n500 front ends, 50,000 endpoints: the first page opened in {opened:.2f} s")
            assert opened < 2.0, opened
            expect(page.locator(".pager")).to_contain_text("of 500")
            # a search narrows it at once
            began = time.monotonic()
            page.locator("#search").fill("front-49")
            expect(page.locator(".frontend")).to_have_count(10, timeout=5_000)  # 490-499
            expect(page.locator(".frontend").first).to_have_attribute("data-frontend", "front-490")
            print(f"search answered in {time.monotonic() - began:.2f} s (with its 250 ms pause)")
            page.screenshot(path=str(ARTIFACTS / "dashboard-500.png"))
            browser.close()
    finally:
        serve.stop()
