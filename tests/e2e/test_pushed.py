"""Pushed health end to end (SPEC §10, Consul's TTL checks): us-east1's
backend service has a ``type: PUSH`` check; its endpoints' states are what
a client reports (the library, the CLI, the API under the project's roles),
and an endpoint whose report runs out is UNHEALTHY - the region fails over
to europe-west1 and comes back when reported again. Reports survive a
restart (kill -9) within their TTL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from healthgate.client import Client, HealthgateError
from tests.e2e.harness import Backends, e2e_world, ports
from tests.integration.serve_proc import ServeProcess, wait_for

TOKENS = {
    "admin": ("a" * 24, "*"),
    "producer": ("p" * 24, "shop"),
    "stranger": ("s" * 24, "elsewhere"),  # a producer of another project
    "viewer": ("v" * 24, "shop"),
}
US = "us-east1"
HEALTH = f"/v1/projects/shop/regions/{US}/backendServices/web/health"
REPORT = f"/v1/projects/shop/regions/{US}/backendServices/web/endpoints:report"
FRONT = "/v1/projects/web/global/forwardingRules/shop-frontend"
TTL = 6


def push_world(port: int, front: int, prod: tuple[int, int]) -> list[dict[str, Any]]:
    world = e2e_world(port, front, prod)
    for d in world:
        if d["kind"] == "HealthCheck" and d["region"] == US:
            for k in ("port", "requestPath", "timeoutSec", "checkIntervalSec"):
                d.pop(k, None)
            d.update(type="PUSH", ttlSec=TTL)
    return world


def routed(api: Any) -> str | None:
    target = api.get(FRONT).json()["status"]["route"]["target"]
    return None if target is None else ("us" if target.endswith("/shop-us") else "eu")


def states(api: Any) -> dict[str, str]:
    return {f"{e['ipAddress']}:{e['port']}": e["healthState"]
            for e in api.get(HEALTH).json()["healthStatus"]}  # fmt: skip


def test_reports_decide_a_region_and_its_ttl_fails_it_over(tmp_path: Path) -> None:
    port, front, prod = ports()
    tokens = tmp_path / "tokens.yaml"
    roles = {"stranger": "producer"}  # (a producer, of another project)
    rows = [{"token": t, "project": p, "role": roles.get(r, r)} for r, (t, p) in TOKENS.items()]
    tokens.write_text(yaml.safe_dump(rows))
    args = ("--tokens", str(tokens), "--allow-addresses", "127.0.0.0/8")
    with Backends(port), ServeProcess(tmp_path / "hg.db", *args) as proc:
        admin = proc.client(TOKENS["admin"][0])
        manifest = yaml.safe_dump_all(push_world(port, front, prod))
        admin.post("/v1/apply", json={"manifest": manifest}).raise_for_status()
        eps = sorted(states(admin))
        assert set(states(admin).values()) == {"UNKNOWN"}  # nothing probed, nothing reported

        lib = Client(proc.url, token=TOKENS["producer"][0])
        for ep in eps:
            out = lib.report("shop", US, "web", ep, "HEALTHY", note="batch 7 ok")
            assert out["healthState"] == "HEALTHY", out
        wait_for(lambda: routed(admin) == "us", 10, what="traffic in us-east1")
        reason = admin.get(HEALTH).json()["healthStatus"][0]["reason"]
        assert "reported HEALTHY" in reason and "batch 7 ok" in reason, reason

        # the roles: another project's producer, a viewer; and bad reports
        for who, code in (("stranger", 403), ("viewer", 403)):
            with proc.client(TOKENS[who][0]) as c:
                refused = {"endpoint": eps[0], "state": "UNHEALTHY"}
                assert c.post(REPORT, json=refused).status_code == code, who
        with proc.client(TOKENS["producer"][0]) as c:
            for body, field in (
                ({"endpoint": eps[0], "state": "SORT_OF"}, "state"),
                ({"endpoint": "127.9.9.9:1", "state": "HEALTHY"}, "endpoint"),
                ({"endpoint": eps[0], "state": "HEALTHY", "note": "a\nb"}, "note"),
                ({"endpoint": eps[0], "state": "HEALTHY", "extra": 1}, "extra"),
            ):
                answer = c.post(REPORT, json=body)
                assert answer.status_code == 400 and field in answer.text, (body, answer.text)
            probed = "/v1/projects/shop/regions/europe-west1/backendServices/web/endpoints:report"
            answer = c.post(probed, json={"endpoint": "127.0.2.1:1", "state": "HEALTHY"})
            assert answer.status_code == 400 and "not a PUSH check" in answer.text
        try:
            Client(proc.url, token=TOKENS["stranger"][0]).report(
                "shop", US, "web", eps[0], "HEALTHY"
            )
            raise AssertionError("a stranger's report was taken")
        except HealthgateError as exc:
            assert exc.code == 403

        forged = {"kind": "EndpointReport", "name": "r-0", "project": "shop", "region": US,
                  "backendService": "web", "endpoint": eps[0], "state": "HEALTHY",
                  "time": 4e9, "actor": "me"}  # fmt: skip
        answer = admin.post("/v1/apply", json={"manifest": yaml.safe_dump(forged)})
        assert answer.status_code == 400 and "endpoints:report" in answer.text, answer.text

        # the CLI: one endpoint UNHEALTHY at once (a report is a verdict)
        token_file = tmp_path / "producer.token"
        token_file.write_text(TOKENS["producer"][0])
        token_file.chmod(0o600)
        cli = subprocess.run(
            [sys.executable, "-m", "healthgate", "report", "web", eps[0], "UNHEALTHY",
             "--note", "disk full", "--server", proc.url, "--project", "shop",
             "--region", US, "--token-file", str(token_file)],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        assert f"{eps[0]}: UNHEALTHY" in cli.stdout
        assert states(admin)[eps[0]] == "UNHEALTHY"

        # a restart within the TTL: every report stands
        proc.kill()
        proc.start()
        assert states(admin)[eps[0]] == "UNHEALTHY"
        assert [states(admin)[e] for e in eps[1:]] == ["HEALTHY"] * 3

        # no more reports: the TTL runs out, the region fails over
        wait_for(lambda: set(states(admin).values()) == {"UNHEALTHY"}, TTL + 10,
                 what="every report run out")  # fmt: skip
        reason = admin.get(HEALTH).json()["healthStatus"][1]["reason"]
        assert "no report since" in reason and f"(ttlSec {TTL})" in reason, reason
        wait_for(lambda: routed(admin) == "eu", 10, what="traffic leaves us-east1")
        for ep in eps:
            lib.report("shop", US, "web", ep, "HEALTHY")
        wait_for(lambda: routed(admin) == "us", 10, what="traffic back")
        events = admin.get("/v1/projects/shop/events", params={"kind": "Endpoint"}).json()
        assert any("no report since" in e["reason"] for e in events["items"])
        lib.close()
        admin.close()
