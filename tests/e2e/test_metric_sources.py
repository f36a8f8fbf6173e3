"""Metrics as health end to end (SPEC §10): a real Prometheus (Debian's)
scrapes a test exporter of ``error_ratio`` every second; us-east1's
composite has a METRIC source on it. The ratio crossing its threshold fails
the region over, the reason naming the value; back under it, traffic comes
back; Prometheus gone, the source follows insufficientData and says so.
The answer parser's cases (bounded, malformed, many series) are tabled in
tests/integration/test_metric_values.py."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.test_failover import Stack
from tests.integration.serve_proc import wait_for
from tests.integration.servers import free_port

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="Prometheus is not installed: apt-get install prometheus (make test does)",
)
SOURCE = "/v1/projects/shop/regions/us-east1/healthSources/slo"


class Exporter:
    """``error_ratio VALUE`` at /metrics, the value set by the test."""

    def __init__(self) -> None:
        self.value = 0.01
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = f"# TYPE error_ratio gauge\nerror_ratio {exporter.value}\n".encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Exporter:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def prometheus(tmp: Path, target: int) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": "app", "static_configs": [{"targets": [f"127.0.0.1:{target}"]}]}
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    assert PROMETHEUS is not None
    with open(tmp / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def answers(port: int, query: str) -> bool:
    try:
        resp = httpx.get(
            f"http://127.0.0.1:{port}/api/v1/query", params={"query": query}, timeout=2
        )
    except httpx.HTTPError:
        return False
    return resp.status_code == 200 and bool(resp.json()["data"]["result"])


def metric_world(st: Stack, prom_port: int) -> list[dict[str, Any]]:
    world = st.world()
    slo = {
        "kind": "HealthSource", "name": "slo", "project": "shop", "region": "us-east1",
        "sourceType": "METRIC", "sources": ["backendServices/web"],
        "metric": {"prometheusUrl": f"http://127.0.0.1:{prom_port}", "query": "error_ratio",
                   "unhealthyAbove": 0.05, "intervalSec": 1},
    }  # fmt: skip
    for d in world:
        if d["kind"] == "CompositeHealthCheck" and d["region"] == "us-east1":
            d["healthSources"] = [*d["healthSources"], "healthSources/slo"]
    return [slo, *world]


def source(st: Stack) -> dict[str, Any]:
    return dict(st.api.get(SOURCE).json()["status"])


def test_a_metric_over_its_threshold_fails_a_region_over(tmp_path: Path) -> None:
    with Exporter() as exporter, prometheus(tmp_path, exporter.port) as (prom_port, prom):
        wait_for(lambda: answers(prom_port, "error_ratio"), 30, what="prometheus has the metric")
        with Stack(tmp_path) as st:
            st.apply(metric_world(st, prom_port))
            wait_for(lambda: source(st)["healthState"] == "HEALTHY", 10, what="the source HEALTHY")
            assert source(st)["reason"] == "error_ratio 0.01 <= 0.05 (unhealthyAbove)"
            assert st.routed_region() == "us-east1"

            exporter.value = 0.071
            wait_for(lambda: st.routed_region() == "europe-west1", 15, what="failed over")
            assert source(st)["reason"] == "error_ratio 0.071 > 0.05 (unhealthyAbove)"
            events = st.api.get(
                "/v1/projects/shop/events", params={"kind": "HealthSource", "state": "UNHEALTHY"}
            ).json()["items"]
            assert any("error_ratio 0.071 > 0.05" in e["reason"] for e in events), events

            exporter.value = 0.02
            wait_for(lambda: st.routed_region() == "us-east1", 15, what="back")

            # Prometheus gone: LAST_KNOWN (the default) keeps HEALTHY, and says why
            prom.kill()
            prom.wait(timeout=15)
            wait_for(lambda: "unreachable" in source(st)["reason"], 10, what="no data said")
            status = source(st)
            assert status["healthState"] == "HEALTHY", status
            assert "last known kept (insufficientData LAST_KNOWN)" in status["reason"]
            # ... and insufficientData UNHEALTHY fails the region over
            world = metric_world(st, prom_port)
            world[0]["metric"]["insufficientData"] = "UNHEALTHY"
            st.apply(world)
            wait_for(lambda: st.routed_region() == "europe-west1", 15, what="no data: failed over")
            assert "(insufficientData UNHEALTHY)" in source(st)["reason"]
