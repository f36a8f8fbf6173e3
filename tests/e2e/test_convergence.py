"""Convergence receipts for real (SPEC §11): one serve with its own front
end and data-plane workers, a real Envoy on its ADS, a real HAProxy on its
agent, and ``dig`` asking its DNS server. A region breaks: the front end's
GET shows each data plane's receipt of the decision, in milliseconds. Then
HAProxy and Envoy are killed and the region heals: the next decision is
applied by healthgate's listeners and DNS, and the two dead ones are
LAGGING - a record each, the metric, and the front end's GET saying who has
not applied it."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_dns import NAME, dig
from tests.e2e.test_envoy import ENVOY, Envoy
from tests.e2e.test_failover import FRONT, Stack
from tests.e2e.test_haproxy import HAProxy
from tests.helpers import run_cli
from tests.integration.serve_proc import wait_for
from tests.integration.servers import free_port

pytestmark = pytest.mark.skipif(
    not (Path(ENVOY).exists() and shutil.which("haproxy") and shutil.which("dig")),
    reason="needs envoy (a test extra), Debian's haproxy and dig (make test installs them)",
)

ALERT = 3  # --convergence-alert-sec


def receipts(st: Stack) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    status = st.api.get(FRONT).json()["status"]
    return status.get("decision", {}), status.get("convergence", [])


def applied(st: Stack) -> dict[str, float]:
    """``data plane/instance`` -> appliedAfterMs, for the last decision."""
    _, got = receipts(st)
    return {
        f"{r['dataPlane']}/{r['instance']}": r["appliedAfterMs"]
        for r in got
        if r["appliedAfterMs"] is not None
    }


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Stack, HAProxy, Envoy, int]]:
    agent, dns, xds = free_port(), free_port(), free_port()
    serve = ("--agent", f"127.0.0.1:{agent}", "--dns", f"127.0.0.1:{dns}",
             "--xds", f"127.0.0.1:{xds}", "--dataplane-workers", "2",
             "--convergence-alert-sec", str(ALERT))  # fmt: skip
    with Stack(tmp_path, *serve) as st:
        world = st.world()
        for d in world:
            if d["kind"] == "ForwardingRule" and d["project"] == "web":
                d.update(dnsName=NAME + ".", dnsTtlSec=1)
        st.apply(world)
        section = st.api.get(  # (this HAProxy names itself in its agent checks)
            "/v1/projects/web/global/forwardingRules/shop-frontend/haproxy?instance=edge-1"
        ).text
        assert 'agent-send "web/us-east1/shop-us edge-1\\n"' in section, section
        with HAProxy(tmp_path, section) as hp, Envoy(tmp_path, xds) as envoy:
            wait_for(lambda: hp.servers() == {"shop-us": "UP", "shop-eu": "UP"}, 10, what="UP")
            wait_for(lambda: envoy.region_served() == "us-east1", 20, what="Envoy routes")
            yield st, hp, envoy, dns


def test_every_data_plane_reports_applying_a_decision_and_the_dead_ones_lag(
    stack: tuple[Stack, HAProxy, Envoy, int],
) -> None:
    st, hp, envoy, dns = stack
    st.backends.set_mode("us-east1", "refuse")
    wait_for(lambda: st.routed_region() == "europe-west1", 15, what="failover")
    # DNS applies at its first answer after the decision
    wait_for(lambda: dig(dns, NAME)[1] != [], 5, what="a DNS answer")
    want = {"healthgate/serve/worker-0", "healthgate/serve/worker-1", "dns/serve", "envoy/"}
    want_haproxy = "haproxy/"

    def everyone() -> bool:
        got = applied(st)
        return (
            {k for k in got if not k.startswith(("envoy/", "haproxy/"))} >= want - {"envoy/"}
            and any(k.startswith("envoy/") for k in got)
            and any(k.startswith(want_haproxy) for k in got)
        )

    wait_for(everyone, 10, what="a receipt from every data plane")
    decision, got = receipts(st)
    assert decision["decision"] == "shop-us -> shop-eu" and decision["generation"] >= 1, decision
    by = applied(st)
    print("\nreceipts (ms after the decision): " + ", ".join(f"{k} {v:.1f}" for k, v in by.items()))
    assert by["healthgate/serve/worker-0"] < 500 and by["healthgate/serve/worker-1"] < 500
    envoy_ms = next(v for k, v in by.items() if k.startswith("envoy/"))
    assert envoy_ms < 2000, by
    assert by["haproxy/edge-1"] < 2500, by  # (agent-inter 1 s for each of its two servers)
    events = st.api.get("/v1/projects/web/events", params={"kind": "Route"}).json()["items"]
    assert events[-1]["generation"] == decision["generation"]

    # HAProxy and Envoy die; the region heals: the next decision is theirs to lag on
    hp.__exit__(None, None, None)
    envoy.__exit__(None, None, None)
    st.backends.set_mode("us-east1", "ok")
    wait_for(lambda: st.routed_region() == "us-east1", 20, what="failback")
    dig(dns, NAME)
    healed = time.time()

    def lagging() -> list[dict[str, Any]]:
        items = st.api.get("/v1/projects/web/events", params={"kind": "Convergence"}).json()
        return [e for e in items["items"] if e["to"] == "LAGGING"]

    wait_for(lambda: len(lagging()) == 2, ALERT + 5, what="Envoy and HAProxy LAGGING")
    records = lagging()
    assert {r["dataPlane"] for r in records} == {"envoy", "haproxy"}, records
    assert all(r["time"] - healed >= ALERT - 1.5 for r in records), records
    assert all("has not applied the decision" in r["reason"] for r in records)
    decision, got = receipts(st)
    pending = {r["dataPlane"] for r in got if r["appliedAfterMs"] is None}
    assert pending == {"envoy", "haproxy"}, got
    assert {"healthgate/serve/worker-0", "dns/serve"} <= set(applied(st))
    metrics = st.api.get("/metrics").text
    assert 'healthgate_convergence_lagging{data_plane="envoy"} 1.0' in metrics
    assert 'healthgate_convergence_lagging{data_plane="haproxy"} 1.0' in metrics
    assert 'healthgate_convergence_seconds_count{data_plane="healthgate"}' in metrics
    # describe says the same
    server = ("--server", st.proc.url, "--project", "web")
    out = run_cli("describe", "fr", "shop-frontend", *server)
    assert out.returncode == 0 and "(shop-eu -> shop-us):" in out.stdout, out.stdout[-2000:]
    assert "applied by healthgate serve/worker-0 after" in out.stdout
    assert "NOT applied by envoy" in out.stdout and "NOT applied by haproxy edge-1" in out.stdout
