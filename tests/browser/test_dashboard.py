"""The dashboard in headless Chromium: see the topology, break a region with its
button, watch the front end's route change and the transition reach the timeline."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import httpx
from playwright.sync_api import expect, sync_playwright

from tests.browser.demo import running_demo
from tests.helpers import ROOT
from tests.integration.serve_proc import wait_for

ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def test_dashboard_shows_a_failover(tmp_path: Path) -> None:
    assert Path(CHROMIUM).exists(), (
        "Debian's chromium is needed: make test installs it (apt-get install chromium)"
    )
    ARTIFACTS.mkdir(exist_ok=True)
    with running_demo(tmp_path) as demo:
        api, front = demo.url.rsplit(":", 1)[1], demo.front
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"http://127.0.0.1:{api}/")
            route = page.locator("#route-shop-frontend")
            expect(route).to_have_text("shop-us-east1", timeout=20_000)
            expect(page.locator('.card[data-region="us-east1"] .badge').first).to_have_text(
                "HEALTHY", timeout=20_000
            )
            page.locator('.card[data-region="us-east1"] button[data-mode="refuse"]').click()
            expect(route).to_have_text("shop-asia-east1", timeout=15_000)
            timeline = page.locator("#timeline")
            expect(timeline).to_contain_text("Route", timeout=10_000)
            expect(timeline).to_contain_text("failing over to shop-asia-east1")
            expect(page.locator('.card[data-region="us-east1"]').first).to_have_class(
                "card UNHEALTHY"
            )
            page.screenshot(path=str(ARTIFACTS / "dashboard-failover.png"), full_page=True)
            # every region down: FAIL_OPEN, and it looks alarming
            for region in ("asia-east1", "europe-west1"):
                page.locator(f'.card[data-region="{region}"] button[data-mode="refuse"]').click()
            banner = page.locator(".frontend.alarm .banner")
            expect(banner).to_contain_text("every region is UNHEALTHY", timeout=15_000)
            expect(banner).to_contain_text("FAIL_OPEN keeps sending to shop-us-east1")
            page.screenshot(path=str(ARTIFACTS / "dashboard-all-down.png"), full_page=True)
            for region in ("us-east1", "asia-east1", "europe-west1"):
                page.locator(f'.card[data-region="{region}"] button[data-mode="heal"]').click()
            expect(route).to_have_text("shop-us-east1", timeout=15_000)
            expect(page.locator(".frontend.alarm")).to_have_count(0, timeout=15_000)
            # a shift: shown with its time left, traffic moves, "End now" brings it back
            # (once the other regions are HEALTHY again: else the safety rule refuses it)
            for region in ("asia-east1", "europe-west1"):
                expect(page.locator(f'.card[data-region="{region}"]').first).to_have_class(
                    "card HEALTHY", timeout=15_000
                )
            shift = httpx.post(
                f"http://127.0.0.1:{api}/v1/projects/web/shifts",
                json={"awayFrom": "us-east1", "expiresInSec": 7200, "comment": "bad deploy"},
                timeout=5,
            )
            assert shift.status_code == 201, shift.text
            panel = page.locator("#shifts .shift")
            expect(panel).to_contain_text("away from us-east1", timeout=10_000)
            expect(panel).to_contain_text("bad deploy")
            expect(panel.locator(".left")).to_contain_text("1 h 59 min")
            expect(route).not_to_have_text("shop-us-east1", timeout=10_000)
            page.screenshot(path=str(ARTIFACTS / "dashboard-shift.png"), full_page=True)
            panel.locator("button[data-end]").click()
            expect(panel).to_have_count(0, timeout=10_000)
            expect(route).to_have_text("shop-us-east1", timeout=10_000)
            expect(timeline).to_contain_text("shift-end")
            # a dialled route: the split drawn as one stacked bar
            bs_url = f"http://127.0.0.1:{api}/v1/projects/web/global/backendServices/shop"
            bs = httpx.get(bs_url, timeout=5).json()
            body = {k: v for k, v in bs.items() if k not in ("selfLink", "status")}
            body["backends"][0]["trafficDial"] = 70
            assert httpx.put(bs_url, json=body, timeout=5).is_success
            bar = page.locator(".frontend .split .share")
            expect(bar).to_have_count(2, timeout=10_000)
            expect(bar.first).to_contain_text("70% us-east1")
            # and under it, the split the front end measured while requests flow
            done = threading.Event()

            def load() -> None:
                with httpx.Client(timeout=5) as client:
                    while not done.is_set():
                        client.get(f"http://127.0.0.1:{front}/")

            loader = threading.Thread(target=load, daemon=True)
            loader.start()
            measured = page.locator(".frontend .measured")

            def busy() -> str | None:
                # (the demo's own load is a few requests a second: wait for ours)
                text = measured.inner_text() if measured.count() else ""
                rate = float(text.rsplit("(", 1)[1].split()[0]) if "req/s" in text else 0.0
                return text if rate >= 50 else None

            readings: list[str] = []

            def five() -> bool:
                # (each refresh measures ~100 requests drawn at 70 %: one reading's
                # spread is ~4.5 points, five readings' mean ~2)
                text = busy()
                if text is not None and (not readings or readings[-1] != text):
                    readings.append(text)
                return len(readings) >= 5

            try:
                wait_for(five, 30, 0.2, "five readings of the measured split under load")
            finally:
                done.set()
                loader.join(10)
            print(f"\ndashboard {readings}")
            us = sum(int(t.split("measured: ")[1].split("%")[0]) for t in readings) / len(readings)
            assert 60 <= us <= 80, readings
            page.screenshot(path=str(ARTIFACTS / "dashboard-split.png"), full_page=True)
            body = {k: v for k, v in httpx.get(bs_url, timeout=5).json().items() if k != "status"}
            del body["backends"][0]["trafficDial"]
            assert httpx.put(bs_url, json=body, timeout=5).is_success
            expect(bar).to_have_count(0, timeout=10_000)
            # the timeline is newest first
            times = [
                float(t)
                for t in page.locator("#timeline li").evaluate_all(
                    "items => items.map(li => li.dataset.time)"
                )
            ]
            assert times == sorted(times, reverse=True)
            browser.close()
        assert httpx.get(f"http://127.0.0.1:{front}/", timeout=5).text.startswith("region=us-east1")
