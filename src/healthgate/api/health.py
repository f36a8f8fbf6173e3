"""Health routes: every endpoint of a backend service, and a forwarding
rule's composite as a status code any load balancer can check."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from healthgate.api.state import ApiState, Auth
from healthgate.controlplane.recorder import iso
from healthgate.health.types import Counts


def health_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.get(
        "/v1/projects/{project}/regions/{region}/backendServices/{name}/health", tags=["health"]
    )
    async def backend_health(
        project: str, region: str, name: str, authorization: Auth = None
    ) -> dict[str, Any]:
        who = state.principal(authorization)
        state.check_read(who, project)
        path = state.path_of(project, region, "backendServices", name)
        state.stored(path)  # (NOT_FOUND when it is not there)
        engine = state.health.engine
        items = []
        for ep in engine.endpoints(path):
            last = ep.last_result
            # cluster mode: the state is the vantages' quorum, and so is its reason
            quorum = state.quorum(path, ep.ip, ep.port)
            items.append(
                {
                    **({"vantages": quorum[1]} if quorum is not None else {}),
                    "ipAddress": ep.ip,
                    "port": ep.port,
                    "healthState": ep.state.name,
                    "reason": ep.reason if quorum is None else quorum[0],
                    "lastChange": iso(ep.since),
                    # ejected from real traffic (SPEC §8): its probe state stands
                    **({"ejectedUntil": iso(ep.ejected_until)} if ep.ejected_until else {}),
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
        counts = engine.counts(path) or Counts(0, 0, 0)
        return {
            "backendService": str(path),
            "endpoints": counts.total,
            "healthy": counts.healthy,
            "degraded": counts.degraded,
            "unknown": counts.unknown,
            "ejected": sum(1 for i in items if "ejectedUntil" in i),
            "healthStatus": items,
        }

    return router
