"""The REST API (SPEC §3), served by ``healthgate serve``: the app, its one
error shape, and the routers by resource family.

* resources.py  - list / create / get / replace / delete, regional and global;
* health.py     - a backend service's endpoints;
* integrations.py - a forwarding rule's healthz, HAProxy's configuration;
* topology.py   - a project's front ends down to the endpoints, in one answer (the dashboard's);
* events.py     - the transition log, filtered and live;
* manifests.py  - ``/v1/apply`` and ``/v1/delete``;
* operations.py - projects, the dashboard, ``/healthz``, ``/readyz``, ``/metrics``.

Handlers are thin: they check access, parse, and call the control plane,
whose refusals carry a kind that api/errors.py maps to an HTTP code.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from healthgate import __version__
from healthgate.api.auth import AccessError
from healthgate.api.bodies import BodyGate, BodyLimits
from healthgate.api.browsers import BrowserGuard
from healthgate.api.capacity import RequestCapacity
from healthgate.api.convergence import convergence_router
from healthgate.api.errors import error_response, refusal_response
from healthgate.api.events import events_router
from healthgate.api.health import health_router
from healthgate.api.holds import holds_router
from healthgate.api.integrations import integrations_router
from healthgate.api.manifests import MANIFEST_PATHS, manifest_router
from healthgate.api.operations import operations_router
from healthgate.api.practice import practice_router
from healthgate.api.replay import replay_router
from healthgate.api.reports import reports_router
from healthgate.api.resources import resource_router
from healthgate.api.schema import install as install_schema
from healthgate.api.shifts import shifts_router
from healthgate.api.state import ApiSettings, ApiState
from healthgate.api.topology import topology_router
from healthgate.api.traffic import traffic_router
from healthgate.controlplane.errors import ControlError

__all__ = ["ApiSettings", "ApiState", "create_app"]


def create_app(state: ApiState) -> FastAPI:
    # /docs from assets this package ships (no CDN: it works without internet)
    app = FastAPIOffline(
        title="healthgate",
        version=__version__,
        description="Composite health and automatic cross-region failover.",
        docs_url="/docs",
        redoc_url=None,
    )
    install_schema(app)

    # ------------------------------------------------------------------ errors

    @app.exception_handler(ControlError)
    async def on_control_error(_: Request, exc: ControlError) -> Response:
        return refusal_response(exc)

    @app.exception_handler(AccessError)
    async def on_access_error(_: Request, exc: AccessError) -> Response:
        return error_response(exc.code, exc.message)

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> Response:
        details = []
        for err in exc.errors():
            loc = [
                str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "header")
            ]
            details.append({"field": ".".join(loc), "description": str(err.get("msg", ""))})
        return error_response(400, "invalid request", details)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> Response:
        return error_response(500, f"internal error: {type(exc).__name__}")

    # the health routes first: .../backendServices/{name}/health is more
    # specific than the resource routes' .../{collection}/{name}
    app.include_router(health_router(state))
    app.include_router(integrations_router(state))
    app.include_router(topology_router(state))
    app.include_router(traffic_router(state))
    app.include_router(practice_router(state))
    app.include_router(convergence_router(state))
    app.include_router(resource_router(state))
    app.include_router(events_router(state))
    app.include_router(manifest_router(state))
    app.include_router(shifts_router(state))
    app.include_router(holds_router(state))
    app.include_router(reports_router(state))
    app.include_router(replay_router(state))
    app.include_router(operations_router(state, app))

    s = state.settings

    def limit_for(path: str) -> int:
        return s.max_manifest_bytes if path in MANIFEST_PATHS else s.max_body_bytes

    limits = BodyLimits(
        limit_for, s.body_timeout, s.max_body_bytes_held, s.max_bodies_per_principal
    )
    app.add_middleware(BodyGate, access=lambda: state.access, limits=limits)
    app.add_middleware(
        RequestCapacity, max_requests=s.max_connections, reserved=s.reserved_for_health
    )
    app.add_middleware(BrowserGuard, allowed_hosts=s.allowed_hosts)  # (the outermost)
    return app
