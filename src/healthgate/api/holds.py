"""Failover storm holds over HTTP (SPEC §8; health/storms.py).

    GET  /v1/holds                      the hold in effect (none, or one)
    POST /v1/holds/{id}:release         an admin lets routes follow health again

A hold is the whole installation's (it spans regions and projects): any
token that may read a project sees it; only an admin releases it. A
release is a Change record (``action: hold-release``) in the log of every
project with a consumer front end; in cluster mode every node follows the
log and releases its own engine's hold by it (cluster/node.py).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from healthgate.api.auth import AccessError
from healthgate.api.state import ApiState, Auth
from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.health.states import Hold, RecordKind, timestamp
from healthgate.model.names import ResourcePath, is_valid_name

RELEASE = "hold-release"


def release_records(
    hold: Hold, actor: str, now: float, projects: list[str]
) -> list[dict[str, Any]]:
    """The Change records of a release, one per project (the hold's id in ``hold``)."""
    return [
        {
            "time": now,
            "timestamp": timestamp(now),
            "project": project,
            "region": "global",
            "kind": RecordKind.CHANGE.value,
            "name": RELEASE,
            "path": f"holds/{hold.hold_id}",
            "from": None,
            "to": RELEASE,
            "reason": f"failover storm hold {hold.hold_id} ({', '.join(hold.regions)}) released",
            "actor": actor,
            "action": RELEASE,
            "resources": [f"holds/{hold.hold_id}"],
            "resourceCount": 1,
            "hold": hold.hold_id,
        }
        for project in projects or [""]
    ]


def holds_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["holds"])

    @router.get("/v1/holds")
    async def list_holds(authorization: Auth = None) -> dict[str, Any]:
        who = state.principal(authorization)
        if who.role == "metrics":
            raise AccessError(403, "a metrics token reads /metrics only")
        return {"items": [h.to_dict() for h in state.health.engine.holds()]}

    @router.post("/v1/holds/{hold_id}:release")
    async def release(hold_id: str, authorization: Auth = None) -> dict[str, Any]:
        who = state.writer(authorization)
        if who.role != "admin":
            raise AccessError(403, "only an admin releases a failover storm hold")
        if not is_valid_name(hold_id):
            raise ControlError(Refusal.INVALID, f"hold: {hold_id[:70]!r} is not a hold id")
        engine = state.health.engine
        held = {h.hold_id: h for h in engine.holds()}.get(hold_id)
        if held is None:
            raise ControlError(Refusal.NOT_FOUND, f"holds/{hold_id}: no such hold in effect")
        now = time.time()
        records = engine.release_hold(now, hold_id, who.name)
        if records is None:  # (released meanwhile)
            raise ControlError(Refusal.NOT_FOUND, f"holds/{hold_id}: no such hold in effect")
        state.health.emit(records)
        projects = sorted({ResourcePath.parse(f).project for f in engine.route_table().routes})
        await state.recorder.append_changes(release_records(held, who.name, now, projects))
        return {"released": hold_id, "records": [r.to_dict() for r in records]}

    return router
