"""The REST API (SPEC §3), served by ``healthgate serve``.

Resource routes mirror the resource paths::

    /v1/projects/{p}/regions/{r}/{collection}[/{name}]
    /v1/projects/{p}/global/{collection}[/{name}]        (backendServices, forwardingRules)

with list (GET), create (POST to the collection), get, replace (PUT) and
delete. Plus:

* ``GET  .../backendServices/{name}/health`` - every endpoint's state, last result, reason;
* ``GET  /v1/projects/{p}/events`` - the transition log, filtered;
* ``GET  /v1/projects/{p}/events/stream`` - the same, live (Server-Sent Events);
* ``POST /v1/apply`` - a manifest, atomically, or its plan with ``dryRun``;
* ``POST /v1/delete`` - every resource of a manifest, atomically;
* ``/metrics`` (Prometheus), ``/healthz``, ``/readyz``, ``/openapi.json``.

Handlers are thin: they check access, parse, and call the control plane.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from fastapi import Body, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import (
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from healthgate import __version__
from healthgate.api.auth import Access, AccessError, Principal
from healthgate.api.errors import error_response, refusal_response
from healthgate.api.metrics import endpoint_series_parts, render_metrics
from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.controlplane.health_service import HealthService
from healthgate.controlplane.offload import collector_paused, off_loop, release
from healthgate.controlplane.recorder import TransitionRecorder, iso
from healthgate.controlplane.resources import (
    ControlPlane,
    Stored,
    parse_documents,
    split_output_fields,
)
from healthgate.model.manifest import ManifestLimits, parse_manifest
from healthgate.model.names import (
    GLOBAL,
    KIND_TO_COLLECTION,
    NAME_RULE,
    ResourcePath,
    is_valid_name,
)
from healthgate.model.resources import (
    BackendService,
    ForwardingRule,
    NetworkEndpointGroup,
    Resource,
)
from healthgate.model.validation import Document, InvalidResources, Issue
from healthgate.store.base import LogQuery, Store


class RegionalCollection(StrEnum):
    healthChecks = "healthChecks"
    networkEndpointGroups = "networkEndpointGroups"
    instanceGroups = "instanceGroups"
    backendServices = "backendServices"
    healthAggregationPolicies = "healthAggregationPolicies"
    healthSources = "healthSources"
    compositeHealthChecks = "compositeHealthChecks"
    forwardingRules = "forwardingRules"
    serviceAttachments = "serviceAttachments"


class GlobalCollection(StrEnum):
    backendServices = "backendServices"
    forwardingRules = "forwardingRules"


COLLECTION_KIND = {c: k for k, c in KIND_TO_COLLECTION.items()}
MAX_PAGE = 5000

Auth = Annotated[str | None, Header(alias="Authorization")]
IfMatch = Annotated[str | None, Header(alias="If-Match")]
PageToken = Annotated[str | None, Query(alias="pageToken", max_length=63)]
MaxResults = Annotated[int, Query(alias="maxResults", ge=1, le=MAX_PAGE)]
FingerprintQ = Annotated[str | None, Query(max_length=32)]


@dataclass(frozen=True, slots=True)
class ApiSettings:
    max_body_bytes: int = 1024 * 1024
    max_manifest_bytes: int = 16 * 1024 * 1024
    stream_keepalive: float = 15.0


@dataclass(slots=True)
class ApiState:
    control: ControlPlane
    health: HealthService
    recorder: TransitionRecorder
    store: Store
    access: Access
    settings: ApiSettings = field(default_factory=ApiSettings)
    ready: bool = False
    extra_metrics: list[Callable[[], str]] = field(default_factory=list)
    dataplane_status: Callable[[], dict[str, dict[str, object]]] | None = None


class ApplyRequest(BaseModel):
    manifest: str = Field(description="a YAML stream, one resource per document")
    dryRun: bool = False


class BodyLimit:
    """Refuse request bodies over the limit (413) before reading them whole."""

    def __init__(self, app: ASGIApp, limit_for: Callable[[str], int]) -> None:
        self.app = app
        self.limit_for = limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await error_response(413, f"request body larger than {limit} bytes")(
                    scope, receive, send
                )
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(limit)
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge as exc:
            await error_response(413, f"request body larger than {exc.limit} bytes")(
                scope, receive, send
            )


class _TooLarge(Exception):
    def __init__(self, limit: int) -> None:
        self.limit = limit


def create_app(state: ApiState) -> FastAPI:
    app = FastAPI(
        title="healthgate",
        version=__version__,
        description="Composite health and automatic cross-region failover.",
        docs_url="/docs",
        redoc_url=None,
    )
    s = state.settings

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

    # ------------------------------------------------------------------ helpers

    def principal(authorization: str | None) -> Principal:
        return state.access.authenticate(authorization)

    def writer(authorization: str | None) -> Principal:
        """A principal that may write something: checked before any work
        (a viewer's manifest is never read, let alone parsed)."""
        who = principal(authorization)
        if not who.may_write:
            raise AccessError(403, f"this token ({who.role} of {who.project}) may not write")
        return who

    def check_read(who: Principal, project: str) -> None:
        if not who.can_read(project):
            raise AccessError(403, f"this token may not read project {project!r}")

    def check_write(who: Principal, res: Resource) -> None:
        psc = (
            isinstance(res, NetworkEndpointGroup)
            and res.network_endpoint_type == "PRIVATE_SERVICE_CONNECT"
        )
        if not who.can_write(res.project, res.kind, res.is_global, psc):
            raise AccessError(
                403, f"this token ({who.role} of {who.project}) may not write {res.kind} {res.path}"
            )

    def path_of(project: str, region: str, collection: str, name: str) -> ResourcePath:
        for label, value in (("project", project), ("name", name)):
            if not is_valid_name(value):
                raise ControlError(
                    Refusal.INVALID,
                    f"invalid {label} {value!r}",
                    [Issue(label, f"expected {NAME_RULE}")],
                )
        if region != GLOBAL and not is_valid_name(region):
            raise ControlError(
                Refusal.INVALID,
                f"invalid region {region!r}",
                [Issue("region", f"expected {NAME_RULE}")],
            )
        return ResourcePath(project, region, collection, name)

    def present(stored: Stored) -> dict[str, Any]:
        res = stored.resource
        out = res.to_wire()
        out["selfLink"] = str(res.path)
        out["fingerprint"] = stored.fingerprint
        out["creationTimestamp"] = iso(stored.created)
        out["updateTimestamp"] = iso(stored.updated)
        status = resource_status(res)
        if status:
            out["status"] = status
        return out

    def resource_status(res: Resource) -> dict[str, Any] | None:
        engine = state.health.engine
        path = res.path
        if isinstance(res, BackendService) and not res.is_global:
            counts = engine.counts(path)
            if counts:
                total, healthy, unknown = counts
                return {
                    "endpoints": total,
                    "healthy": healthy,
                    "unknown": unknown,
                    "unhealthy": total - healthy - unknown,
                }
            return None
        if isinstance(res, ForwardingRule):
            listener = state.dataplane_status().get(str(path)) if state.dataplane_status else None
            status = _fr_status(res)
            if status is not None and listener is not None:
                status["listener"] = listener
            return status
        node = engine.node_status(path)
        if node is None or res.kind in ("ServiceAttachment",):
            return None
        return {
            "healthState": node.state.name,
            "reason": node.reason,
            "lastChange": iso(node.since),
        }

    def _fr_status(res: ForwardingRule) -> dict[str, Any] | None:
        engine = state.health.engine
        path = res.path
        if res.is_global:
            route = engine.route_table().routes.get(str(path))
            if route is None:
                return None
            return {
                "route": {
                    "target": route.target,
                    "mode": route.mode,
                    "reason": route.reason,
                    "since": iso(route.since),
                    "fallbacks": list(route.fallbacks),
                }
            }
        dest = engine.destination_state(path)
        if dest is None:
            return {
                "healthState": "UNKNOWN",
                "reason": "no composite health check has this rule as destination",
            }
        return {
            "healthState": dest.state.name,
            "reason": dest.reason,
            "lastChange": iso(dest.since),
        }

    def body_to_document(body: Any, path: ResourcePath) -> tuple[Document, str | None]:
        if not isinstance(body, dict):
            raise ControlError(
                Refusal.INVALID, "expected a JSON object", [Issue("", "expected a JSON object")]
            )
        data, fingerprint = split_output_fields(body)
        expected = {"kind": path.kind, "project": path.project, "name": path.name}
        if path.is_global:
            data.setdefault("region", GLOBAL)
        expected["region"] = path.region
        for key, want in expected.items():
            given = data.setdefault(key, want)
            if given != want:
                raise ControlError(
                    Refusal.INVALID,
                    f"{key} {given!r} does not match the URL ({want!r})",
                    [Issue(key, f"expected {want!r} as in the URL")],
                )
        (doc,) = parse_documents([(data, None, None)])
        return doc, fingerprint

    async def list_collection(
        project: str, region: str, collection: str, page_token: str | None, max_results: int
    ) -> dict[str, Any]:
        items = sorted(
            (
                s
                for p, s in state.control.stored.items()
                if p.project == project and p.region == region and p.collection == collection
            ),
            key=lambda s: s.resource.name,
        )
        if page_token:
            items = [i for i in items if i.resource.name > page_token]
        page = items[:max_results]
        out: dict[str, Any] = {"items": [present(i) for i in page]}
        if len(items) > max_results:
            out["nextPageToken"] = page[-1].resource.name
        return out

    async def get_one(path: ResourcePath) -> dict[str, Any]:
        stored = state.control.stored.get(path)
        if stored is None:
            raise ControlError(Refusal.NOT_FOUND, f"{path} not found")
        return present(stored)

    async def create(
        path_project: str, region: str, collection: str, body: Any, who: Principal
    ) -> JSONResponse:
        name = body.get("name") if isinstance(body, dict) else None
        if not isinstance(name, str):
            raise ControlError(
                Refusal.INVALID, "name is required", [Issue("name", "required field is missing")]
            )
        path = path_of(path_project, region, collection, name)
        doc, _ = body_to_document(body, path)
        check_write(who, doc.resource)
        outcome = await state.control.apply([doc], create_only=True)
        return JSONResponse(present(outcome.stored[path]), status_code=201)

    async def replace_resource(
        path: ResourcePath, body: Any, who: Principal, if_match: str | None
    ) -> dict[str, Any]:
        doc, fingerprint = body_to_document(body, path)
        check_write(who, doc.resource)
        fp = fingerprint or if_match
        outcome = await state.control.apply(
            [doc], fingerprints={path: fp} if fp else None, replace_only=True
        )
        written = outcome.stored.get(path) or state.control.stored.get(path)
        if written is None:  # (deleted by another writer right after this one)
            raise ControlError(Refusal.NOT_FOUND, f"{path} not found")
        return present(written)

    async def delete(path: ResourcePath, who: Principal, fingerprint: str | None) -> dict[str, Any]:
        stored = state.control.stored.get(path)
        if stored is None:
            raise ControlError(Refusal.NOT_FOUND, f"{path} not found")
        check_write(who, stored.resource)
        await state.control.delete(
            [path], fingerprints={path: fingerprint} if fingerprint else None
        )
        return {"deleted": str(path)}

    # ------------------------------------------------------------------ projects and the dashboard

    @app.get("/v1/projects", tags=["resources"])
    async def projects(authorization: Auth = None) -> dict[str, Any]:
        who = principal(authorization)
        names = sorted({p.project for p in state.control.stored if who.can_read(p.project)})
        return {"items": names}

    app.mount(
        "/ui",
        StaticFiles(directory=Path(__file__).resolve().parent.parent / "web", html=True),
        name="ui",
    )

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/ui/")

    # ------------------------------------------------------------------ regional resources

    @app.get("/v1/projects/{project}/regions/{region}/{collection}", tags=["resources"])
    async def list_regional(
        project: str,
        region: str,
        collection: RegionalCollection,
        authorization: Auth = None,
        page_token: PageToken = None,
        max_results: MaxResults = 500,
    ) -> dict[str, Any]:
        check_read(principal(authorization), project)
        path_of(project, region, collection.value, "x")
        return await list_collection(project, region, collection.value, page_token, max_results)

    @app.post(
        "/v1/projects/{project}/regions/{region}/{collection}", tags=["resources"], status_code=201
    )
    async def create_regional(
        project: str,
        region: str,
        collection: RegionalCollection,
        body: Annotated[dict[str, Any], Body()],
        authorization: Auth = None,
    ) -> JSONResponse:
        return await create(project, region, collection.value, body, principal(authorization))

    @app.get("/v1/projects/{project}/regions/{region}/{collection}/{name}", tags=["resources"])
    async def get_regional(
        project: str,
        region: str,
        collection: RegionalCollection,
        name: str,
        authorization: Auth = None,
    ) -> dict[str, Any]:
        check_read(principal(authorization), project)
        return await get_one(path_of(project, region, collection.value, name))

    @app.put("/v1/projects/{project}/regions/{region}/{collection}/{name}", tags=["resources"])
    async def replace_regional(
        project: str,
        region: str,
        collection: RegionalCollection,
        name: str,
        body: Annotated[dict[str, Any], Body()],
        authorization: Auth = None,
        if_match: IfMatch = None,
    ) -> dict[str, Any]:
        return await replace_resource(
            path_of(project, region, collection.value, name),
            body,
            principal(authorization),
            if_match,
        )

    @app.delete("/v1/projects/{project}/regions/{region}/{collection}/{name}", tags=["resources"])
    async def delete_regional(
        project: str,
        region: str,
        collection: RegionalCollection,
        name: str,
        authorization: Auth = None,
        fingerprint: FingerprintQ = None,
        if_match: IfMatch = None,
    ) -> dict[str, Any]:
        return await delete(
            path_of(project, region, collection.value, name),
            principal(authorization),
            fingerprint or if_match,
        )

    # ------------------------------------------------------------------ global resources

    @app.get("/v1/projects/{project}/global/{collection}", tags=["resources"])
    async def list_global(
        project: str,
        collection: GlobalCollection,
        authorization: Auth = None,
        page_token: PageToken = None,
        max_results: MaxResults = 500,
    ) -> dict[str, Any]:
        check_read(principal(authorization), project)
        path_of(project, GLOBAL, collection.value, "x")
        return await list_collection(project, GLOBAL, collection.value, page_token, max_results)

    @app.post("/v1/projects/{project}/global/{collection}", tags=["resources"], status_code=201)
    async def create_global(
        project: str,
        collection: GlobalCollection,
        body: Annotated[dict[str, Any], Body()],
        authorization: Auth = None,
    ) -> JSONResponse:
        return await create(project, GLOBAL, collection.value, body, principal(authorization))

    @app.get("/v1/projects/{project}/global/{collection}/{name}", tags=["resources"])
    async def get_global(
        project: str, collection: GlobalCollection, name: str, authorization: Auth = None
    ) -> dict[str, Any]:
        check_read(principal(authorization), project)
        return await get_one(path_of(project, GLOBAL, collection.value, name))

    @app.put("/v1/projects/{project}/global/{collection}/{name}", tags=["resources"])
    async def replace_global(
        project: str,
        collection: GlobalCollection,
        name: str,
        body: Annotated[dict[str, Any], Body()],
        authorization: Auth = None,
        if_match: IfMatch = None,
    ) -> dict[str, Any]:
        return await replace_resource(
            path_of(project, GLOBAL, collection.value, name),
            body,
            principal(authorization),
            if_match,
        )

    @app.delete("/v1/projects/{project}/global/{collection}/{name}", tags=["resources"])
    async def delete_global(
        project: str,
        collection: GlobalCollection,
        name: str,
        authorization: Auth = None,
        fingerprint: FingerprintQ = None,
        if_match: IfMatch = None,
    ) -> dict[str, Any]:
        return await delete(
            path_of(project, GLOBAL, collection.value, name),
            principal(authorization),
            fingerprint or if_match,
        )

    # ------------------------------------------------------------------ health of a backend service

    @app.get(
        "/v1/projects/{project}/regions/{region}/backendServices/{name}/health", tags=["health"]
    )
    async def backend_health(
        project: str, region: str, name: str, authorization: Auth = None
    ) -> dict[str, Any]:
        who = principal(authorization)
        check_read(who, project)
        path = path_of(project, region, "backendServices", name)
        if path not in state.control.stored:
            raise ControlError(Refusal.NOT_FOUND, f"{path} not found")
        engine = state.health.engine
        items = []
        for ep in engine.endpoints(path):
            last = ep.last_result
            items.append(
                {
                    "ipAddress": ep.ip,
                    "port": ep.port,
                    "healthState": ep.state.name,
                    "reason": ep.reason,
                    "lastChange": iso(ep.since),
                    "lastResult": None
                    if last is None
                    else {
                        "outcome": last.outcome.name,
                        "latencyMs": round(last.latency * 1000, 3),
                        "status": last.status or None,
                        "detail": last.detail or None,
                        "description": last.describe(),
                        "time": iso(ep.last_time) if ep.last_time is not None else None,
                    },
                }
            )
        counts = engine.counts(path) or (0, 0, 0)
        return {
            "backendService": str(path),
            "endpoints": counts[0],
            "healthy": counts[1],
            "unknown": counts[2],
            "healthStatus": items,
        }

    # ------------------------------------------------------------------ events

    def log_query(
        project: str,
        who: Principal,
        resource: str | None,
        kind: str | None,
        state_: str | None,
        since: float | None,
        until: float | None,
        after: int,
        limit: int,
    ) -> LogQuery:
        check_read(who, project)
        return LogQuery(
            project=project,
            path_prefix=resource,
            kind=kind,
            state=state_,
            since=since,
            until=until,
            after_id=after,
            limit=limit,
            kinds=who.event_kinds(),
        )

    @app.get("/v1/projects/{project}/events", tags=["events"])
    async def events(
        project: str,
        authorization: Auth = None,
        resource: Annotated[
            str | None, Query(max_length=512, description="a resource path or prefix")
        ] = None,
        kind: Annotated[str | None, Query(max_length=64)] = None,
        state_: Annotated[str | None, Query(alias="state", max_length=16)] = None,
        since: Annotated[float | None, Query(ge=0, le=1e12, description="epoch seconds")] = None,
        until: Annotated[float | None, Query(ge=0, le=1e12)] = None,
        after: Annotated[int, Query(ge=0, le=2**62)] = 0,
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    ) -> dict[str, Any]:
        q = log_query(
            project, principal(authorization), resource, kind, state_, since, until, after, limit
        )
        entries = await asyncio.to_thread(state.store.query_log, q)
        return {
            "items": [{"id": e.id, **e.record} for e in entries],
            "last": entries[-1].id if entries else after,
        }

    @app.get(
        "/v1/projects/{project}/events/stream", tags=["events"], response_class=StreamingResponse
    )
    async def event_stream(
        project: str,
        authorization: Auth = None,
        resource: Annotated[str | None, Query(max_length=512)] = None,
        kind: Annotated[str | None, Query(max_length=64)] = None,
        state_: Annotated[str | None, Query(alias="state", max_length=16)] = None,
        after: Annotated[int | None, Query(ge=0, le=2**62)] = None,
        last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
        access_token: Annotated[
            str | None,
            Query(max_length=512, description="for EventSource, which cannot send headers"),
        ] = None,
        tail: Annotated[
            int | None,
            Query(ge=0, le=10000, description="first replay about this many recent records"),
        ] = None,
    ) -> StreamingResponse:
        who = principal(authorization or (f"Bearer {access_token}" if access_token else None))
        if tail is not None and after is None and not last_event_id:
            after = max(
                0, state.recorder.last_id - tail
            )  # recent history first (ids span projects)
        start = (
            after
            if after is not None
            else (int(last_event_id) if last_event_id and last_event_id.isdigit() else None)
        )
        if start is None:
            start = state.recorder.last_id  # from now on
        q = log_query(project, who, resource, kind, state_, None, None, start, 1000)
        return StreamingResponse(
            stream(q),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def matches(q: LogQuery, record: dict[str, Any]) -> bool:
        if record.get("project") != q.project:
            return False
        if q.kind and record.get("kind") != q.kind:
            return False
        if q.kinds is not None and record.get("kind") not in q.kinds:
            return False
        if q.state and str(record.get("to")) != q.state:
            return False
        path = record.get("path") or record.get("frontend") or ""
        return not (q.path_prefix and not str(path).startswith(q.path_prefix))

    async def stream(q: LogQuery) -> AsyncIterator[bytes]:
        queue = state.recorder.subscribe()
        last = q.after_id
        try:
            yield b": healthgate event stream\n\n"
            while True:  # replay what is stored after `last`
                batch = await asyncio.to_thread(state.store.query_log, replace(q, after_id=last))
                for e in batch:
                    last = e.id
                    yield sse(e.id, e.record)
                if len(batch) < q.limit:
                    break
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), s.stream_keepalive)
                except TimeoutError:
                    yield b": keepalive\n\n"
                    continue
                if item is None:
                    yield b'event: error\ndata: {"message": "subscriber too slow; reconnect with Last-Event-ID"}\n\n'
                    return
                event_id, record = item
                if event_id <= last or not matches(q, record):
                    continue
                last = event_id
                yield sse(event_id, record)
        finally:
            state.recorder.unsubscribe(queue)

    # ------------------------------------------------------------------ manifests

    async def read_manifest(request: Request) -> tuple[str, bool]:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        raw = await request.body()
        if ctype in ("application/yaml", "application/x-yaml", "text/yaml"):
            return raw.decode("utf-8", errors="replace"), request.query_params.get(
                "dryRun", ""
            ).lower() in ("1", "true")
        try:
            req = ApplyRequest.model_validate_json(raw)
        except Exception as exc:
            raise ControlError(
                Refusal.INVALID,
                'expected {"manifest": "<YAML>", "dryRun": false} or an application/yaml body',
                [Issue("manifest", str(exc).splitlines()[0])],
            ) from None
        return req.manifest, req.dryRun

    def parse_for(text: str, who: Principal) -> list[Document]:
        try:
            docs = parse_manifest(text, ManifestLimits(max_bytes=s.max_manifest_bytes))
        except InvalidResources as exc:
            raise ControlError(Refusal.INVALID, "invalid manifest", exc.issues) from None
        for d in docs:
            try:
                check_write(who, d.resource)
            except AccessError as exc:
                raise AccessError(403, f"document {d.index}: {exc.message}") from None
        return docs

    async def manifest_documents(text: str, who: Principal) -> list[Document]:
        # parsing is CPU work (seconds for megabytes): off the event loop
        return await off_loop(parse_for, text, who)

    apply_body = {
        "requestBody": {
            "content": {
                "application/json": {"schema": ApplyRequest.model_json_schema()},
                "application/yaml": {"schema": {"type": "string"}},
            },
            "required": True,
        }
    }

    @app.post("/v1/apply", tags=["manifests"], openapi_extra=apply_body)
    async def apply(request: Request, authorization: Auth = None) -> Response:
        who = writer(authorization)
        text, dry_run = await read_manifest(request)
        with collector_paused:  # (see offload.py: the big objects die inside)
            docs = await manifest_documents(text, who)
            outcome = await state.control.apply(docs, dry_run=dry_run)
            body = {
                "dryRun": dry_run,
                "plan": outcome.plan.to_dict(),
                "revision": outcome.revision,
                "fingerprints": outcome.fingerprints,
            }
            # freeing a parsed world is work too (a million objects: ~80 ms):
            # the last references are dropped in a worker thread, piece by piece
            garbage: list[object] = [text, docs, outcome]  # (outcome first)
            del docs, outcome, text
            await off_loop(release, garbage)
            return await json_response(body)

    @app.post("/v1/delete", tags=["manifests"], openapi_extra=apply_body)
    async def delete_manifest(request: Request, authorization: Auth = None) -> dict[str, Any]:
        who = writer(authorization)
        text, dry_run = await read_manifest(request)
        docs = await manifest_documents(text, who)
        outcome = await state.control.delete([d.resource.path for d in docs], dry_run=dry_run)
        return {"dryRun": dry_run, "plan": outcome.plan.to_dict(), "revision": outcome.revision}

    # ------------------------------------------------------------------ operations

    @app.get("/healthz", tags=["operations"], response_class=PlainTextResponse)
    async def healthz() -> str:
        return "ok\n"

    @app.get("/readyz", tags=["operations"], response_class=PlainTextResponse)
    async def readyz() -> Response:
        if not state.ready:
            return PlainTextResponse("loading\n", status_code=503)
        return PlainTextResponse("ready\n")

    @app.get("/metrics", tags=["operations"], response_class=PlainTextResponse)
    async def metrics() -> Response:
        head = render_metrics(state.health, state.recorder) + "".join(
            f() for f in state.extra_metrics
        )

        async def body() -> AsyncIterator[str]:
            yield head
            for part in endpoint_series_parts(state.health):  # (10k endpoints: 1.3 MB)
                await asyncio.sleep(0)  # the prober's next tick may be due
                yield part

        return StreamingResponse(body(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def limit_for(path: str) -> int:
        return s.max_manifest_bytes if path in ("/v1/apply", "/v1/delete") else s.max_body_bytes

    app.add_middleware(BodyLimit, limit_for=limit_for)
    return app


async def json_response(body: Any) -> Response:
    """A large answer (a plan of thousands of paths) encoded off the event loop."""
    content = await off_loop(json.dumps, body, separators=(",", ":"))
    return Response(content, media_type="application/json")


def sse(event_id: int, record: Mapping[str, Any]) -> bytes:
    return f"id: {event_id}\nevent: transition\ndata: {json.dumps(record, separators=(',', ':'))}\n\n".encode()
