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

from typing import Annotated, Any

from fastapi import APIRouter, Query

from healthgate.api.auth import Principal
from healthgate.api.state import ApiState, Auth
from healthgate.controlplane.recorder import iso
from healthgate.model.names import GLOBAL, ResourcePath
from healthgate.model.resources import (
    BackendService,
    CompositeHealthCheck,
    ForwardingRule,
    HealthSource,
    NetworkEndpointGroup,
    ServiceAttachment,
)

MAX_PAGE = 500  # front ends in one answer
CHIPS_MAX = 100  # endpoints of a source listed one by one; beyond, counted


class Topology:
    """One project's front ends, their routes and regions, and - where the
    caller may see it - each region's producer side down to the endpoints."""

    def __init__(self, state: ApiState) -> None:
        self.state = state
        self.stored = state.control.stored

    def shown(self, path: ResourcePath | None) -> dict[str, Any] | None:
        stored = self.stored.get(path) if path is not None else None
        return self.state.present(stored) if stored is not None else None

    def endpoints(self, backend_service: ResourcePath) -> list[dict[str, Any]]:
        state = self.state
        out = []
        for ep in state.health.engine.endpoints(backend_service):
            item: dict[str, Any] = {
                "ipAddress": ep.ip,
                "port": ep.port,
                "healthState": ep.state.name,
                "reason": ep.reason,
                "lastProbe": ep.last_result.describe() if ep.last_result else None,
            }
            if ep.ejected_until:  # (SPEC §8: out of real traffic, its probe state stands)
                item["ejectedUntil"] = iso(ep.ejected_until)
            quorum = state.quorum(backend_service, ep.ip, ep.port)
            if quorum is not None:  # cluster mode: the quorum, and who probes it now
                item["reason"] = quorum[0]
                item["probedBy"] = sorted(
                    {str(v["prober"]) for v in quorum[1].values() if v["prober"]}
                )
            out.append(item)
        return out

    def sources(self, composite: CompositeHealthCheck) -> list[dict[str, Any]]:
        out = []
        for src_path in composite.refs("health_sources"):
            src = self.stored.get(src_path)
            if src is None or not isinstance(src.resource, HealthSource):
                continue
            bs = src.resource.ref("sources")
            out.append({**self.state.present(src), **self.summary(bs)})
        return out

    def summary(self, backend_service: ResourcePath | None) -> dict[str, Any]:
        """A source's endpoints: each of them, or - above ``CHIPS_MAX`` - the
        count in each state and the first ``CHIPS_MAX`` that are not HEALTHY."""
        if backend_service is None:
            return {"endpoints": []}
        engine = self.state.health.engine
        counts = engine.counts(backend_service)
        if counts is None or counts.total <= CHIPS_MAX:
            return {"endpoints": self.endpoints(backend_service)}
        listed = self.endpoints(backend_service)
        return {
            "endpoints": [e for e in listed if e["healthState"] != "HEALTHY"][:CHIPS_MAX],
            "endpointCounts": {
                "total": counts.total,
                "HEALTHY": counts.healthy,
                "DEGRADED": counts.degraded,
                "UNKNOWN": counts.unknown,
                "UNHEALTHY": counts.unhealthy,
            },
        }

    def producer(self, attachment: ResourcePath | None, who: Principal) -> Any:
        if attachment is None:
            return None
        if not who.can_read(attachment.project):
            return "forbidden"
        sa = self.stored.get(attachment)
        if sa is None or not isinstance(sa.resource, ServiceAttachment):
            return None
        fr_path = sa.resource.ref("target_service")
        composites = [
            {**self.state.present(stored), "sources": self.sources(stored.resource)}
            for stored in self.stored.values()
            if isinstance(stored.resource, CompositeHealthCheck)
            and stored.resource.ref("health_destination") == fr_path
        ]
        return {"forwardingRule": self.shown(fr_path), "composites": composites}

    def negs(self, frontend: ForwardingRule, who: Principal) -> list[dict[str, Any]]:
        bs_path = frontend.ref("backend_service")
        bs = self.stored.get(bs_path) if bs_path is not None else None
        if bs is None or not isinstance(bs.resource, BackendService):
            return []
        out = []
        for neg_path in bs.resource.refs("backends"):
            neg = self.stored.get(neg_path)
            if neg is not None and isinstance(neg.resource, NetworkEndpointGroup):
                producer = self.producer(neg.resource.ref("psc_target_service"), who)
                out.append({**self.state.present(neg), "producer": producer})
        return out

    def of(
        self, project: str, who: Principal, size: int = MAX_PAGE, start: int = 0, search: str = ""
    ) -> dict[str, Any]:
        """A page of the project's front ends (those whose name holds
        ``search``), from the ``start``-th, ``size`` of them."""
        paths = sorted(
            path
            for path, stored in self.stored.items()
            if path.project == project
            and isinstance(stored.resource, ForwardingRule)
            and stored.resource.is_global
            and search in path.name
        )
        frontends = []
        for path in paths[start : start + size]:
            stored = self.stored[path]
            rule = stored.resource
            assert isinstance(rule, ForwardingRule)
            frontends.append({**self.state.present(stored), "negs": self.negs(rule, who)})
        out: dict[str, Any] = {"project": project, "frontends": frontends, "total": len(paths)}
        if start + size < len(paths):
            out["nextPageToken"] = str(start + size)
        return out


def topology_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get("/v1/projects/{project}/topology")
    async def topology(
        project: str,
        authorization: Auth = None,
        page_size: Annotated[int, Query(alias="pageSize", ge=1, le=MAX_PAGE)] = MAX_PAGE,
        page_token: Annotated[str | None, Query(alias="pageToken", max_length=12)] = None,
        search: Annotated[str, Query(max_length=63)] = "",
    ) -> dict[str, Any]:
        """The project's front ends (a page of them, whose names hold
        ``search``), each with its route, its regions and - where the caller
        may see it - the producer's side down to the endpoints (counted,
        above a hundred a source)."""
        who = state.principal(authorization)
        state.check_read(who, project)
        state.path_of(project, GLOBAL, "forwardingRules", "x")  # (checks the name)
        start = int(page_token) if page_token and page_token.isdigit() else 0
        return Topology(state).of(project, who, page_size, start, search)

    return router
