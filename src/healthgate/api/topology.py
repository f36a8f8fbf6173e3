"""The topology of a project's front ends in one answer, for the dashboard.

``GET /v1/projects/{p}/topology``: every global forwarding rule of the
project with its route, and for each of its PSC NEGs (in the backend
service's order) the NEG's state and, when the caller may read the
producer's project, the producer's side: the published forwarding rule, its
composite(s), their sources and each source's endpoints. A caller who may
not read the producer gets ``"producer": "forbidden"`` - the same rule as
the resource routes, in one call instead of a few dozen.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from healthgate.api.auth import Principal
from healthgate.api.state import ApiState, Auth
from healthgate.model.names import GLOBAL, ResourcePath
from healthgate.model.resources import (
    BackendService,
    CompositeHealthCheck,
    ForwardingRule,
    HealthSource,
    NetworkEndpointGroup,
    ServiceAttachment,
)


def topology_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["health"])

    def shown(path: ResourcePath | None) -> dict[str, Any] | None:
        stored = state.control.stored.get(path) if path is not None else None
        return state.present(stored) if stored is not None else None

    def endpoints(backend_service: ResourcePath) -> list[dict[str, Any]]:
        out = []
        for ep in state.health.engine.endpoints(backend_service):
            item: dict[str, Any] = {
                "ipAddress": ep.ip,
                "port": ep.port,
                "healthState": ep.state.name,
                "reason": ep.reason,
                "lastProbe": ep.last_result.describe() if ep.last_result else None,
            }
            quorum = state.quorum(backend_service, ep.ip, ep.port)
            if quorum is not None:  # cluster mode: the quorum, and who probes it now
                item["reason"] = quorum[0]
                item["probedBy"] = sorted(
                    {str(v["prober"]) for v in quorum[1].values() if v["prober"]}
                )
            out.append(item)
        return out

    def producer(attachment: ResourcePath | None, who: Principal) -> Any:
        if attachment is None:
            return None
        if not who.can_read(attachment.project):
            return "forbidden"
        sa = state.control.stored.get(attachment)
        if sa is None or not isinstance(sa.resource, ServiceAttachment):
            return None
        fr_path = sa.resource.ref("target_service")
        composites = []
        for stored in state.control.stored.values():
            c = stored.resource
            if not (isinstance(c, CompositeHealthCheck) and c.ref("health_destination") == fr_path):
                continue
            sources = []
            for src_path in c.refs("health_sources"):
                src = state.control.stored.get(src_path)
                if src is None or not isinstance(src.resource, HealthSource):
                    continue
                bs = src.resource.ref("sources")
                sources.append(
                    {**state.present(src), "endpoints": endpoints(bs) if bs is not None else []}
                )
            composites.append({**state.present(stored), "sources": sources})
        return {"forwardingRule": shown(fr_path), "composites": composites}

    @router.get("/v1/projects/{project}/topology")
    async def topology(project: str, authorization: Auth = None) -> dict[str, Any]:
        """Every front end of the project, its route, its regions and - where
        the caller may see it - the producer's side down to the endpoints."""
        who = state.principal(authorization)
        state.check_read(who, project)
        state.path_of(project, GLOBAL, "forwardingRules", "x")  # (checks the name)
        frontends = []
        for path, stored in sorted(state.control.stored.items()):
            fr = stored.resource
            if path.project != project or not (isinstance(fr, ForwardingRule) and fr.is_global):
                continue
            bs_path = fr.ref("backend_service")
            bs = state.control.stored.get(bs_path) if bs_path is not None else None
            negs = []
            if bs is not None and isinstance(bs.resource, BackendService):
                for neg_path in bs.resource.refs("backends"):
                    neg = state.control.stored.get(neg_path)
                    if neg is None or not isinstance(neg.resource, NetworkEndpointGroup):
                        continue
                    negs.append(
                        {
                            **state.present(neg),
                            "producer": producer(neg.resource.ref("psc_target_service"), who),
                        }
                    )
            frontends.append({**state.present(stored), "negs": negs})
        return {"project": project, "frontends": frontends}

    return router
