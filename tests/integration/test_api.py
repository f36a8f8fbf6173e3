"""The REST API against a real running `healthgate serve`."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from healthgate.model.names import KIND_TO_COLLECTION
from tests.helpers import example_world, run_cli
from tests.integration.serve_proc import ServeProcess, wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    db = tmp_path_factory.mktemp("api") / "hg.db"
    with ServeProcess(db) as proc:
        yield proc


@pytest.fixture
def api(server: ServeProcess) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


_counter = iter(range(1, 10_000))


def world(producer: str | None = None, consumer: str | None = None) -> list[dict[str, Any]]:
    """The shared example moved into fresh projects, so tests do not interfere."""
    n = next(_counter)
    return example_world(producer or f"shop{n}", consumer or f"web{n}", listen_port=20000 + 3 * n)


def collection_url(d: dict[str, Any]) -> str:
    coll = KIND_TO_COLLECTION[d["kind"]]
    region = d.get("region", "global")
    if region == "global":
        return f"/v1/projects/{d['project']}/global/{coll}"
    return f"/v1/projects/{d['project']}/regions/{region}/{coll}"


def manifest(dicts: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(dicts, sort_keys=False)


def assert_error(
    resp: httpx.Response, code: int, status: str, field: str | None = None
) -> dict[str, Any]:
    assert resp.status_code == code, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"code", "status", "message", "details"}
    assert (err["code"], err["status"]) == (code, status)
    assert err["message"]
    if field is not None:
        assert any(d["field"] == field for d in err["details"]), err
    return dict(err)


def test_every_collection_life_cycle(api: httpx.Client) -> None:
    dicts = world()
    created = []
    for d in dicts:  # create, in dependency order
        resp = api.post(collection_url(d), json=d)
        assert resp.status_code == 201, resp.text
        body = resp.json()
        assert body["selfLink"].endswith(f"/{d['name']}") and body["fingerprint"]
        created.append(body)
    for d, body in zip(dicts, created, strict=True):  # get and list
        got = api.get(f"{collection_url(d)}/{d['name']}").json()
        assert got["fingerprint"] == body["fingerprint"]
        names = [i["name"] for i in api.get(collection_url(d)).json()["items"]]
        assert d["name"] in names
    for d in dicts:  # replace, with the fingerprint read back
        url = f"{collection_url(d)}/{d['name']}"
        current = api.get(url).json()
        current["description"] = "changed"
        resp = api.put(url, json=current)
        assert resp.status_code == 200, resp.text
        assert resp.json()["description"] == "changed"
        assert resp.json()["fingerprint"] != current["fingerprint"]
        assert_error(
            api.put(url, json=current), 412, "FAILED_PRECONDITION", "fingerprint"
        )  # stale now
    for d in reversed(dicts):  # delete, referrers first
        url = f"{collection_url(d)}/{d['name']}"
        assert api.delete(url).status_code == 200
        assert_error(api.get(url), 404, "NOT_FOUND")


def test_error_shapes(api: httpx.Client, server: ServeProcess) -> None:
    dicts = world()
    assert api.post("/v1/apply", json={"manifest": manifest(dicts)}).status_code == 200
    hc = dicts[0]
    url = collection_url(hc)
    # a field out of range names the field
    bad = {**hc, "name": "other", "checkIntervalSec": 99}
    err = assert_error(api.post(url, json=bad), 400, "INVALID_ARGUMENT", "checkIntervalSec")
    assert "less than or equal to 50" in json.dumps(err)
    # the body contradicts the URL
    assert_error(
        api.post(url, json={**hc, "name": "x", "project": "elsewhere"}),
        400,
        "INVALID_ARGUMENT",
        "project",
    )
    # exists already
    assert_error(api.post(url, json=hc), 409, "ALREADY_EXISTS")
    # in use: names who references it
    err = assert_error(api.delete(f"{url}/{hc['name']}"), 409, "FAILED_PRECONDITION")
    assert "backendServices/web references it in field healthChecks[0]" in err["message"]
    # missing reference
    bs = {**dicts[2], "name": "lonely", "healthChecks": ["healthChecks/nope"]}
    assert_error(api.post(collection_url(bs), json=bs), 400, "INVALID_ARGUMENT", "healthChecks[0]")
    # not found, unknown collection, malformed name
    assert_error(api.get(f"{url}/nope"), 404, "NOT_FOUND")
    assert_error(
        api.get(f"/v1/projects/{hc['project']}/regions/r/widgets"), 400, "INVALID_ARGUMENT"
    )
    assert_error(api.get(f"{url}/Bad_Name"), 400, "INVALID_ARGUMENT", "name")
    assert_error(api.get("/v1/nothing-here"), 404, "NOT_FOUND")
    # not JSON
    assert_error(
        api.post(url, content=b"{nope", headers={"content-type": "application/json"}),
        400,
        "INVALID_ARGUMENT",
    )
    # too large
    huge = {**hc, "name": "huge", "description": "x" * (2 * 1024 * 1024)}
    assert_error(api.post(url, json=huge), 413, "PAYLOAD_TOO_LARGE")


def test_apply_is_atomic_and_dry_run_plans(api: httpx.Client) -> None:
    dicts = world()
    text = manifest(dicts)
    plan = api.post("/v1/apply", json={"manifest": text, "dryRun": True}).json()
    assert plan["dryRun"] and len(plan["plan"]["create"]) == 20 and plan["revision"] is None
    project = dicts[0]["project"]
    assert api.get(f"/v1/projects/{project}/regions/us-east1/healthChecks").json()["items"] == []
    # one bad document: nothing at all is written
    broken = copy.deepcopy(dicts)
    broken[5]["minHealthyThreshold"] = -1
    err = assert_error(
        api.post("/v1/apply", json={"manifest": manifest(broken)}),
        400,
        "INVALID_ARGUMENT",
        "minHealthyThreshold",
    )
    assert err["details"][0]["document"] == 6
    assert api.get(f"/v1/projects/{project}/regions/us-east1/healthChecks").json()["items"] == []
    # the real apply, then an idempotent one, then a change as a YAML body
    assert api.post("/v1/apply", json={"manifest": text}).json()["plan"]["create"].__len__() == 20
    again = api.post("/v1/apply", json={"manifest": text}).json()["plan"]
    assert (len(again["create"]), len(again["update"]), len(again["unchanged"])) == (0, 0, 20)
    dicts[3]["healthyPercentThreshold"] = 50
    resp = api.post(
        "/v1/apply?dryRun=true",
        content=manifest(dicts),
        headers={"content-type": "application/yaml"},
    )
    assert resp.json()["plan"]["update"] == [
        f"projects/{project}/regions/us-east1/healthAggregationPolicies/strict"
    ]
    # delete a whole manifest atomically (in-use checks see the whole set)
    out = api.post("/v1/delete", json={"manifest": text}).json()
    assert len(out["plan"]["delete"]) == 20


def test_health_events_and_states(api: httpx.Client) -> None:
    dicts = world()
    for d in dicts:  # fast checks on refused ports: UNHEALTHY within ~2 s
        if d["kind"] == "HealthCheck":
            d.update(
                checkIntervalSec=1, timeoutSec=1, healthyThreshold=2, unhealthyThreshold=2, port=1
            )
    assert api.post("/v1/apply", json={"manifest": manifest(dicts)}).status_code == 200
    producer, consumer = dicts[0]["project"], dicts[-1]["project"]
    health_url = f"/v1/projects/{producer}/regions/us-east1/backendServices/web/health"

    def unhealthy() -> bool:
        h = api.get(health_url).json()
        return all(e["healthState"] == "UNHEALTHY" for e in h["healthStatus"])

    wait_for(unhealthy, 15, what="endpoints UNHEALTHY")
    h = api.get(health_url).json()
    assert h["endpoints"] == 4 and h["healthStatus"][0]["lastResult"]["outcome"] == "REFUSED"
    assert "consecutive failed probes" in h["healthStatus"][0]["reason"]
    src = api.get(f"/v1/projects/{producer}/regions/us-east1/healthSources/web-source").json()
    assert (
        src["status"]["healthState"] == "UNHEALTHY"
        and "0 of 4 endpoints healthy" in src["status"]["reason"]
    )
    fr = api.get(f"/v1/projects/{producer}/regions/us-east1/forwardingRules/web-fr").json()
    assert fr["status"]["healthState"] == "UNHEALTHY"

    def all_events() -> list[dict[str, Any]]:
        return list(
            api.get(f"/v1/projects/{producer}/events", params={"limit": 10000}).json()["items"]
        )

    wait_for(
        lambda: any(e["kind"] == "CompositeHealthCheck" for e in all_events()),
        10,
        what="composite event",
    )
    kinds = {e["kind"] for e in all_events()}
    assert {"Endpoint", "HealthSource", "CompositeHealthCheck"} <= kinds
    only = api.get(
        f"/v1/projects/{producer}/events", params={"kind": "HealthSource", "state": "UNHEALTHY"}
    ).json()["items"]
    assert only and all(e["kind"] == "HealthSource" and e["to"] == "UNHEALTHY" for e in only)

    def europe_events() -> list[dict[str, Any]]:
        return list(
            api.get(
                f"/v1/projects/{producer}/events",
                params={"resource": f"projects/{producer}/regions/europe-west1/"},
            ).json()["items"]
        )

    # (europe-west1's endpoints fail on their own probe phases: wait for them
    # too, not only for us-east1's)
    wait_for(lambda: bool(europe_events()), 10, what="europe-west1 events")
    by_resource = europe_events()
    assert all("europe-west1" in e["path"] for e in by_resource)
    # the consumer's log holds its NEGs and routes only
    wait_for(
        lambda: bool(api.get(f"/v1/projects/{consumer}/events").json()["items"]),
        10,
        what="consumer events",
    )
    consumer_events = api.get(f"/v1/projects/{consumer}/events").json()["items"]
    # (and the Change records of its own writes)
    assert consumer_events and {e["kind"] for e in consumer_events} <= {
        "Change",
        "NetworkEndpointGroup",
        "Route",
    }
    neg = api.get(f"/v1/projects/{consumer}/regions/us-east1/networkEndpointGroups/shop-us").json()
    assert neg["status"]["healthState"] == "UNHEALTHY"
    front = api.get(f"/v1/projects/{consumer}/global/forwardingRules/shop-frontend").json()
    assert (
        front["status"]["route"]["mode"] == "fail-open"
    )  # both regions refuse: FAIL_OPEN keeps the first


def test_event_stream_delivers_live_transitions(api: httpx.Client, server: ServeProcess) -> None:
    dicts = world()
    producer = dicts[0]["project"]
    received: list[dict[str, Any]] = []
    ready = threading.Event()

    def listen() -> None:
        with (
            httpx.Client(base_url=server.url, timeout=httpx.Timeout(20.0)) as c,
            c.stream(
                "GET", f"/v1/projects/{producer}/events/stream", params={"kind": "HealthSource"}
            ) as resp,
        ):
            assert resp.headers["content-type"].startswith("text/event-stream")
            for line in resp.iter_lines():
                ready.set()
                if line.startswith("data: "):
                    received.append(json.loads(line[6:]))
                    if len(received) >= 2:
                        return

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    assert ready.wait(10)
    for d in dicts:
        if d["kind"] == "HealthCheck":
            d.update(
                checkIntervalSec=1, timeoutSec=1, healthyThreshold=2, unhealthyThreshold=2, port=1
            )
    api.post("/v1/apply", json={"manifest": manifest(dicts)})
    t.join(20)
    assert len(received) == 2
    assert {r["kind"] for r in received} == {"HealthSource"} and {r["to"] for r in received} == {
        "UNHEALTHY"
    }


def test_metrics_and_operations(api: httpx.Client) -> None:
    assert api.get("/healthz").text == "ok\n"
    assert api.get("/readyz").text == "ready\n"
    api.post("/v1/apply", json={"manifest": manifest(world())}).raise_for_status()

    def probed() -> str | None:  # the first probes are spread over the first interval
        text = api.get("/metrics").text
        return text if "healthgate_endpoint_probe_success{" in text else None

    text = wait_for(probed, 15, what="a probe result in /metrics")
    # the whole (streamed) text is valid exposition, one family per name
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names))
    for family in (
        "healthgate_endpoint_probe_success",
        "healthgate_probe_duration_seconds_bucket",
        "healthgate_backend_service_endpoints",
        "healthgate_health_state",
        "healthgate_transitions_total",
        "healthgate_probes_started_total",
        "healthgate_route_info",
    ):
        assert family in text, family
    doc = api.get("/openapi.json").json()
    assert (
        "/v1/apply" in doc["paths"]
        and "/v1/projects/{project}/regions/{region}/{collection}/{name}" in doc["paths"]
    )


def test_accept_manual_refuses_a_consumer_not_on_the_list(api: httpx.Client) -> None:
    dicts = world()
    for d in dicts:
        if d["kind"] == "ServiceAttachment" and d["region"] == "us-east1":
            d["consumerAcceptLists"] = [{"projectIdOrNum": "somebody-else"}]
    assert api.post("/v1/apply", json={"manifest": manifest(dicts)}).status_code == 200
    consumer = dicts[-1]["project"]
    neg = api.get(f"/v1/projects/{consumer}/regions/us-east1/networkEndpointGroups/shop-us").json()
    assert (
        "connection refused" in neg["status"]["reason"]
        and "not on the consumerAcceptLists" in neg["status"]["reason"]
    )
    front = api.get(f"/v1/projects/{consumer}/global/forwardingRules/shop-frontend").json()
    assert front["status"]["route"]["target"].endswith("/shop-eu")


# ---------------------------------------------------------------------- access


TOKENS = {
    "admin": ("a" * 24, "*"),
    "producer": ("p" * 24, "shopx"),
    "consumer": ("c" * 24, "webx"),
    "viewer": ("v" * 24, "shopx"),
}


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tmp = tmp_path_factory.mktemp("secured")
    tokens = tmp / "tokens.yaml"
    tokens.write_text(
        yaml.safe_dump([{"token": t, "project": p, "role": r} for r, (t, p) in TOKENS.items()])
    )
    # single-tenant use: the test world is on loopback (SPEC §7 "Addresses")
    with ServeProcess(
        tmp / "hg.db", "--tokens", str(tokens), "--allow-addresses", "127.0.0.0/8"
    ) as proc:
        yield proc


def test_access_rules_for_each_role(secured: ServeProcess) -> None:
    dicts = world("shopx", "webx")
    producer_docs = [d for d in dicts if d["project"] == "shopx"]
    consumer_docs = [d for d in dicts if d["project"] == "webx"]
    with secured.client() as anon, secured.client("nope-nope-nope-nope") as bad:
        assert_error(
            anon.get("/v1/projects/shopx/regions/us-east1/healthChecks"), 401, "UNAUTHENTICATED"
        )
        assert_error(
            bad.get("/v1/projects/shopx/regions/us-east1/healthChecks"), 401, "UNAUTHENTICATED"
        )
    with secured.client(TOKENS["producer"][0]) as producer:
        assert (
            producer.post("/v1/apply", json={"manifest": manifest(producer_docs)}).status_code
            == 200
        )
        assert_error(
            producer.post("/v1/apply", json={"manifest": manifest(consumer_docs)}),
            403,
            "PERMISSION_DENIED",
        )
        assert_error(
            producer.get("/v1/projects/webx/global/backendServices"), 403, "PERMISSION_DENIED"
        )
    with secured.client(TOKENS["consumer"][0]) as consumer:
        assert (
            consumer.post("/v1/apply", json={"manifest": manifest(consumer_docs)}).status_code
            == 200
        )
        # a consumer never sees the producer's backends, sources or composites
        for path in (
            "regions/us-east1/backendServices/web",
            "regions/us-east1/healthSources/web-source",
            "regions/us-east1/compositeHealthChecks/web-composite",
        ):
            assert_error(consumer.get(f"/v1/projects/shopx/{path}"), 403, "PERMISSION_DENIED")
        assert_error(consumer.get("/v1/projects/shopx/events"), 403, "PERMISSION_DENIED")
        # nor may it create producer kinds in its own project
        hc = {**producer_docs[0], "project": "webx"}
        assert_error(consumer.post(collection_url(hc), json=hc), 403, "PERMISSION_DENIED")
        neg = consumer.get(
            "/v1/projects/webx/regions/us-east1/networkEndpointGroups/shop-us"
        ).json()
        assert "healthState" in neg["status"]
        events = consumer.get("/v1/projects/webx/events").json()["items"]
        assert {e["kind"] for e in events} <= {"Change", "NetworkEndpointGroup", "Route"}
        assert all(e["project"] == "webx" for e in events if e["kind"] == "Change")
    with secured.client(TOKENS["viewer"][0]) as viewer:
        assert viewer.get("/v1/projects/shopx/regions/us-east1/healthChecks").status_code == 200
        assert viewer.get("/v1/projects/shopx/events").status_code == 200
        assert_error(
            viewer.delete("/v1/projects/shopx/regions/us-east1/serviceAttachments/web-attachment"),
            403,
            "PERMISSION_DENIED",
        )
        assert_error(
            viewer.get("/v1/projects/webx/global/backendServices"), 403, "PERMISSION_DENIED"
        )
    with secured.client(TOKENS["admin"][0]) as admin:
        assert admin.get("/v1/projects/webx/global/backendServices").status_code == 200
        assert (
            admin.get("/v1/projects/shopx/regions/us-east1/backendServices/web/health").status_code
            == 200
        )


def test_listening_beyond_loopback_requires_tokens(tmp_path: Path) -> None:

    proc = run_cli("serve", "--db", str(tmp_path / "x.db"), "--listen", "0.0.0.0:0")
    assert proc.returncode == 1
    assert "not a loopback address: give --tokens FILE" in proc.stderr


def test_cli_get_wide_shows_since_and_fingerprint(api: httpx.Client, server: ServeProcess) -> None:

    dicts = world()
    api.post("/v1/apply", json={"manifest": manifest(dicts)}).raise_for_status()
    project = dicts[0]["project"]
    proc = run_cli(
        "get",
        "hc",
        "--project",
        project,
        "--region",
        "us-east1",
        "-o",
        "wide",
        "--server",
        server.url,
    )
    assert proc.returncode == 0, proc.stderr
    header, row = proc.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "REGION", "STATE", "SINCE", "FINGERPRINT", "WHY"]
    fingerprint = api.get(
        f"/v1/projects/{project}/regions/us-east1/healthChecks/{row.split()[0]}"
    ).json()["fingerprint"]
    assert fingerprint in row.split()


def test_cli_get_watch_prints_the_table_and_keeps_watching(
    api: httpx.Client, server: ServeProcess, tmp_path: Path
) -> None:
    import subprocess
    import sys

    dicts = world()
    api.post("/v1/apply", json={"manifest": manifest(dicts)}).raise_for_status()
    out = tmp_path / "watch.txt"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "healthgate",
                "get",
                "hs",
                "--project",
                dicts[0]["project"],
                "--region",
                "us-east1",
                "--watch",
                "--interval",
                "0.2",
                "--server",
                server.url,
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        text = wait_for(lambda: "web-source" in out.read_text() and out.read_text(), 20)
        assert text.startswith("-- ") and "NAME" in text
        assert proc.poll() is None  # still watching
    finally:
        proc.terminate()
        proc.wait(10)
