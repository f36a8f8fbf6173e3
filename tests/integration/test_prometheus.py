"""Prometheus for real (Debian's ``prometheus``, with ``promtool``): the
shipped alerting rules check and pass their unit tests, /metrics passes
Prometheus's own linter in the text format (and the strict OpenMetrics
parser in that one), with and without probe workers, and a real Prometheus
scraping a real serve with a metrics token answers queries and loads the
alerts - one of them pending within seconds, as the example's endpoints
refuse."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from tests.helpers import EXAMPLE
from tests.integration.serve_proc import ServeProcess, wait_for
from tests.integration.servers import free_port

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMTOOL is None or PROMETHEUS is None,
    reason="Prometheus is not installed: apt-get install prometheus (make test does)",
)
METRICS = {"token": "m" * 32, "project": "*", "role": "metrics"}


def promtool(*args: str, stdin: str | None = None, cwd: Path | None = None) -> str:
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, *args], input=stdin, capture_output=True, text=True, timeout=120,
        cwd=cwd, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_the_shipped_rules_check_and_pass_their_unit_tests() -> None:
    assert "SUCCESS: 11 rules found" in promtool(
        "check", "rules", "healthgate-alerts.yml", cwd=DEPLOY
    )
    assert "SUCCESS" in promtool("test", "rules", "healthgate-alerts.test.yml", cwd=DEPLOY)


def test_the_shipped_scrape_config_checks(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(METRICS["token"])
    config = (DEPLOY / "prometheus.yml").read_text()
    config = config.replace("/etc/prometheus/healthgate-metrics-token", str(token))
    (tmp_path / "prometheus.yml").write_text(config)
    shutil.copy(DEPLOY / "healthgate-alerts.yml", tmp_path)
    assert "is valid prometheus config" in promtool(
        "check", "config", str(tmp_path / "prometheus.yml")
    )


@pytest.mark.parametrize("workers", ["0", "2"])
def test_metrics_pass_the_linters_in_both_formats(tmp_path: Path, workers: str) -> None:
    with ServeProcess(
        tmp_path / "s.db", "-f", str(EXAMPLE), "--no-dataplane", "--probe-workers", workers
    ) as serve:
        wait_for(lambda: b"healthgate_probes_started_total" in httpx.get(
            serve.url + "/metrics").content, 10)  # fmt: skip
        time.sleep(1.5)  # (a round of probes: the histograms have samples)
        text = httpx.get(serve.url + "/metrics").text
        assert "healthgate_route_failed_over" in text
        promtool("check", "metrics", stdin=text)  # no problem reported
        om = httpx.get(
            serve.url + "/metrics", headers={"Accept": "application/openmetrics-text"}
        ).text
        families = list(text_string_to_metric_families(om))  # type: ignore[no-untyped-call]
        names = {f.name for f in families}
        assert {"healthgate_probes_started", "healthgate_route_info"} <= names
        assert all(f.documentation for f in families), [
            f.name for f in families if not f.documentation
        ]


def test_a_real_prometheus_scrapes_serve_and_loads_the_alerts(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(yaml.safe_dump([METRICS]))
    tokens.chmod(0o600)
    token_file = tmp_path / "metrics-token"
    token_file.write_text(METRICS["token"])
    with ServeProcess(
        tmp_path / "s.db", "-f", str(EXAMPLE), "--no-dataplane", "--tokens", str(tokens),
        "--allow-addresses", "127.0.0.0/8",
    ) as serve:  # fmt: skip
        config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        job = config["scrape_configs"][0]
        job["authorization"]["credentials_file"] = str(token_file)
        job["static_configs"] = [{"targets": [f"127.0.0.1:{serve.port}"]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        shutil.copy(DEPLOY / "healthgate-alerts.yml", tmp_path)
        port = free_port()
        assert PROMETHEUS is not None
        with open(tmp_path / "prometheus.log", "wb") as log:
            prom = subprocess.Popen(
                [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        api = f"http://127.0.0.1:{port}/api/v1"
        try:

            def query(q: str) -> list[dict[str, object]]:
                try:
                    resp = httpx.get(f"{api}/query", params={"query": q}, timeout=2)
                except httpx.HTTPError:
                    return []
                if resp.status_code != 200:  # (starting up: 503 "Service Unavailable", as text)
                    return []
                body = resp.json()
                result: list[dict[str, object]] = body.get("data", {}).get("result", [])
                return result

            up = wait_for(lambda: query('up{job="healthgate"} == 1'), 30, what="a scrape")
            assert up
            routes = wait_for(lambda: query("healthgate_route_info"), 10, what="a route")
            assert str(routes[0]["metric"]).find("/shop-frontend") > 0
            rules = httpx.get(f"{api}/rules", timeout=5).json()["data"]["groups"]
            assert sum(len(g["rules"]) for g in rules) == 11  # (docs/operations.md lists them)
            # the example's endpoints refuse: its composites turn UNHEALTHY,
            # and the region alert is pending within seconds (it fires after a minute)
            wait_for(
                lambda: any(
                    a["labels"]["alertname"] == "HealthgateRegionUnhealthy"
                    for a in httpx.get(f"{api}/alerts", timeout=2).json()["data"]["alerts"]
                ),
                30,
                what="HealthgateRegionUnhealthy pending",
            )
        finally:
            prom.terminate()
            prom.wait(30)
