"""What other data planes read (SPEC §5): a forwarding rule's composite as
200 / 503 for any load balancer's health check, and HAProxy's configuration
for a consumer front end."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from starlette.responses import JSONResponse, PlainTextResponse

from healthgate.api.state import ApiState, Auth
from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.controlplane.recorder import iso
from healthgate.integrations.haproxy import ExportError, haproxy_backend
from healthgate.integrations.verdicts import forwarding_rule_health
from healthgate.model.names import GLOBAL
from healthgate.model.validation import Issue

AgentQ = Annotated[
    str | None,
    Query(max_length=300, description="the agent's HOST:PORT (default: this server's --agent)"),
]


def integrations_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["integrations"])

    @router.get("/v1/projects/{project}/regions/{region}/forwardingRules/{name}/healthz")
    async def forwarding_rule_healthz(
        project: str, region: str, name: str, authorization: Auth = None
    ) -> JSONResponse:
        """200 when the rule's composite is HEALTHY, else 503; the body says
        the state and why. Needs no token when serve runs with --public-healthz."""
        if not state.public_healthz:
            state.check_read(state.principal(authorization), project)
        path = state.path_of(project, region, "forwardingRules", name)
        state.stored(path)  # (NOT_FOUND when it is not there)
        health = forwarding_rule_health(state.health.engine, str(path))
        body = {
            "forwardingRule": str(path),
            "healthState": health.state,
            "reason": health.reason,
            "lastChange": iso(health.since) if health.since is not None else None,
        }
        return JSONResponse(body, status_code=health.code, headers={"Cache-Control": "no-store"})

    @router.get(
        "/v1/projects/{project}/global/forwardingRules/{name}/haproxy",
        response_class=PlainTextResponse,
    )
    async def export_haproxy(
        project: str, name: str, authorization: Auth = None, agent: AgentQ = None
    ) -> PlainTextResponse:
        """A backend section for HAProxy: one server per region in failover
        order, driven by this server's agent-check answers."""
        state.check_read(state.principal(authorization), project)
        path = state.path_of(project, GLOBAL, "forwardingRules", name)
        state.stored(path)  # (NOT_FOUND when it is not there)
        address = state.agent_address
        if agent:
            host, sep, port = agent.rpartition(":")
            if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
                raise ControlError(
                    Refusal.INVALID, "agent: expected HOST:PORT", [Issue("agent", "HOST:PORT")]
                )
            address = (host.strip("[]"), int(port))
        if address is None:
            raise ControlError(
                Refusal.INVALID,
                "this server runs no agent: start it with serve --agent HOST:PORT, or pass agent=",
                [Issue("agent", "no agent address")],
            )
        try:
            text = haproxy_backend(state.health.engine, state.control.resources, path, address)
        except ExportError as exc:
            raise ControlError(Refusal.INVALID, str(exc)) from None
        return PlainTextResponse(text)

    return router
