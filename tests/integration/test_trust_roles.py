"""Who may change what, as a token of a project that both publishes and
consumes would try it (issue 38): a consumer token's region shift covers its
own PSC NEGs only, a replace or delete checks what is stored, and the shift
safety rule holds for two shifts sent at once."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
import yaml

from tests.helpers import example_dicts, run_async
from tests.inprocess import InProcessApi

ADMIN = {"token": "a" * 24, "project": "*", "role": "admin"}
SHOP_PRODUCER = {"token": "p" * 24, "project": "shop", "role": "producer"}
SHOP_CONSUMER = {"token": "c" * 24, "project": "shop", "role": "consumer"}
WEB_CONSUMER = {"token": "w" * 24, "project": "web", "role": "consumer"}
TOKENS = [ADMIN, SHOP_PRODUCER, SHOP_CONSUMER, WEB_CONSUMER]


def auth(token: dict[str, str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {token['token']}"}


async def world(api: InProcessApi) -> httpx.AsyncClient:
    client = api.client
    assert client is not None
    r = await client.post(
        "/v1/apply", json={"manifest": yaml.safe_dump_all(example_dicts())}, headers=auth(ADMIN)
    )
    assert r.status_code == 200, r.text
    return client


def shift(away: str, comment: str = "maintenance") -> dict[str, Any]:
    return {"awayFrom": away, "expiresInSec": 600, "comment": comment}


def test_a_consumer_tokens_region_shift_never_moves_the_producers_consumers() -> None:
    async def go() -> None:
        async with InProcessApi(TOKENS) as api:
            client = await world(api)
            # project shop publishes in us-east1 and has no PSC NEG there: a
            # consumer token of shop has nothing of its own to shift away
            r = await client.post(
                "/v1/projects/shop/shifts", json=shift("us-east1"), headers=auth(SHOP_CONSUMER)
            )
            assert r.status_code == 400, r.text
            assert "no PSC NEG" in r.json()["error"]["message"]
            # the producer's token moves its consumers (web's NEG) away
            r = await client.post(
                "/v1/projects/shop/shifts", json=shift("us-east1"), headers=auth(SHOP_PRODUCER)
            )
            assert r.status_code == 201, r.text
            assert r.json()["affectsOtherProjects"] == 1

    run_async(go())


def test_a_producer_shifts_one_attachment_by_its_path() -> None:
    async def go() -> None:
        async with InProcessApi(TOKENS) as api:
            client = await world(api)
            full = "projects/shop/regions/us-east1/serviceAttachments/web-attachment"
            r = await client.post(
                "/v1/projects/shop/shifts", json=shift(full), headers=auth(SHOP_PRODUCER)
            )
            assert r.status_code == 201, r.text
            assert r.json()["awayFrom"] == full
            assert r.json()["affectsOtherProjects"] == 1  # web's NEG of us-east1
            # a partial path: the other region's attachment - which would leave
            # the consumer's front end nothing, so the safety rule refuses it
            partial = "regions/europe-west1/serviceAttachments/web-attachment"
            r = await client.post(
                "/v1/projects/shop/shifts", json=shift(partial), headers=auth(SHOP_PRODUCER)
            )
            assert r.status_code == 409, r.text
            assert "safety rule" in r.json()["error"]["message"]

    run_async(go())


def test_two_shifts_at_once_are_checked_against_each_other() -> None:
    """Each alone leaves the front end a region; both would leave none: the
    rule is checked inside the write, so the second sees the first."""

    async def go() -> list[int]:
        async with InProcessApi(TOKENS) as api:
            client = await world(api)
            posts = [
                client.post(
                    "/v1/projects/web/shifts",
                    json=shift(f"projects/web/regions/{region}/networkEndpointGroups/{neg}"),
                    headers=auth(WEB_CONSUMER),
                )
                for region, neg in (("us-east1", "shop-us"), ("europe-west1", "shop-eu"))
            ]
            answers = await asyncio.gather(*posts)
            return sorted(r.status_code for r in answers)

    assert run_async(go()) == [201, 409]


def hook(events: list[dict[str, str]] | None, url: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": "Webhook",
        "project": "shop",
        "name": "alerts",
        "url": url,
        "secret": "0123456789abcdef0123",
    }
    if events is not None:
        out["events"] = events
    return out


def test_a_consumer_token_may_not_redirect_or_delete_the_producers_webhook() -> None:
    async def go() -> None:
        async with InProcessApi(TOKENS) as api:
            client = await world(api)
            producer_hook = hook(None, "http://10.0.0.9:8000/producer")  # every record
            r = await client.post(
                "/v1/apply",
                json={"manifest": yaml.safe_dump(producer_hook)},
                headers=auth(SHOP_PRODUCER),
            )
            assert r.status_code == 200, r.text
            stolen = copy.deepcopy(producer_hook)
            stolen["url"] = "http://10.6.6.6:8000/attacker"
            stolen["events"] = [{"kind": "Route"}]  # (what a consumer may read)
            path = "/v1/projects/shop/global/webhooks/alerts"
            for attempt in (
                client.post(
                    "/v1/apply",
                    json={"manifest": yaml.safe_dump(stolen)},
                    headers=auth(SHOP_CONSUMER),
                ),
                client.put(path, json=stolen, headers=auth(SHOP_CONSUMER)),
                client.delete(path, headers=auth(SHOP_CONSUMER)),
                client.post(
                    "/v1/delete",
                    json={"manifest": yaml.safe_dump(stolen)},
                    headers=auth(SHOP_CONSUMER),
                ),
            ):
                r = await attempt
                assert r.status_code == 403, r.text
            r = await client.get(path, headers=auth(SHOP_PRODUCER))
            assert r.json()["url"] == "http://10.0.0.9:8000/producer"
            # a webhook of the consumer's own kinds stays the consumer's to change
            own = hook([{"kind": "Route"}], "http://10.0.0.8:8000/consumer")
            own["name"] = "mine"
            for url in ("http://10.0.0.8:8000/consumer", "http://10.0.0.8:8000/moved"):
                own["url"] = url
                r = await client.post(
                    "/v1/apply",
                    json={"manifest": yaml.safe_dump(own)},
                    headers=auth(SHOP_CONSUMER),
                )
                assert r.status_code == 200, r.text

    run_async(go())


def test_failover_storm_holds_are_seen_by_readers_and_released_by_admins_only() -> None:
    from healthgate.health.storms import StormSettings
    from tests.helpers import REFUSED

    metrics = {"token": "m" * 24, "project": "*", "role": "metrics"}

    async def go() -> None:
        async with InProcessApi([*TOKENS, metrics]) as api:
            client = await world(api)
            engine = api.health.engine
            engine.set_storm_settings(StormSettings(30))
            targets = sorted(engine.targets(), key=lambda t: (t.ip.split(".")[3], t.ip))
            for _ in range(3):  # both regions' probes fail in one tick
                for t in targets:
                    api.health.emit(engine.on_result(1.0, t.slot, REFUSED))
            r = await client.get("/v1/holds", headers=auth(WEB_CONSUMER))
            assert r.status_code == 200, r.text
            [hold] = r.json()["items"]
            assert (await client.get("/v1/holds", headers=auth(metrics))).status_code == 403
            url = f"/v1/holds/{hold['name']}:release"
            for token in (WEB_CONSUMER, SHOP_PRODUCER):
                r = await client.post(url, headers=auth(token))
                assert r.status_code == 403, r.text
            r = await client.post("/v1/holds/Not_A_Hold:release", headers=auth(ADMIN))
            assert r.status_code == 400 and "hold" in r.json()["error"]["message"]
            r = await client.post(url, headers=auth(ADMIN))
            assert r.status_code == 200, r.text
            assert (await client.post(url, headers=auth(ADMIN))).status_code == 404
            assert (await client.get("/v1/holds", headers=auth(ADMIN))).json()["items"] == []

    run_async(go())
