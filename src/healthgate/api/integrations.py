"""What other data planes read (SPEC §5): a forwarding rule's composite as
200 / 503 for any load balancer's health check, and HAProxy's configuration
for a consumer front end."""

from __future__ import annotations

import ipaddress
import re
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
InstanceQ = Annotated[
    str | None,
    Query(
        max_length=63,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$",
        description="this HAProxy's name, sent with each agent check (its convergence receipts)",
    ),
]


_HOSTNAME = re.compile(
    r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*"
    r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
)


def agent_address(agent: str) -> tuple[str, int]:
    """``?agent=HOST:PORT`` checked before it goes into HAProxy's
    configuration: an IP address or a DNS name, nothing else (a space or a
    newline would add directives of the caller's choosing)."""
    host, sep, port = agent.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    valid_port = sep and port.isdigit() and 0 < int(port) < 65536
    if valid_port and host and (_is_ip(host) or _HOSTNAME.fullmatch(host)):
        return host, int(port)
    raise ControlError(
        Refusal.INVALID,
        "agent: expected HOST:PORT (an IP address or a DNS name, and a port 1-65535)",
        [Issue("agent", "HOST:PORT")],
    )


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def integrations_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["integrations"])

    @router.get("/v1/projects/{project}/regions/{region}/forwardingRules/{name}/healthz")
    async def forwarding_rule_healthz(
        project: str, region: str, name: str, authorization: Auth = None
    ) -> JSONResponse:
        """200 when the rule's composite is HEALTHY or DEGRADED (SPEC §9), else
        503; the body says the state (``healthState``, and ``state`` as SPEC
        §9 spells it) and why. Needs no token when serve runs with
        --public-healthz."""
        if not state.public_healthz:
            state.check_read(state.principal(authorization), project)
        path = state.path_of(project, region, "forwardingRules", name)
        state.stored(path)  # (NOT_FOUND when it is not there)
        health = forwarding_rule_health(state.health.engine, str(path))
        body = {
            "forwardingRule": str(path),
            "healthState": health.state,
            "state": health.state,
            "reason": health.reason,
            "lastChange": iso(health.since) if health.since is not None else None,
        }
        return JSONResponse(body, status_code=health.code, headers={"Cache-Control": "no-store"})

    @router.get(
        "/v1/projects/{project}/global/forwardingRules/{name}/haproxy",
        response_class=PlainTextResponse,
    )
    async def export_haproxy(
        project: str,
        name: str,
        authorization: Auth = None,
        agent: AgentQ = None,
        instance: InstanceQ = None,
    ) -> PlainTextResponse:
        """A backend section for HAProxy: one server per region in failover
        order, driven by this server's agent-check answers."""
        state.check_read(state.principal(authorization), project)
        address = agent_address(agent) if agent else state.agent_address
        path = state.path_of(project, GLOBAL, "forwardingRules", name)
        state.stored(path)  # (NOT_FOUND when it is not there)
        if address is None:
            raise ControlError(
                Refusal.INVALID,
                "this server runs no agent: start it with serve --agent HOST:PORT, or pass agent=",
                [Issue("agent", "no agent address")],
            )
        try:
            text = haproxy_backend(
                state.health.engine, state.control.resources, path, address, instance=instance
            )
        except ExportError as exc:
            raise ControlError(Refusal.INVALID, str(exc)) from None
        return PlainTextResponse(text)

    return router
