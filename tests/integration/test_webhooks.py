"""Webhooks (SPEC §6, "Notifications"), against a real serve and a real receiver.

Signed with HMAC-SHA256, one delivery id per record, in order, retried with
backoff until the receiver answers 2xx; the cursor is in the store, so a
serve killed in the middle of a backlog resends nothing acknowledged and
loses nothing; GET shows the status and never the secret; the address
policy covers the URL (written addresses and resolved names alike)."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.integration.receiver import receiver
from tests.integration.serve_proc import ServeProcess, wait_for

SECRET = "s3cret-of-the-oncall-team"
HOOK_URL = "/v1/projects/shop/global/webhooks/oncall"
CHECK_URL = "/v1/projects/shop/regions/us-east1/healthChecks/hc"


def webhook(url: str, events: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {
        "kind": "Webhook",
        "name": "oncall",
        "project": "shop",
        "url": url,
        "secret": SECRET,
        "events": events if events is not None else [{"kind": "Change"}],
    }


def check(description: str) -> dict[str, Any]:
    return {
        "kind": "HealthCheck",
        "name": "hc",
        "project": "shop",
        "region": "us-east1",
        "type": "TCP",
        "port": 80,
        "description": description,
    }


def apply(api: httpx.Client, *docs: dict[str, Any]) -> None:
    resp = api.post("/v1/apply", json={"manifest": yaml.safe_dump_all(list(docs))})
    assert resp.is_success, resp.text


def change_ids(api: httpx.Client, after: int) -> list[int]:
    items = api.get("/v1/projects/shop/events", params={"kind": "Change", "after": after}).json()
    return [e["id"] for e in items["items"]]


def status(api: httpx.Client) -> dict[str, Any]:
    resp = api.get(HOOK_URL)
    assert resp.status_code == 200, resp.text
    return dict(resp.json().get("status") or {})


def test_signed_in_order_retried_and_shown(tmp_path: Path) -> None:
    serve = ServeProcess(tmp_path / "s.db", "--no-dataplane")
    with receiver() as rec, serve, serve.client() as api:
        rec.failing = 500  # the first deliveries fail
        apply(api, webhook(f"http://127.0.0.1:{rec.port}/hook"))
        created = change_ids(api, 0)[-1]  # (the webhook's own Change record)
        for i in range(4):
            apply(api, check(f"version {i}"))
        wait_for(lambda: len(rec.requests) >= 2, 20, what="two failed attempts")
        shown = status(api)
        assert shown["lastError"]["message"] == "the receiver answered 500"
        assert shown["behind"] >= 4 and shown["attempts"] >= 1
        rec.failing = None
        wanted = change_ids(api, created - 1)
        wait_for(lambda: rec.acked() == wanted, 30, what="every record delivered")
        # the failed attempts were of the first record, and it was retried
        answered = rec.answered()
        assert [code for _, code in answered[:2]] == [500, 500]
        assert {i for i, code in answered if code == 500} == {wanted[0]}
        for headers, body, _ in rec.requests:
            assert headers["X-Healthgate-Delivery"] == str(json.loads(body)["id"])
            mac = hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
            assert headers["X-Healthgate-Signature"] == f"sha256={mac}"
            assert headers["Content-Type"] == "application/json"
        record = json.loads(rec.requests[-1][1])
        assert record["kind"] == "Change" and record["project"] == "shop"
        # GET: the status, and never the secret
        hook = api.get(HOOK_URL).json()
        assert "secret" not in hook and hook["secretSet"] is True
        assert SECRET not in api.get(HOOK_URL).text
        wait_for(lambda: status(api).get("behind") == 0, 10, what="nothing behind")
        shown = status(api)
        assert shown["lastDelivery"]["id"] == wanted[-1]
        assert shown["lastDelivery"]["status"] == 204
        assert shown["delivered"] == len(wanted)
        # the secret is not in the Change record of a new secret either
        apply(api, {**webhook(f"http://127.0.0.1:{rec.port}/hook"), "secret": "x" * 20})
        last = api.get("/v1/projects/shop/events", params={"kind": "Change"}).json()
        assert "x" * 20 not in json.dumps(last) and SECRET not in json.dumps(last)


def test_a_restart_in_the_middle_of_a_backlog_loses_and_repeats_nothing(
    tmp_path: Path,
) -> None:
    with receiver() as rec:
        serve = ServeProcess(tmp_path / "s.db", "--no-dataplane").start()
        try:
            with serve.client() as api:
                apply(api, webhook(f"http://127.0.0.1:{rec.port}/hook"))
                apply(api, check("first"))
                created = change_ids(api, 0)[0]
                wait_for(lambda: len(rec.acked()) == 2, 20, what="two acknowledged")
                rec.failing = 503
                for i in range(3):
                    apply(api, check(f"backlog {i}"))
                wait_for(
                    lambda: "lastError" in status(api) and status(api)["behind"] == 3,
                    20,
                    what="a failing backlog",
                )
                assert status(api)["lastDelivery"]["id"] == rec.acked()[-1]
            serve.kill()  # SIGKILL: no goodbye
            rec.failing = None
            serve.start()
            with serve.client() as api:
                wanted = change_ids(api, created - 1)
                assert len(wanted) == 5
                wait_for(lambda: rec.acked() == wanted, 30, what="the backlog delivered")
        finally:
            serve.stop()
    # each record acknowledged exactly once, across the restart
    assert sorted(set(rec.acked())) == rec.acked()


def test_the_address_policy_covers_the_url(tmp_path: Path) -> None:
    producer = {"token": "p" * 24, "project": "shop", "role": "producer", "name": "pat"}
    consumer = {"token": "c" * 24, "project": "web", "role": "consumer", "name": "cy"}
    admin = {"token": "a" * 24, "project": "*", "role": "admin", "name": "root"}
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(yaml.safe_dump([producer, consumer, admin]))
    tokens.chmod(0o600)
    args = ("--no-dataplane", "--tokens", str(tokens))
    with receiver() as rec, ServeProcess(tmp_path / "s.db", *args) as serve:
        metadata = webhook("http://169.254.169.254/latest")
        with serve.client(producer["token"]) as api:
            for url in ("http://169.254.169.254/latest", f"http://127.0.0.1:{rec.port}/"):
                resp = api.post("/v1/apply", json={"manifest": yaml.safe_dump(webhook(url))})
                assert resp.status_code == 400, resp.text
                assert any(d["field"] == "url" for d in resp.json()["error"]["details"])
            # a bad secret is refused without being repeated
            bad = {**metadata, "url": "https://hooks.example.com/", "secret": "short\x01secret!!!!"}
            resp = api.post("/v1/apply", json={"manifest": yaml.safe_dump(bad)})
            assert resp.status_code == 400 and "short" not in resp.text
        with serve.client(consumer["token"]) as api:
            hook = {**webhook("https://hooks.example.com/"), "project": "web", "events": []}
            resp = api.post("/v1/apply", json={"manifest": yaml.safe_dump(hook)})
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["details"][0]["field"] == "events"
            hook["events"] = [{"kind": "Route"}]
            assert api.post("/v1/apply", json={"manifest": yaml.safe_dump(hook)}).is_success
        with serve.client(admin["token"]) as api:
            # a name is checked when it is resolved: localhost is loopback
            apply(api, webhook(f"http://localhost:{rec.port}/"), check("a record"))
            wait_for(lambda: "lastError" in status(api), 20, what="a refused delivery")
            assert "loopback" in status(api)["lastError"]["message"]
            assert rec.requests == []
