"""Shifts for real (SPEC §6): a serve with its front end and real region
backends; traffic moves within a second of the POST and back within a
second of the end; the safety rule; who may shift what; a serve restarted
mid-shift obeys it at once; every shift is a Change record."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.harness import Backends, e2e_world, ports, region_at
from tests.integration.serve_proc import ServeProcess, wait_for

CONSUMER = {"token": "w" * 24, "project": "web", "role": "consumer", "name": "wendy"}
PRODUCER = {"token": "s" * 24, "project": "shop", "role": "producer", "name": "sam"}
VIEWER = {"token": "v" * 24, "project": "web", "role": "viewer", "name": "vic"}
ADMIN = {"token": "a" * 24, "project": "*", "role": "admin", "name": "root"}
FRONT = "/v1/projects/web/global/forwardingRules/shop-frontend"
US_NEG = "projects/web/regions/us-east1/networkEndpointGroups/shop-us"


class Stack:
    def __init__(self, tmp: Path) -> None:
        backend, front, producer = ports()
        self.front = f"http://127.0.0.1:{front}/"
        self.backends = Backends(backend).__enter__()
        self.manifest = tmp / "world.yaml"
        self.manifest.write_text(yaml.safe_dump_all(e2e_world(backend, front, producer)))
        self.tokens = tmp / "tokens.yaml"
        self.tokens.write_text(yaml.safe_dump([CONSUMER, PRODUCER, VIEWER, ADMIN]))
        self.tokens.chmod(0o600)
        self.db = tmp / "s.db"
        self.serve = self.start()

    def start(self) -> ServeProcess:
        args = ("-f", str(self.manifest), "--tokens", str(self.tokens),
                "--allow-addresses", "127.0.0.0/8", "--public-healthz")  # fmt: skip
        port = getattr(self, "serve", None)
        serve = ServeProcess(self.db, *args, port=port.port if port else None).start()
        wait_for(lambda: self.settled(serve), 20, what="both regions HEALTHY")
        wait_for(lambda: self.served() == "us-east1", 20, what="traffic on us-east1")
        return serve

    @staticmethod
    def settled(serve: ServeProcess) -> bool:
        with serve.client(ADMIN["token"]) as api:
            for neg in ("regions/us-east1/networkEndpointGroups/shop-us",
                        "regions/europe-west1/networkEndpointGroups/shop-eu"):  # fmt: skip
                status = api.get(f"/v1/projects/web/{neg}").json().get("status") or {}
                if status.get("healthState") != "HEALTHY":
                    return False
        return True

    def served(self) -> str | None:
        return region_at(self.front)

    def api(self, who: dict[str, str]) -> httpx.Client:
        return self.serve.client(who["token"])

    def close(self) -> None:
        self.serve.stop()
        self.backends.__exit__(None, None, None)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.close()


def shift(api: httpx.Client, project: str, away: str, **kw: Any) -> httpx.Response:
    body = {"awayFrom": away, "expiresInSec": 3600, "comment": "deploy 42", **kw}
    return api.post(f"/v1/projects/{project}/shifts", json=body)


def test_traffic_moves_within_a_second_of_the_post_and_back_when_ended(stack: Stack) -> None:
    with stack.api(CONSUMER) as api:
        posted = time.monotonic()
        resp = shift(api, "web", "us-east1")
        assert resp.status_code == 201, resp.text
        body = resp.json()
        assert body["actor"] == "wendy" and body["affects"] == [US_NEG] and body["active"]
        wait_for(lambda: stack.served() == "europe-west1", 1.0, interval=0.02, what="moved")
        moved = time.monotonic() - posted
        route = api.get(FRONT).json()["status"]["route"]
        assert "shifted away by wendy until" in route["reason"] and "deploy 42" in route["reason"]
        listed = api.get("/v1/projects/web/shifts").json()["items"]
        assert [s["name"] for s in listed] == [body["name"]] and listed[0]["secondsLeft"] > 3500
        extended = api.patch(f"/v1/projects/web/shifts/{body['name']}", json={"expiresInSec": 7200})
        assert extended.status_code == 200 and extended.json()["secondsLeft"] > 7100
        ended = time.monotonic()
        assert api.delete(f"/v1/projects/web/shifts/{body['name']}").status_code == 200
        wait_for(lambda: stack.served() == "us-east1", 1.0, interval=0.02, what="back")
        back = time.monotonic() - ended
        changes = api.get("/v1/projects/web/events", params={"kind": "Change"}).json()["items"]
        actions = [(c["actor"], c["action"]) for c in changes if c["action"].startswith("shift")]
        assert actions == [("wendy", "shift"), ("wendy", "shift-extend"), ("wendy", "shift-end")]
    print(f"\nshift: traffic moved {moved * 1000:.0f} ms after the POST, back {back * 1000:.0f} ms "
          "after the DELETE")  # fmt: skip


@pytest.mark.serial  # (a shift's expiry is timed: alone on the machine, tests/conftest.py)
def test_a_shift_runs_out_by_itself_and_a_restart_obeys_it_meanwhile(stack: Stack) -> None:
    with stack.api(CONSUMER) as api:
        name = shift(api, "web", "us-east1", name="maintenance").json()["name"]
        wait_for(lambda: stack.served() == "europe-west1", 2, interval=0.05, what="moved")
    # restart with the shift about to end (its expireTime moved to 4 s from now in the
    # store, as if it had been made an hour ago): the new process obeys it at once ...
    stack.serve.stop()
    ends_at = time.time() + 4.0
    with sqlite3.connect(stack.db) as conn:
        key, raw = conn.execute(
            "SELECT key, value FROM documents WHERE key LIKE ?", (f"%/shifts/{name}",)
        ).fetchone()
        doc = json.loads(raw)
        doc["expireTime"] = ends_at
        conn.execute("UPDATE documents SET value=? WHERE key=?", (json.dumps(doc), key))
    stack.serve = ServeProcess(stack.db, "-f", str(stack.manifest), "--tokens", str(stack.tokens),
                               "--allow-addresses", "127.0.0.0/8", port=stack.serve.port).start()  # fmt: skip
    assert stack.served() == "europe-west1"  # (the first request after the restart)
    # ... and traffic returns within a second of its end, which is recorded once
    wait_for(lambda: stack.served() == "us-east1", 10, interval=0.02, what="back after the end")
    late = time.time() - ends_at
    assert late < 1.0, late
    with stack.api(VIEWER) as api:
        changes = api.get("/v1/projects/web/events", params={"kind": "Change"}).json()["items"]
        ends = [c for c in changes if c["action"] == "shift-end"]
        assert len(ends) == 1 and ends[0]["time"] == pytest.approx(ends_at)
        assert "expired" in ends[0]["reason"] and ends[0]["actor"] == "wendy"
        assert api.get("/v1/projects/web/shifts").json()["items"] == []
        assert api.get("/v1/projects/web/shifts?all=true").json()["items"][0]["active"] is False


def test_the_safety_rule_and_an_admins_force(stack: Stack) -> None:
    with stack.api(CONSUMER) as consumer:
        assert shift(consumer, "web", "us-east1").status_code == 201
        refused = shift(consumer, "web", "europe-west1")
        assert refused.status_code == 409, refused.text
        assert "projects/web/global/forwardingRules/shop-frontend" in refused.text
        assert "safety rule" in refused.json()["error"]["message"]
        assert shift(consumer, "web", "europe-west1", force=True).status_code == 403
    with stack.api(ADMIN) as admin:
        forced = shift(admin, "web", "europe-west1", force=True)
        assert forced.status_code == 201 and forced.json()["force"] is True
        # every NEG shifted and none UNHEALTHY: a shift never sends traffic to an
        # UNHEALTHY NEG, and here there is none - the front end fails open as before
        route = admin.get(FRONT).json()["status"]["route"]
        assert route["target"] is not None


def test_who_may_shift_what(stack: Stack) -> None:
    with stack.api(VIEWER) as viewer:
        assert shift(viewer, "web", "us-east1").status_code == 403
    with stack.api(CONSUMER) as consumer:
        assert shift(consumer, "shop", "us-east1").status_code == 403  # another project
        attachment = "projects/web/regions/us-east1/serviceAttachments/x"
        assert shift(consumer, "web", attachment).status_code in (400, 403)
        assert shift(consumer, "web", "asia-east1").status_code == 400  # covers nothing
        assert shift(consumer, "web", "us-east1", expiresInSec=30).status_code == 400
        assert shift(consumer, "web", "us-east1", expiresInSec=259_201).status_code == 400
        # bad input is a 400 naming the field, never a 500 (found by the API fuzzer)
        bad = shift(consumer, "web", "us-east1", comment="two\nlines")
        assert bad.status_code == 400 and "comment" in bad.text, bad.text
    with stack.api(ADMIN) as admin:
        bad = shift(admin, "0", "us-east1")  # (not a project name)
        assert bad.status_code == 400 and "project" in bad.text, bad.text
        made = shift(admin, "web", "us-east1", force=True)
        assert made.status_code == 201, made.text
        name = made.json()["name"]
        patch = admin.patch(f"/v1/projects/web/shifts/{name}",
                            json={"expiresInSec": 120, "comment": "a\x01b"})  # fmt: skip
        assert patch.status_code == 400 and "comment" in patch.text, patch.text
        assert admin.delete(f"/v1/projects/web/shifts/{name}").is_success
    with stack.api(CONSUMER) as consumer:
        doc = {"kind": "Shift", "project": "web", "name": "x", "awayFrom": "us-east1",
               "expireTime": 2e9, "created": 1e9, "actor": "me", "comment": "sneaky"}  # fmt: skip
        via_manifest = consumer.post("/v1/apply", json={"manifest": yaml.safe_dump(doc)})
        assert via_manifest.status_code == 400 and "shifts API" in via_manifest.text
    with stack.api(PRODUCER) as producer:
        assert shift(producer, "shop", US_NEG).status_code in (400, 403)  # not its NEG
        # the producer moves its consumers away from its us-east1 attachment
        made = shift(producer, "shop", "us-east1")
        assert made.status_code == 201, made.text
        assert made.json()["affects"] == [] and made.json()["affectsOtherProjects"] == 1
        wait_for(lambda: stack.served() == "europe-west1", 2, interval=0.05, what="moved")
