"""Practice runs over HTTP (SPEC §11).

A practice run is a resource (kind ``PracticeRun``: list, create, get,
replace and delete it as any other, under ``/v1/projects/P/global/practiceRuns``);
its GET carries ``status`` - the run under way, the next scheduled start,
the last record. Besides::

    POST /v1/projects/{p}/global/practiceRuns/{name}:start

starts it now: 200 with the STARTED record, or 409 FAILED_PRECONDITION
with the reason it may not (an incident, a blocked window, the safety
rule; the SKIPPED record says so too), 409 CONFLICT while it is under way.
Who: whoever may write the run (an admin, the project's producer or
consumer; a viewer or another project's token: 403). In a cluster the
elected writer starts it: another node answers 503 while there is none.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from healthgate.api.state import ApiState, Auth
from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.health.states import PracticePhase
from healthgate.model.names import GLOBAL
from healthgate.model.practice import PracticeRun


def practice_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["practice runs"])

    @router.post("/v1/projects/{project}/global/practiceRuns/{name}:start")
    async def start_practice_run(
        project: str, name: str, authorization: Auth = None
    ) -> dict[str, Any]:
        who = state.writer(authorization)
        state.check_read(who, project)  # (before any lookup: another project learns nothing)
        run = state.stored(state.path_of(project, GLOBAL, "practiceRuns", name)).resource
        assert isinstance(run, PracticeRun)
        state.check_may_change(who, run)
        if state.practice is None:
            raise ControlError(Refusal.UNAVAILABLE, "practice runs are not running on this server")
        record = await state.practice.start_now(run)
        if record.phase is PracticePhase.SKIPPED:
            raise ControlError(Refusal.UNSAFE, f"practice run {name} {record.reason}")
        return record.to_dict()

    return router
