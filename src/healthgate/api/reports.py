"""Pushed health over HTTP (SPEC §10, Consul's TTL checks)::

    POST /v1/projects/{p}/regions/{r}/backendServices/{b}/endpoints:report
         {endpoint: "10.0.0.5:8080", state: HEALTHY|UNHEALTHY|DEGRADED, note: "..."}

For a backend service whose check is ``type: PUSH``. Who: whoever may
write the backend service (a producer or an admin of its project; another
project's token, a viewer or a consumer: 403). The report is stored (kind
EndpointReport, one per endpoint, replaced by the next), so a restart and
every cluster node find it; it decides the endpoint's state until the
check's ``ttlSec`` runs out (health/pushed.py). The answer says the
endpoint's state after it and when the report runs out.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from healthgate.api.state import ApiState, Auth
from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.health.states import timestamp
from healthgate.model.checks import MAX_NOTE, EndpointReport, report_name
from healthgate.model.names import endpoint_name, parse_endpoint_name
from healthgate.model.resource import normalise_ip
from healthgate.model.resources import BackendService, HealthCheck
from healthgate.model.validation import Document, Issue
from healthgate.model.webhooks import one_line


class ReportRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    endpoint: str = Field(min_length=1, max_length=64)
    state: Literal["HEALTHY", "UNHEALTHY", "DEGRADED"]
    note: str = Field("", max_length=MAX_NOTE)

    @field_validator("note")
    @classmethod
    def _one_line(cls, value: str) -> str:
        return one_line(value)


def _invalid(field: str, message: str) -> ControlError:
    return ControlError(Refusal.INVALID, message, [Issue(field, message)])


def reports_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["health"])

    @router.post("/v1/projects/{project}/regions/{region}/backendServices/{name}/endpoints:report")
    async def report(
        project: str,
        region: str,
        name: str,
        body: Annotated[dict[str, Any], Body()],
        authorization: Auth = None,
    ) -> dict[str, Any]:
        who = state.writer(authorization)
        state.check_read(who, project)  # (before any lookup: another project learns nothing)
        path = state.path_of(project, region, "backendServices", name)
        bs = state.stored(path).resource
        state.check_write(who, bs)  # (another project's token, a consumer's: 403)
        try:
            req = ReportRequest.model_validate(body)
        except ValidationError as exc:
            issues = [Issue(".".join(str(p) for p in e["loc"]), e["msg"]) for e in exc.errors()]
            raise ControlError(Refusal.INVALID, "invalid report", issues) from None
        assert isinstance(bs, BackendService)
        check = (
            state.control.resources.get(bs.refs("health_checks")[0])
            if bs.refs("health_checks")
            else None
        )
        if not isinstance(check, HealthCheck) or check.type != "PUSH":
            raise _invalid(
                "backendService",
                f"{path}: its health check is not a PUSH check (reports are for those only)",
            )
        try:
            ip, port = parse_endpoint_name(req.endpoint)
            key = endpoint_name(normalise_ip(ip), port)
        except ValueError:
            raise _invalid(
                "endpoint", f"expected ip:port, [v6]:port or ip, got {req.endpoint[:70]!r}"
            ) from None
        if state.health.engine.table.slot_of(path, *parse_endpoint_name(key)) is None:
            raise _invalid("endpoint", f"{key} is not an endpoint of {path}")
        now = time.time()
        doc = EndpointReport(
            kind="EndpointReport",
            name=report_name(name, key),
            project=project,
            region=region,
            backend_service=name,
            endpoint=key,
            state=req.state,
            note=req.note,
            time=now,
            actor=who.name[:63],
        )
        await state.control.apply([Document(doc)])
        slot = state.health.engine.table.slot_of(path, *parse_endpoint_name(key))
        current = state.health.engine.table.state(slot).name if slot is not None else "UNKNOWN"
        return {
            "endpoint": key,
            "healthState": current,
            "reported": req.state,
            "expireTime": timestamp(now + float(check.ttl_sec or 0)),
        }

    return router
