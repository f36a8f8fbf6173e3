"""Who changed what (SPEC §6): a Change record for every accepted write,
with its actor (the token's name), action, resources and a one-line summary
of the fields that changed - read only by the project's own principals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.helpers import example_world
from tests.integration.serve_proc import ServeProcess

ALICE = {"token": "a" * 24, "project": "shop", "role": "producer", "name": "alice"}
BOB = {"token": "b" * 24, "project": "web", "role": "consumer", "name": "bob"}
CAROL = {"token": "c" * 24, "project": "shop", "role": "viewer", "name": "carol"}
ROOT = {"token": "r" * 24, "project": "*", "role": "admin"}  # (no name)


def changes(serve: ServeProcess, token: dict[str, str], project: str) -> list[dict[str, Any]]:
    with serve.client(token["token"]) as api:
        resp = api.get(f"/v1/projects/{project}/events", params={"kind": "Change"})
        assert resp.status_code == 200, resp.text
        items: list[dict[str, Any]] = resp.json()["items"]
        return items


def test_every_accepted_write_is_recorded_with_its_actor(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(yaml.safe_dump([ALICE, BOB, CAROL, ROOT]))
    tokens.chmod(0o600)
    world = example_world()
    shop = [d for d in world if d["project"] == "shop"]
    web = [d for d in world if d["project"] == "web"]
    args = ("--no-dataplane", "--tokens", str(tokens), "--allow-addresses", "127.0.0.0/8")
    with ServeProcess(tmp_path / "s.db", *args) as serve:
        with serve.client(ALICE["token"]) as alice:
            dry = {"manifest": yaml.safe_dump_all(shop), "dryRun": True}
            assert alice.post("/v1/apply", json=dry).status_code == 200  # (no record)
            assert alice.post("/v1/apply", json={"manifest": yaml.safe_dump_all(shop)}).is_success
            url = "/v1/projects/shop/regions/us-east1/healthChecks/http-8080"
            check = alice.get(url).json()
            assert alice.put(url, json={**check, "checkIntervalSec": 5}).is_success
            refused = alice.put(url, json={**check, "checkIntervalSec": 6})  # a stale fingerprint
            assert refused.status_code == 412  # (refused: no record)
        with serve.client(ROOT["token"]) as root:
            assert root.post("/v1/apply", json={"manifest": yaml.safe_dump_all(web)}).is_success
        seen = changes(serve, CAROL, "shop")  # a viewer of shop reads shop's changes
        assert [(c["actor"], c["action"]) for c in seen] == [
            ("alice", "apply"),
            ("alice", "replace"),
        ]
        apply, replace = seen
        assert apply["resourceCount"] == len(shop) and apply["reason"].startswith("created ")
        assert replace["resources"] == ["projects/shop/regions/us-east1/healthChecks/http-8080"]
        assert replace["reason"] == "updated healthChecks/http-8080 (checkIntervalSec 2 -> 5)"
        # the consumer reads its own project's changes, not the producer's
        web_changes = changes(serve, BOB, "web")
        assert [c["actor"] for c in web_changes] == [f"admin-{_sha('r' * 24)}"]
        with serve.client(BOB["token"]) as bob:
            assert bob.get("/v1/projects/shop/events").status_code == 403
        # filters: by action (the record's "to") and by resource
        with serve.client(CAROL["token"]) as carol:
            only = carol.get(
                "/v1/projects/shop/events", params={"kind": "Change", "state": "replace"}
            ).json()["items"]
            assert [c["action"] for c in only] == ["replace"]
            by_path = carol.get(
                "/v1/projects/shop/events",
                params={"resource": "projects/shop/regions/us-east1/healthChecks/http-8080"},
            ).json()["items"]
            assert any(c["kind"] == "Change" for c in by_path)


def test_without_tokens_the_actor_is_local(tmp_path: Path) -> None:
    with ServeProcess(tmp_path / "s.db", "--no-dataplane") as serve, serve.client() as api:
        assert api.post(
            "/v1/apply", json={"manifest": yaml.safe_dump_all(example_world())}
        ).is_success
        items = api.get("/v1/projects/web/events", params={"kind": "Change"}).json()["items"]
        assert [(c["actor"], c["action"]) for c in items] == [("local", "apply")]


def _sha(token: str) -> str:
    import hashlib

    return hashlib.sha256(token.encode()).hexdigest()[:8]
