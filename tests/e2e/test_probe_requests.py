"""SPEC §10 end to end: a region whose health endpoint wants a token, the
token a write-only Secret. Real serve (in process and with probe workers),
real backends that answer 401 without the right header: rotating the
secret to a wrong value fails the region over without a restart, back
again when it is right; the value is never read back, logged or recorded,
and a secret in use cannot be deleted."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_failover import Stack
from tests.integration.serve_proc import wait_for

SECRET = "/v1/projects/shop/regions/us-east1/secrets/api-token"
CHECK = "/v1/projects/shop/regions/us-east1/healthChecks/http-8080"
US_HEALTH = "/v1/projects/shop/regions/us-east1/backendServices/web/health"
RIGHT, WRONG = "Bearer 3q2-right-7w", "Bearer 3q2-wrong-7w"


def token_world(st: Stack) -> list[dict[str, Any]]:
    world = st.world()
    for d in world:
        if d["kind"] == "HealthCheck" and d["region"] == "us-east1":
            d["requestPath"] = "/healthz"  # (the clients' requests go to /)
            d["requestHeaders"] = [
                {"name": "Authorization", "valueFrom": {"secret": "api-token"}},
                {"name": "X-Prober", "value": "healthgate"},
            ]
    secret = {"kind": "Secret", "name": "api-token", "project": "shop", "region": "us-east1"}
    return [{**secret, "value": RIGHT}, *world]


def put_secret(st: Stack, value: str) -> None:
    doc = {"kind": "Secret", "name": "api-token", "project": "shop", "region": "us-east1"}
    resp = st.api.put(SECRET, json={**doc, "value": value})
    assert resp.is_success, resp.text


@pytest.mark.parametrize("workers", ["0", "2"], ids=["in process", "probe workers"])
def test_a_token_from_a_secret_rotated_without_a_restart(tmp_path: Path, workers: str) -> None:
    with Stack(tmp_path, "--probe-workers", workers) as st:
        st.backends.backends.required["us-east1"] = (
            b"GET /healthz ",
            f"\r\nAuthorization: {RIGHT}\r\n".encode(),
        )
        st.apply(token_world(st))
        wait_for(lambda: st.neg_state("us-east1") == "HEALTHY", 15, what="us-east1 HEALTHY")
        assert st.routed_region() == "us-east1"

        # written, never read back
        got = st.api.get(SECRET).json()
        assert "value" not in got and got["valueSet"] is True, got
        listed = st.api.get("/v1/projects/shop/regions/us-east1/secrets").json()["items"]
        assert [s.get("value") for s in listed] == [None]
        header = st.api.get(CHECK).json()["requestHeaders"][0]
        assert header == {"name": "Authorization", "valueFrom": {"secret": "api-token"}}
        # a value that would smuggle a header: 400 naming the field, nothing changed
        doc = st.api.get(CHECK).json()
        bad = {k: v for k, v in doc.items() if k not in ("selfLink", "fingerprint", "status")}
        bad = {k: v for k, v in bad.items() if not k.endswith("Timestamp")}
        bad["requestHeaders"] = [{"name": "X-A", "value": "1\r\nX-Evil: 1"}]
        answer = st.api.put(CHECK, json=bad)
        assert answer.status_code == 400 and "requestHeaders[0].value" in answer.text, answer.text
        assert st.api.get(CHECK).json()["fingerprint"] == doc["fingerprint"]
        # in use: not deleted
        refused = st.api.delete(SECRET)
        assert refused.status_code == 409 and "healthChecks/http-8080" in refused.text, refused.text

        # rotated to a wrong value: the next probes carry it, the region fails over
        put_secret(st, WRONG)
        wait_for(lambda: st.neg_state("us-east1") == "UNHEALTHY", 15, what="us-east1 UNHEALTHY")
        wait_for(lambda: st.routed_region() == "europe-west1", 10, what="traffic leaves")
        # (the NEG turns when enough endpoints have; the others may be a probe behind)
        statuses = st.api.get(US_HEALTH).json()["healthStatus"]
        down = [s["reason"] for s in statuses if s["healthState"] == "UNHEALTHY"]
        assert down and all("HTTP 401" in reason for reason in down), statuses
        put_secret(st, RIGHT)
        wait_for(lambda: st.neg_state("us-east1") == "HEALTHY", 15, what="us-east1 back")
        wait_for(lambda: st.routed_region() == "us-east1", 10, what="traffic back")

        # the Change records say a secret changed, never what to
        events = st.api.get("/v1/projects/shop/events", params={"kind": "Change"}).json()
        text = str(events)
        assert "secrets/api-token" in text and "(secret)" in text, text[:2000]
        for shown in (text, st.api.get("/metrics").text, st.proc.log.read_text()):
            assert RIGHT not in shown and WRONG not in shown
        assert stat.S_IMODE(os.stat(tmp_path / "e2e.db").st_mode) == 0o600
