"""Resource routes: list, create, get, replace, delete - one handler each,
served on both the regional and the global paths::

    /v1/projects/{p}/regions/{r}/{collection}[/{name}]
    /v1/projects/{p}/global/{collection}[/{name}]        (backendServices, forwardingRules, webhooks)

Each operation is written once in :func:`_register`; it is registered for
each scope with that scope's location dependency (which reads ``region`` from
the path, or is ``global``) and collection enum.

(No ``from __future__ import annotations`` here: FastAPI reads the handlers'
annotations, which name the scope's types from the enclosing function.)
"""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Path
from starlette.responses import JSONResponse

from healthgate.api.convergence import with_peers
from healthgate.api.state import (
    ApiState,
    Auth,
    FingerprintQ,
    IfMatch,
    MaxResults,
    PageToken,
)
from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.model.names import GLOBAL
from healthgate.model.validation import Issue


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
    secrets = "secrets"


class GlobalCollection(StrEnum):
    backendServices = "backendServices"
    forwardingRules = "forwardingRules"
    webhooks = "webhooks"
    secrets = "secrets"
    practiceRuns = "practiceRuns"


@dataclass(frozen=True, slots=True)
class Location:
    project: str
    region: str  # "global" for global resources


def regional(project: str, region: str) -> Location:
    return Location(project, region)


def global_(project: str) -> Location:
    return Location(project, GLOBAL)


SCOPES: tuple[tuple[str, Callable[..., Location], type[StrEnum]], ...] = (
    ("/v1/projects/{project}/regions/{region}", regional, RegionalCollection),
    ("/v1/projects/{project}/global", global_, GlobalCollection),
)


def resource_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["resources"])
    for prefix, location, collections in SCOPES:
        _register(router, state, prefix, location, collections)
    return router


def _register(
    router: APIRouter,
    state: ApiState,
    prefix: str,
    location: Callable[..., Location],
    collections: type[StrEnum],
) -> None:
    Where = Annotated[Location, Depends(location)]
    Collection = Annotated[collections, Path()]  # type: ignore[valid-type]

    def path_of(where: Location, collection: Any, name: str) -> Any:
        return state.path_of(where.project, where.region, str(collection), name)

    async def list_resources(
        where: Where,
        collection: Collection,
        authorization: Auth = None,
        page_token: PageToken = None,
        max_results: MaxResults = 500,
    ) -> dict[str, Any]:
        state.check_read(state.principal(authorization), where.project)
        path_of(where, collection, "x")  # (checks project and region)
        items = sorted(
            (
                s
                for p, s in state.control.stored.items()
                if p.project == where.project
                and p.region == where.region
                and p.collection == str(collection)
            ),
            key=lambda s: s.resource.name,
        )
        if page_token:
            items = [i for i in items if i.resource.name > page_token]
        page = items[:max_results]
        out: dict[str, Any] = {"items": [state.present(i) for i in page]}
        if len(items) > max_results:
            out["nextPageToken"] = page[-1].resource.name
        return out

    async def create_resource(
        where: Where,
        collection: Collection,
        body: Annotated[dict[str, Any], Body()],
        authorization: Auth = None,
    ) -> JSONResponse:
        who = state.principal(authorization)
        name = body.get("name") if isinstance(body, dict) else None
        if not isinstance(name, str):
            raise ControlError(
                Refusal.INVALID, "name is required", [Issue("name", "required field is missing")]
            )
        path = path_of(where, collection, name)
        doc, _ = state.body_to_document(body, path)
        state.check_document(who, doc)
        outcome = await state.control.apply([doc], create_only=True)
        await state.audit(who, "create", outcome.plan)
        return JSONResponse(state.present(outcome.stored[path]), status_code=201)

    async def get_resource(
        where: Where, collection: Collection, name: str, authorization: Auth = None
    ) -> dict[str, Any]:
        state.check_read(state.principal(authorization), where.project)
        body = state.present(state.stored(path_of(where, collection, name)))
        if collection == "forwardingRules" and where.region == GLOBAL and state.peers is not None:
            body = await with_peers(state, body, authorization)  # (SPEC §11, cluster mode)
        return body

    async def replace_resource(
        where: Where,
        collection: Collection,
        name: str,
        body: Annotated[dict[str, Any], Body()],
        authorization: Auth = None,
        if_match: IfMatch = None,
    ) -> dict[str, Any]:
        who = state.principal(authorization)
        path = path_of(where, collection, name)
        doc, fingerprint = state.body_to_document(body, path)
        state.check_document(who, doc)
        fp = fingerprint or if_match
        outcome = await state.control.apply(
            [doc], fingerprints={path: fp} if fp else None, replace_only=True
        )
        await state.audit(who, "replace", outcome.plan)
        # (as written; NOT_FOUND if another writer deleted it right after)
        return state.present(outcome.stored.get(path) or state.stored(path))

    async def delete_resource(
        where: Where,
        collection: Collection,
        name: str,
        authorization: Auth = None,
        fingerprint: FingerprintQ = None,
        if_match: IfMatch = None,
    ) -> dict[str, Any]:
        who = state.principal(authorization)
        path = path_of(where, collection, name)
        state.check_may_change(who, state.stored(path).resource)
        fp = fingerprint or if_match
        outcome = await state.control.delete([path], fingerprints={path: fp} if fp else None)
        await state.audit(who, "delete", outcome.plan)
        return {"deleted": str(path)}

    routes: list[tuple[str, str, Callable[..., Awaitable[Any]], int]] = [
        ("GET", "/{collection}", list_resources, 200),
        ("POST", "/{collection}", create_resource, 201),
        ("GET", "/{collection}/{name}", get_resource, 200),
        ("PUT", "/{collection}/{name}", replace_resource, 200),
        ("DELETE", "/{collection}/{name}", delete_resource, 200),
    ]
    scope = "global" if location is global_ else "regional"
    for method, suffix, handler, status in routes:
        router.add_api_route(
            prefix + suffix,
            handler,
            methods=[method],
            status_code=status,
            name=f"{handler.__name__}_{scope}",
            operation_id=f"{handler.__name__}_{scope}",
        )
