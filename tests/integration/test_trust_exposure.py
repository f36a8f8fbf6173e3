"""What the API tells and costs, per caller (SPEC §7, the low findings):
where etcd is, what goes into an HAProxy configuration from a query, and
how many manifests are read at once."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from healthgate.api.state import ApiSettings
from tests.helpers import run_async
from tests.inprocess import InProcessApi

ADMIN = {"token": "a" * 24, "project": "*", "role": "admin"}
VIEWER = {"token": "v" * 24, "project": "shop", "role": "viewer"}
METRICS = {"token": "m" * 24, "project": "*", "role": "metrics"}
PRODUCER = {"token": "p" * 24, "project": "shop", "role": "producer"}


def bearer(entry: dict[str, str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {entry['token']}"}


def test_cluster_status_hides_etcd_from_all_but_admins() -> None:
    async def go() -> None:
        async with InProcessApi([ADMIN, VIEWER, METRICS]) as hg:
            assert hg.client is not None and hg.state is not None
            hg.state.cluster_status = lambda: {
                "node": "n1",
                "leading": True,
                "etcdMember": "https://10.0.0.5:2379",
            }
            admin = (await hg.client.get("/v1/cluster", headers=bearer(ADMIN))).json()
            assert admin["etcdMember"] == "https://10.0.0.5:2379"
            viewer = await hg.client.get("/v1/cluster", headers=bearer(VIEWER))
            assert viewer.status_code == 200
            assert viewer.json()["leading"] and "etcdMember" not in viewer.json()
            assert "10.0.0.5" not in viewer.text
            metrics = await hg.client.get("/v1/cluster", headers=bearer(METRICS))
            assert metrics.status_code == 403 and "10.0.0.5" not in metrics.text

    run_async(go(), timeout=30)


@pytest.mark.parametrize(
    "agent",
    [
        "127.0.0.1:9000\n    server evil 10.0.0.9:80",  # a directive of the caller's
        "127.0.0.1 weight 0:9000",
        "host name:9000",
        "127.0.0.1:0",
        "127.0.0.1:65536",
        ":9000",
        "127.0.0.1",
        "a..b:9000",
        "-bad.example:9000",
        "127.0.0.1:9000\r",
    ],
)
def test_haproxy_export_refuses_an_agent_that_is_not_host_and_port(agent: str) -> None:
    async def go() -> None:
        async with InProcessApi() as hg:
            assert hg.client is not None
            url = "/v1/projects/web/global/forwardingRules/front/haproxy"
            resp = await hg.client.get(url, params={"agent": agent})
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["details"][0]["field"] == "agent"

    run_async(go(), timeout=30)


def test_haproxy_export_accepts_addresses_and_names() -> None:
    async def go() -> None:
        async with InProcessApi() as hg:
            assert hg.client is not None
            url = "/v1/projects/web/global/forwardingRules/front/haproxy"
            for agent in ("127.0.0.1:9000", "[::1]:9000", "agent.internal.example:9000"):
                resp = await hg.client.get(url, params={"agent": agent})
                assert resp.status_code == 404, (agent, resp.text)  # checked, then looked up

    run_async(go(), timeout=30)


def test_manifests_are_read_whole_before_they_wait_for_a_slot() -> None:
    """A manifest's body is read (within the body deadline and the bytes
    every body may hold: api/bodies.py) before it takes a slot - so a slow
    body holds no slot while it trickles in (issue 38); one that waits too
    long for a slot gets 503, and the slot is given back either way."""
    settings = ApiSettings(manifests_at_once=1, manifest_wait=0.3)
    read: list[bytes] = []

    async def body() -> AsyncIterator[bytes]:
        read.append(b"x")
        yield b'{"manifest": ""}'

    async def go() -> None:
        async with InProcessApi([ADMIN, PRODUCER], settings=settings) as hg:
            assert hg.client is not None and hg.state is not None
            await hg.state.manifest_slots.acquire()  # another manifest at work
            resp = await hg.client.post(
                "/v1/apply",
                content=body(),
                headers={**bearer(PRODUCER), "Content-Type": "application/json"},
            )
            assert resp.status_code == 503, resp.text
            assert "try again" in resp.json()["error"]["message"]
            assert read == [b"x"]  # read first, then it waited
            hg.state.manifest_slots.release()
            parsed = await hg.client.post(
                "/v1/apply",
                content=body(),
                headers={**bearer(PRODUCER), "Content-Type": "application/json"},
            )
            assert "holds no resources" in parsed.text  # read and parsed this time
            assert read == [b"x", b"x"]
            # the slot is given back after each manifest, refused or not
            assert not hg.state.manifest_slots.locked()
            assert hg.state.token_slots == {}

    run_async(go(), timeout=30)
