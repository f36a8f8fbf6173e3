"""The integrations' own surfaces, with real sockets: HAProxy's agent
protocol, a forwarding rule's healthz (API in-process), the export."""

from __future__ import annotations

import asyncio
from typing import Any

from healthgate.health.states import Outcome, ProbeResult
from healthgate.integrations.agent import AgentServer, neg_path
from tests.helpers import example_world, run_async
from tests.inprocess import InProcessApi
from tests.integration.test_api import manifest


async def ask(port: int, payload: bytes, close_write: bool = False) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    if close_write:
        writer.write_eof()
    data = await asyncio.wait_for(reader.read(100), 5)
    writer.close()
    return data


def test_agent_answers_per_neg_and_refuses_garbage_politely() -> None:
    states = {neg_path("web/us-east1/shop-us"): "down", neg_path("web/eu/shop-eu"): "up"}

    async def scenario() -> list[bytes]:
        agent = AgentServer(lambda p: states.get(p, "maint"), "127.0.0.1", 0, read_timeout=0.5)
        await agent.start()
        try:
            return [
                await ask(agent.port, b"web/us-east1/shop-us\n"),
                await ask(agent.port, b"web/eu/shop-eu"),  # no newline (HAProxy's agent-send)
                await ask(agent.port, b"web/eu/unknown\n"),
                await ask(agent.port, b"../../etc/passwd\n"),
                await ask(agent.port, b"x" * 5000),  # over the line limit: answered, closed
                await ask(agent.port, b""),  # says nothing: closed after read_timeout
            ]
        finally:
            await agent.close()

    answers = run_async(scenario(), timeout=20)
    assert answers == [b"down\n", b"up ready\n", b"maint\n", b"maint\n", b"maint\n", b""]


def test_forwarding_rule_healthz_is_200_only_when_the_composite_is_healthy() -> None:
    async def scenario(hg: InProcessApi) -> list[tuple[int, Any]]:
        api = hg.client
        assert api is not None
        dicts = example_world("shop", "web")
        assert (await api.post("/v1/apply", json={"manifest": manifest(dicts)})).status_code == 200
        url = "/v1/projects/shop/regions/us-east1/forwardingRules/web-fr/healthz"
        out = []
        r = await api.get(url)
        out.append((r.status_code, r.json()["healthState"]))  # nothing probed yet: UNKNOWN
        engine = hg.health.engine
        bs = next(p for p in engine.backend_services() if p.region == "us-east1")
        for outcome in (Outcome.OK, Outcome.TIMEOUT):
            for t in engine.targets():
                if t.backend_service == bs:
                    for _ in range(3):
                        engine.on_result(1.0, t.slot, ProbeResult(outcome, 0.01, 200))
            r = await api.get(url)
            out.append((r.status_code, r.json()["healthState"]))
        missing = await api.get(url.replace("web-fr", "nope"))
        out.append((missing.status_code, missing.json()["error"]["status"]))
        return out

    async def go() -> Any:
        async with InProcessApi() as hg:
            return await scenario(hg)

    assert run_async(go(), timeout=30) == [
        (503, "UNKNOWN"),
        (200, "HEALTHY"),
        (503, "UNHEALTHY"),
        (404, "NOT_FOUND"),
    ]


def test_healthz_needs_a_token_unless_public() -> None:
    tokens = [{"token": "admin-token-0123456789", "project": "*", "role": "admin"}]
    url = "/v1/projects/shop/regions/us-east1/forwardingRules/web-fr/healthz"

    async def go(public: bool) -> tuple[int, int]:
        async with InProcessApi(tokens, public_healthz=public) as hg:
            api = hg.client
            assert api is not None
            auth = {"Authorization": "Bearer admin-token-0123456789"}
            body = {"manifest": manifest(example_world("shop", "web"))}
            assert (await api.post("/v1/apply", json=body, headers=auth)).status_code == 200
            anonymous = (await api.get(url)).status_code
            other = (await api.get("/v1/projects/shop/regions/us-east1/healthChecks")).status_code
            return anonymous, other

    assert run_async(go(False)) == (401, 401)
    assert run_async(go(True)) == (503, 401)  # the one path only; UNKNOWN until probed
