"""The API in this process on the memory store: writes as store transactions,
the mirror fed by the watch, concurrent writers, and hostile manifests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import yaml

from healthgate.store.base import Compacted, Txn
from tests.helpers import example_world, run_async
from tests.inprocess import InProcessApi
from tests.integration.test_api import assert_error, collection_url, manifest

Scenario = Callable[[InProcessApi, httpx.AsyncClient], Awaitable[None]]


def run(scenario: Scenario, tokens: list[dict[str, str]] | None = None) -> None:
    async def go() -> None:
        async with InProcessApi(tokens) as hg:
            assert hg.client is not None
            await scenario(hg, hg.client)

    run_async(go(), timeout=60)


async def apply(client: httpx.AsyncClient, dicts: list[dict[str, Any]], **kw: Any) -> Any:
    return await client.post("/v1/apply", json={"manifest": manifest(dicts), **kw})


def test_create_get_replace_delete_with_kinds_of_refusal() -> None:
    async def scenario(hg: InProcessApi, api: httpx.AsyncClient) -> None:
        dicts = example_world()
        assert (await apply(api, dicts)).status_code == 200
        hc = dicts[0]
        url = f"{collection_url(hc)}/{hc['name']}"
        got = (await api.get(url)).json()
        assert got["fingerprint"] == str(hg.store.revision())
        # create-only: a second POST of the same name is a conflict
        assert_error(await api.post(collection_url(hc), json=hc), 409, "ALREADY_EXISTS")
        # replace with the fingerprint read, then again with the stale one
        changed = {**got, "checkIntervalSec": 7}
        resp = await api.put(url, json=changed)
        assert resp.status_code == 200 and resp.json()["checkIntervalSec"] == 7
        assert_error(await api.put(url, json=changed), 412, "FAILED_PRECONDITION", "fingerprint")
        # in use: a backend service refers to the check
        assert_error(await api.delete(url), 409, "FAILED_PRECONDITION")
        assert_error(await api.get(url + "-none"), 404, "NOT_FOUND")
        assert_error(await api.delete(url + "-none"), 404, "NOT_FOUND")

    run(scenario)


def test_a_write_by_another_process_reaches_the_mirror_through_the_watch() -> None:
    """What another node of a cluster does: commit to the store directly."""

    async def scenario(hg: InProcessApi, api: httpx.AsyncClient) -> None:
        dicts = example_world()
        await apply(api, dicts)
        hc = dict(dicts[0])
        url = f"{collection_url(hc)}/{hc['name']}"
        hc["checkIntervalSec"] = 9
        key = "resources/" + (await api.get(url)).json()["selfLink"]
        rev = await asyncio.to_thread(hg.store.commit, Txn(puts={key: hc}))
        await hg.control.wait_for_revision(rev)
        body = (await api.get(url)).json()
        assert body["checkIntervalSec"] == 9 and body["fingerprint"] == str(rev)

    run(scenario)


def test_concurrent_creates_of_one_name_give_one_success_and_one_conflict() -> None:
    async def scenario(hg: InProcessApi, api: httpx.AsyncClient) -> None:
        hc = example_world()[0]
        results = await asyncio.gather(*(api.post(collection_url(hc), json=hc) for _ in range(4)))
        codes = sorted(r.status_code for r in results)
        assert codes == [201, 409, 409, 409], [r.text for r in results]

    run(scenario)


def test_a_delete_racing_a_new_reference_never_leaves_a_dangling_one() -> None:
    """Delete a health source while a composite that names it is applied: the
    rule 'nothing refers to what is deleted' is checked inside the store
    transaction (the plan's revision), so exactly one of them wins."""

    async def scenario(hg: InProcessApi, api: httpx.AsyncClient) -> None:
        for round_ in range(6):
            dicts = example_world(f"shop{round_}", f"web{round_}", listen_port=20000 + 3 * round_)
            base = [d for d in dicts if d["kind"] != "CompositeHealthCheck"]
            assert (await apply(api, base)).status_code == 200, "setup"
            composite = [d for d in dicts if d["kind"] == "CompositeHealthCheck"][:1]
            source = next(
                d
                for d in dicts
                if d["kind"] == "HealthSource"
                and d["region"] == composite[0]["region"]
                and d["name"] == composite[0]["healthSources"][0].rsplit("/", 1)[-1]
            )
            src_url = f"{collection_url(source)}/{source['name']}"
            created, deleted = await asyncio.gather(apply(api, composite), api.delete(src_url))
            outcomes = (created.status_code, deleted.status_code)
            assert outcomes in ((200, 409), (400, 200)), (created.text, deleted.text)
            world = hg.control.resources
            paths = {str(p) for p in world}
            for res in world.values():  # no resource refers to a missing one
                for ref in res.references():
                    assert ref.target is None or str(ref.target) in paths, ref

    run(scenario)


# ---------------------------------------------------------------------- hostile manifests

ALIAS_BOMB = "\n".join(
    ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    + [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    + ["kind: HealthCheck", "name: bomb", "project: p", "region: r", "type: TCP", "port: 80"]
    + ["description: *a8"]
)


def test_hostile_manifests_are_refused_quickly_with_400() -> None:
    async def scenario(hg: InProcessApi, api: httpx.AsyncClient) -> None:
        deep = "kind: HealthCheck\nname: x\nproject: p\nregion: r\ndescription: " + (
            "[" * 5000 + "]" * 5000
        )
        cases = {
            "alias bomb": ALIAS_BOMB,
            "deep nesting": deep,
            "kind is a list": "kind: [a]\nname: x\nproject: p\n",
            "not a mapping": "- just\n- a list\n",
            "huge value echoed": "kind: " + "K" * 100_000 + "\nname: x\nproject: p\n",
        }
        for label, text in cases.items():
            started = time.perf_counter()
            resp = await api.post(
                "/v1/apply", content=text, headers={"Content-Type": "application/yaml"}
            )
            took = time.perf_counter() - started
            err = assert_error(resp, 400, "INVALID_ARGUMENT")
            assert len(resp.content) < 4000, (label, len(resp.content))  # never the whole value
            assert took < 5, (label, took)
            assert err["details"], label
        assert hg.control.stored == {}

    run(scenario)


def test_a_viewer_is_refused_before_its_manifest_is_read_and_odd_tokens_are_401() -> None:
    tokens = [
        {"token": "viewer-token-0123456789", "project": "p", "role": "viewer"},
        {"token": "admin-token-0123456789", "project": "*", "role": "admin"},
    ]

    async def scenario(hg: InProcessApi, api: httpx.AsyncClient) -> None:
        resp = await api.post(
            "/v1/apply",
            content=ALIAS_BOMB,
            headers={
                "Content-Type": "application/yaml",
                "Authorization": "Bearer viewer-token-0123456789",
            },
        )
        assert_error(resp, 403, "PERMISSION_DENIED")
        resp = await api.get(
            "/v1/projects/p/events",
            headers={b"Authorization": "Bearer tökén-ünicode-0123456789".encode()},
        )
        assert_error(resp, 401, "UNAUTHENTICATED")

    run(scenario, tokens)


def test_the_offline_loader_is_bounded_too() -> None:
    from healthgate.model.manifest import ManifestLimits, load_manifest
    from healthgate.model.validation import InvalidResources

    started = time.perf_counter()
    try:
        load_manifest(ALIAS_BOMB)
    except InvalidResources as exc:
        assert "expands to more than" in str(exc)
    else:
        raise AssertionError("the alias bomb loaded")
    assert time.perf_counter() - started < 2
    # a legitimate manifest is within every limit, and the limits are settings
    assert load_manifest(manifest(example_world()))
    tight = ManifestLimits(max_nodes=10)
    try:
        load_manifest(yaml.safe_dump(example_world()[0]), tight)
    except InvalidResources as exc:
        assert "more than 10" in str(exc)
    else:
        raise AssertionError("a 10-node limit let a health check through")


def test_metrics_need_an_admin_or_metrics_token_when_tokens_are_in_use() -> None:
    tokens = [
        {"token": "viewer-token-0123456789", "project": "p", "role": "viewer"},
        {"token": "scrape-token-0123456789", "project": "*", "role": "metrics"},
        {"token": "admin-token-0123456789", "project": "*", "role": "admin"},
    ]

    def bearer(token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}-token-0123456789"}

    async def scenario(hg: InProcessApi, api: httpx.AsyncClient) -> None:
        assert (await api.get("/metrics")).status_code == 401
        assert (await api.get("/metrics", headers=bearer("viewer"))).status_code == 403
        scraped = await api.get("/metrics", headers=bearer("scrape"))
        assert scraped.status_code == 200 and "healthgate_" in scraped.text
        assert (await api.get("/metrics", headers=bearer("admin"))).status_code == 200
        # a metrics token reads nothing else
        read = await api.get("/v1/projects/p/regions/r/healthChecks", headers=bearer("scrape"))
        assert read.status_code == 403

    run(scenario, tokens)


def test_events_with_an_unknown_kind_or_state_are_refused_naming_the_field() -> None:
    async def scenario(hg: InProcessApi, api: httpx.AsyncClient) -> None:
        assert (await api.get("/v1/projects/p/events", params={"kind": "Route"})).status_code == 200
        bad = await api.get("/v1/projects/p/events", params={"kind": "Endpionts"})
        assert_error(bad, 400, "INVALID_ARGUMENT", "kind")
        bad = await api.get("/v1/projects/p/events", params={"state": "DOWN"})
        assert_error(bad, 400, "INVALID_ARGUMENT", "state")

    run(scenario)


def test_a_mirror_whose_history_was_compacted_away_reloads_a_snapshot() -> None:
    """A process that fell behind further than the store keeps history for
    (the store says Compacted) takes a new snapshot instead."""
    from healthgate.controlplane.health_service import HealthService
    from healthgate.controlplane.resources import ControlPlane
    from healthgate.store.memory import MemoryStore

    async def go() -> tuple[list[int], int, int]:
        store = MemoryStore(history=2)
        control = ControlPlane(store, HealthService())
        await control.load()  # at revision 0
        docs = [d for d in example_world() if d["kind"] == "HealthCheck"]
        for i in range(6):  # other writers, while this process is not following
            d = dict(docs[i % 2], checkIntervalSec=i + 1)
            where = f"projects/{d['project']}/regions/{d['region']}/healthChecks/{d['name']}"
            store.commit(Txn(puts={"resources/" + where: d}))
        with pytest.raises(Compacted):
            store.changes_since(0)  # what the watch from revision 0 meets
        control.start()
        await control.wait_for_revision(store.revision())
        await control.close()
        intervals = sorted(
            getattr(s.resource, "check_interval_sec", 0) for s in control.stored.values()
        )
        return intervals, store.revision(), control.revision

    intervals, store_rev, mirror_rev = run_async(go(), timeout=20)
    assert intervals == [5, 6] and mirror_rev == store_rev == 6


def test_what_get_prints_can_be_applied_back_unchanged() -> None:
    """`get -o yaml` (one resource, or the list form) is a manifest:
    server-set fields (fingerprint, selfLink, timestamps, status) are ignored."""

    async def scenario(hg: InProcessApi, api: httpx.AsyncClient) -> None:
        assert (await apply(api, example_world())).status_code == 200
        listed = (await api.get("/v1/projects/shop/regions/us-east1/backendServices")).json()
        one = (await api.get("/v1/projects/web/global/forwardingRules/shop-frontend")).json()
        assert "status" in one and "fingerprint" in one
        for doc in (listed, one):
            resp = await api.post(
                "/v1/apply",
                content=yaml.safe_dump(doc),
                headers={"Content-Type": "application/yaml"},
            )
            assert resp.status_code == 200, resp.text
            plan = resp.json()["plan"]
            assert plan["unchanged"] and not plan["create"] and not plan["update"], plan

    run(scenario)


def test_a_dry_run_shows_what_each_update_changes_field_by_field() -> None:
    async def scenario(hg: InProcessApi, api: httpx.AsyncClient) -> None:
        dicts = example_world()
        assert (await apply(api, dicts)).status_code == 200
        dicts[0]["checkIntervalSec"] = 7
        front = next(d for d in dicts if d["kind"] == "BackendService" and d["project"] == "web")
        front["backends"][1]["failoverPriority"] = 5
        resp = await apply(api, dicts, dryRun=True)
        assert resp.status_code == 200, resp.text
        diff = resp.json()["plan"]["diff"]
        assert {tuple(c.values()) for changes in diff.values() for c in changes} == {
            ("checkIntervalSec", 2, 7),
            ("backends[1].failoverPriority", None, 5),
        }

    run(scenario)


def test_metrics_parse_as_openmetrics_with_help_type_and_one_series_per_state() -> None:
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    async def scenario(hg: InProcessApi, api: httpx.AsyncClient) -> None:
        assert (await apply(api, example_world())).status_code == 200
        resp = await api.get("/metrics", headers={"Accept": "application/openmetrics-text"})
        assert resp.headers["content-type"].startswith("application/openmetrics-text")
        families = list(text_string_to_metric_families(resp.text))  # type: ignore[no-untyped-call]
        assert all(f.documentation and f.type for f in families)
        names = {f.name for f in families}
        assert {"healthgate_health_state", "healthgate_prober_lag_seconds"} <= names
        assert not any("max" in n for n in names)  # no all-time maximum gauges
        state = next(f for f in families if f.name == "healthgate_health_state")
        by_node: dict[str, list[tuple[str, float]]] = {}
        for sample in state.samples:
            by_node.setdefault(sample.labels["path"], []).append(
                (sample.labels["state"], sample.value)
            )
        assert by_node and all(
            sorted(s for s, _ in v) == ["DEGRADED", "HEALTHY", "UNHEALTHY", "UNKNOWN"]
            and sum(x for _, x in v) == 1
            for v in by_node.values()
        )
        plain = await api.get("/metrics")  # the Prometheus text format by default
        assert plain.headers["content-type"].startswith("text/plain") and "# EOF" not in plain.text

    run(scenario)


def test_apply_errors_name_the_line_of_the_field() -> None:
    async def scenario(hg: InProcessApi, api: httpx.AsyncClient) -> None:
        text = manifest(example_world()).replace(
            "healthAggregationPolicies/strict", "healthAggregationPolicies/nope", 1
        )
        line = (
            text.splitlines().index("healthAggregationPolicy: healthAggregationPolicies/nope") + 1
        )
        resp = await api.post(
            "/v1/apply", content=text, headers={"Content-Type": "application/yaml"}
        )
        err = assert_error(resp, 400, "INVALID_ARGUMENT", "healthAggregationPolicy")
        assert err["details"][0]["line"] == line

    run(scenario)


def test_the_openapi_document_types_resources_and_errors_and_docs_need_no_cdn() -> None:
    async def scenario(hg: InProcessApi, api: httpx.AsyncClient) -> None:
        doc = (await api.get("/openapi.json")).json()
        assert "422" not in str(doc)  # FastAPI's, which this API never sends
        schemas = doc["components"]["schemas"]
        assert {"HealthCheck", "ForwardingRule", "ErrorBody"} <= set(schemas)
        assert "checkIntervalSec" in schemas["HealthCheck"]["properties"]  # wire names
        for path, operations in doc["paths"].items():
            for method, op in operations.items():
                assert op["responses"]["400"]["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/ErrorBody"
                }, (path, method)
        create = doc["paths"]["/v1/projects/{project}/global/{collection}"]["post"]
        kinds = create["requestBody"]["content"]["application/json"]["schema"]["oneOf"]
        assert kinds == [
            {"$ref": "#/components/schemas/BackendService"},
            {"$ref": "#/components/schemas/ForwardingRule"},
        ]
        page = await api.get("/docs")
        assert page.status_code == 200 and "cdn" not in page.text.lower()
        assert (await api.get("/static-offline-docs/swagger-ui-bundle.js")).status_code == 200

    run(scenario)


def test_the_topology_is_one_call_and_follows_the_access_rules() -> None:
    tokens = [
        {"token": "admin-token-0123456789", "project": "*", "role": "admin"},
        {"token": "consumer-token-0123456789", "project": "web", "role": "consumer"},
    ]

    async def scenario(hg: InProcessApi, api: httpx.AsyncClient) -> None:
        admin = {"Authorization": "Bearer admin-token-0123456789"}
        consumer = {"Authorization": "Bearer consumer-token-0123456789"}
        body = {"manifest": manifest(example_world())}
        assert (await api.post("/v1/apply", json=body, headers=admin)).status_code == 200
        top = (await api.get("/v1/projects/web/topology", headers=admin)).json()
        (front,) = top["frontends"]
        assert front["name"] == "shop-frontend" and "route" in front["status"]
        assert [n["name"] for n in front["negs"]] == ["shop-us", "shop-eu"]
        producer = front["negs"][0]["producer"]
        assert producer["forwardingRule"]["name"] == "web-fr"
        (composite,) = producer["composites"]
        (source,) = composite["sources"]
        assert len(source["endpoints"]) == 4 and source["endpoints"][0]["healthState"] == "UNKNOWN"
        # a consumer sees its own NEGs, never the producer's internals
        mine = (await api.get("/v1/projects/web/topology", headers=consumer)).json()
        assert [n["producer"] for n in mine["frontends"][0]["negs"]] == ["forbidden", "forbidden"]
        refused = await api.get("/v1/projects/shop/topology", headers=consumer)
        assert refused.status_code == 403

    run(scenario, tokens)


def _just_under_the_bound(i: int) -> str:
    """A document of aliases that expands to ~670,000 nodes: under the
    bound of one document (1,000,000), a few hundred bytes."""
    return "\n".join(
        ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
        + [f"a{k}: &a{k} [" + ", ".join([f"*a{k - 1}"] * 9) + "]" for k in range(1, 5)]
        + ["kind: HealthCheck", f"name: hc-{i}", "project: p", "region: r", "type: TCP"]
        + ["port: 80", "description: [" + ", ".join(["*a4"] * 9) + "]"]
    )


def test_many_alias_documents_each_under_the_bound_are_refused_quickly() -> None:
    """Each document alone is within max_nodes; together, aliases expanded,
    they pass the manifest's max_total_nodes - refused before each is built
    and validated (which cost minutes of CPU a request, brief()'s whole
    repr of every value included)."""
    from healthgate.model.manifest import load_manifest
    from healthgate.model.names import brief
    from healthgate.model.validation import InvalidResources

    text = "\n---\n".join(_just_under_the_bound(i) for i in range(200))
    assert len(text) < 200_000
    started = time.perf_counter()
    try:
        load_manifest(text)
    except InvalidResources as exc:
        assert "together" in str(exc) and "8,000,000" in str(exc)
    else:
        raise AssertionError("200 documents of aliases loaded")
    assert time.perf_counter() - started < 5
    # the repr of an error's value is bounded as it is built
    shared: list[object] = ["x"] * 9
    for _ in range(8):
        shared = [shared] * 9  # 387 million leaves
    started = time.perf_counter()
    assert len(brief(shared)) < 200
    assert time.perf_counter() - started < 0.5
