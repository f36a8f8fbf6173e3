"""DEGRADED end to end (SPEC §9): real backends that answer 429, a real serve
whose checks list ``degradedStatusCodes: ["429"]``. The region's endpoints,
source, composite and NEG turn DEGRADED; traffic leaves it for the HEALTHY
region, and comes back to it when nothing HEALTHY is left; the producer's
healthz answers 200 with the state, the agent ``drain`` while no route
sends it traffic; real HAProxy drains it."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.harness import region_at
from tests.e2e.test_failover import Stack
from tests.e2e.test_haproxy import FRONT, HAProxy
from tests.integration.serve_proc import wait_for
from tests.integration.servers import free_port

US_HEALTH = "/v1/projects/shop/regions/us-east1/backendServices/web/health"
US_HEALTHZ = "/v1/projects/shop/regions/us-east1/forwardingRules/{}/healthz"


def degraded_world(st: Stack) -> list[dict[str, Any]]:
    world = st.world()
    for d in world:
        if d["kind"] == "HealthCheck":
            d["degradedStatusCodes"] = ["429"]
    return world


def agent(port: int, neg: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(neg.encode() + b"\n")
        return s.recv(64)


def test_a_region_answering_429_is_degraded_loses_its_traffic_and_keeps_the_last(
    tmp_path: Path,
) -> None:
    agent_port = free_port()
    with Stack(tmp_path, "--agent", f"127.0.0.1:{agent_port}") as st:
        st.apply(degraded_world(st))
        front = f"http://127.0.0.1:{st.front}/"
        assert region_at(front) == "us-east1"
        st.backends.set_mode("us-east1", "429")
        wait_for(lambda: st.neg_state("us-east1") == "DEGRADED", 15, what="us-east1 DEGRADED")
        wait_for(lambda: st.api.get(US_HEALTH).json()["degraded"] == 4, 10, what="all 4 DEGRADED")
        health = st.api.get(US_HEALTH).json()
        assert health["healthy"] == 0, health
        reason = health["healthStatus"][0]["reason"]
        assert "degradedStatusCodes" in reason and "HTTP 429" in reason, reason
        wait_for(lambda: st.routed_region() == "europe-west1", 10, what="traffic leaves")
        route = st.route()
        assert "is DEGRADED: moving to shop-eu" in route["reason"], route
        assert region_at(front) == "europe-west1"
        # the producer's own rule: working, impaired
        rules = st.api.get("/v1/projects/shop/regions/us-east1/forwardingRules").json()["items"]
        healthz = st.api.get(US_HEALTHZ.format(rules[0]["name"]))
        assert healthz.status_code == 200 and healthz.json()["state"] == "DEGRADED", healthz.text
        assert agent(agent_port, "web/us-east1/shop-us") == b"drain\n"
        metrics = st.api.get("/metrics").text
        series = (
            'backend_service="projects/shop/regions/us-east1/backendServices/web",state="DEGRADED"'
        )
        assert series + "} 4.0" in metrics
        events = st.api.get("/v1/projects/shop/events", params={"state": "DEGRADED"}).json()
        kinds = {e["kind"] for e in events["items"]}
        assert kinds >= {"Endpoint", "HealthSource", "CompositeHealthCheck"}, kinds
        events = st.api.get("/v1/projects/web/events", params={"state": "DEGRADED"}).json()
        assert {e["kind"] for e in events["items"]} == {"NetworkEndpointGroup"}

        # nothing HEALTHY left: the degraded region is eligible and takes it back
        st.backends.set_mode("europe-west1", "refuse")
        wait_for(lambda: st.routed_region() == "us-east1", 15, what="back to the degraded one")
        assert agent(agent_port, "web/us-east1/shop-us") == b"up ready\n"
        with httpx.Client(timeout=5) as client:
            answer = client.get(front)
        assert answer.status_code == 429 and "region=us-east1" in answer.text

        # both recover: us-east1 is HEALTHY again and first
        st.backends.set_mode("europe-west1", "ok")
        st.backends.set_mode("us-east1", "ok")
        wait_for(lambda: st.neg_state("us-east1") == "HEALTHY", 15, what="us-east1 HEALTHY")
        wait_for(lambda: st.routed_region() == "us-east1", 10, what="us-east1 first")


def test_haproxy_drains_a_degraded_region(tmp_path: Path) -> None:
    """The agent's ``drain``: HAProxy's own stats show the server DRAIN (no
    new traffic) and requests through HAProxy go to the backup region."""
    agent_port = free_port()
    with Stack(tmp_path, "--agent", f"127.0.0.1:{agent_port}") as st:
        st.apply(degraded_world(st))
        section = st.api.get(f"/v1/projects/web/global/forwardingRules/{FRONT}/haproxy").text
        with HAProxy(tmp_path, section) as hp:
            wait_for(lambda: hp.servers() == {"shop-us": "UP", "shop-eu": "UP"}, 10, what="UP")
            st.backends.set_mode("us-east1", "429")
            wait_for(lambda: hp.statuses().get("shop-us", "").startswith("DRAIN"), 20,
                     what="shop-us DRAIN in HAProxy")  # fmt: skip
            front = f"http://127.0.0.1:{hp.port}/"
            assert {region_at(front) for _ in range(20)} == {"europe-west1"}
            st.backends.set_mode("us-east1", "ok")
            # (an agent-only server's status reads "no check" while up)
            wait_for(lambda: not hp.statuses()["shop-us"].startswith("DRAIN"), 20,
                     what="shop-us out of DRAIN")  # fmt: skip
            assert hp.servers()["shop-us"] == "UP"
            wait_for(lambda: region_at(front) == "us-east1", 10, what="traffic back")
