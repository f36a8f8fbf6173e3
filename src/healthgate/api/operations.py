"""Operations: the project list, the dashboard, liveness, readiness, metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import (
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from healthgate.api.auth import AccessError
from healthgate.api.metrics import (
    OPENMETRICS,
    PROMETHEUS,
    endpoint_series_parts,
    render_metrics,
)
from healthgate.api.state import ApiState, Auth

# the dashboard loads nothing but its own files and talks to nothing but this API
UI_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; connect-src 'self'; img-src 'self' data:; "
        b"style-src 'self' 'unsafe-inline'; frame-ancestors 'none'; base-uri 'none'; "
        b"form-action 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


class _Hardened:
    """The dashboard's files, served with UI_HEADERS."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *UI_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


def operations_router(state: ApiState, app: FastAPI) -> APIRouter:
    router = APIRouter(tags=["operations"])

    @router.get("/v1/projects", tags=["resources"])
    async def projects(authorization: Auth = None) -> dict[str, Any]:
        who = state.principal(authorization)
        names = sorted({p.project for p in state.control.stored if who.can_read(p.project)})
        return {"items": names}

    app.mount(
        "/ui",
        _Hardened(StaticFiles(directory=Path(__file__).resolve().parent.parent / "web", html=True)),
        name="ui",
    )

    @router.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui/")

    # ------------------------------------------------------------------ operations

    @router.get("/healthz", tags=["operations"], response_class=PlainTextResponse)
    async def healthz() -> str:
        return "ok\n"

    @router.get("/v1/cluster", tags=["operations"])
    async def cluster(authorization: Auth = None) -> dict[str, Any]:
        """Cluster mode: this node, the live nodes and their regions, the
        leader, how many endpoints this node probes ("mode": "embedded" when
        not clustered). The etcd member this node talks to is shown to
        admins only; a metrics token is refused."""
        principal = state.principal(authorization)
        if principal.role == "metrics":
            raise AccessError(403, "a metrics token reads /metrics only")
        if state.cluster_status is None:
            return {"mode": "embedded"}
        status = state.cluster_status()
        if principal.role != "admin":
            status.pop("etcdMember", None)  # where etcd is: admins only (SPEC §7)
        return {"mode": "cluster", **status}

    @router.get("/readyz", tags=["operations"], response_class=PlainTextResponse)
    async def readyz() -> Response:
        if not state.ready:
            return PlainTextResponse("loading\n", status_code=503)
        return PlainTextResponse("ready\n")

    @router.get("/metrics", tags=["operations"], response_class=PlainTextResponse)
    async def metrics(request: Request, authorization: Auth = None) -> Response:
        if not state.principal(authorization).can_scrape:
            raise AccessError(
                403, "/metrics needs an admin or metrics token (it lists every project)"
            )
        openmetrics = "application/openmetrics-text" in request.headers.get("accept", "")
        head = render_metrics(state.health, state.recorder, state.collectors, openmetrics)

        async def body() -> AsyncIterator[str]:
            yield head
            for part in endpoint_series_parts(state.health):  # (10k endpoints: 1.3 MB)
                await asyncio.sleep(0)  # the prober's next tick may be due
                yield part
            if openmetrics:
                yield "# EOF\n"

        return StreamingResponse(body(), media_type=OPENMETRICS if openmetrics else PROMETHEUS)

    return router
