"""responseContains and invert end to end: a real serve probing real region
backends, the endpoint states and their reasons through the API - and a
region failed over by the text its backends answer, then back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.e2e.harness import Backends, e2e_world, ports
from tests.integration.serve_proc import ServeProcess, wait_for

HEALTH = "/v1/projects/shop/regions/{}/backendServices/web/health"


def checks(world: list[dict[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    return [
        {**d, **fields} if d["kind"] == "HealthCheck" and d["region"] == "us-east1" else d
        for d in world
    ]


def states(serve: ServeProcess, region: str) -> list[tuple[str, str]]:
    with serve.client() as api:
        body = api.get(HEALTH.format(region)).json()
    return [(e["healthState"], e["reason"]) for e in body["healthStatus"]]


def all_in(serve: ServeProcess, region: str, state: str) -> bool:
    got = states(serve, region)
    return bool(got) and all(s == state for s, _ in got)


def test_a_region_fails_over_on_what_its_backends_say_and_back(tmp_path: Path) -> None:
    backend, front, producer = ports()
    world = e2e_world(backend, front, producer)
    manifest = tmp_path / "w.yaml"
    with Backends(backend):
        # the backends answer "region=us-east1 endpoint=...": the text is there
        manifest.write_text(yaml.safe_dump_all(checks(world, responseContains="region=us-east1")))
        with ServeProcess(tmp_path / "s.db", "-f", str(manifest)) as serve, serve.client() as api:
            wait_for(lambda: all_in(serve, "us-east1", "HEALTHY"), 15, what="us-east1 HEALTHY")
            # a deploy that answers 200 with the wrong content: only the body can tell
            changed = checks(world, responseContains="status=ready")
            assert api.post("/v1/apply", json={"manifest": yaml.safe_dump_all(changed)}).is_success
            wait_for(lambda: all_in(serve, "us-east1", "UNHEALTHY"), 15, what="us-east1 down")
            reason = states(serve, "us-east1")[0][1]
            assert "'status=ready' not in the first 5,120 bytes of the body" in reason
            rule = api.get("/v1/projects/web/global/forwardingRules/shop-frontend").json()
            assert str(rule["status"]["route"]["target"]).endswith("/shop-eu")
            back = checks(world, responseContains="endpoint=")
            assert api.post("/v1/apply", json={"manifest": yaml.safe_dump_all(back)}).is_success
            wait_for(lambda: all_in(serve, "us-east1", "HEALTHY"), 15, what="us-east1 back")


def test_an_inverted_check_is_healthy_while_the_page_is_not_up(tmp_path: Path) -> None:
    backend, front, producer = ports()
    world = e2e_world(backend, front, producer)
    manifest = tmp_path / "w.yaml"
    # "healthy while the maintenance page is NOT up": the backends answer 200
    # to everything, so an inverted check of them is UNHEALTHY ...
    manifest.write_text(yaml.safe_dump_all(checks(world, invert=True)))
    with (
        Backends(backend) as backends,
        ServeProcess(tmp_path / "s.db", "-f", str(manifest)) as serve,
    ):
        wait_for(lambda: all_in(serve, "us-east1", "UNHEALTHY"), 15, what="inverted: down")
        assert "the check is inverted" in states(serve, "us-east1")[0][1]
        # ... and HEALTHY once they stop answering
        backends.set_mode("us-east1", "refuse")
        wait_for(lambda: all_in(serve, "us-east1", "HEALTHY"), 15, what="inverted: up")
        assert "inverted: connection refused" in states(serve, "us-east1")[0][1]
