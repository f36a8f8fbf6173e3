"""Shifts over HTTP (SPEC §6): manual moves of traffic that always expire.

    POST   /v1/projects/{p}/shifts          {awayFrom, expiresInSec, comment[, force, name]}
    GET    /v1/projects/{p}/shifts[?all=true]
    GET    /v1/projects/{p}/shifts/{name}
    PATCH  /v1/projects/{p}/shifts/{name}   {expiresInSec[, comment]}   (from now, <= 72 h)
    DELETE /v1/projects/{p}/shifts/{name}   (ends it now)

Who: an admin anywhere; a producer or consumer in its own project (a
consumer shifts its own PSC NEGs - a region of them, or one by path - and a
consumer's region shift covers nothing else, ``covers: PSC_NEGS``, even in a
project that also publishes; a producer shifts its published service away
from a region - its service attachments there, or one by path); viewers and
metrics tokens never.

**The safety rule**: a shift that would leave some consumer front end with
no NEG able to take traffic (none that is neither UNHEALTHY nor shifted),
where it had one before, is refused - 409 FAILED_PRECONDITION naming the
front ends the caller may read (and counting the others) - unless an admin
sends ``"force": true``. It is checked inside the write
(``ControlPlane.apply``'s ``check``), against the world the commit is made
over: of two shifts sent at once, the second is checked with the first in.
Every accepted shift, extension and end is a
Change record (controlplane/changes.py); a shift that runs out is recorded
by the engine itself (health/shifts.py). Shifts are resources in the store
(kind Shift), so every node of a cluster obeys them, and a node that
restarts mid-shift obeys it at once.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.responses import JSONResponse

from healthgate.api.auth import AccessError, Principal
from healthgate.api.state import ApiState, Auth
from healthgate.controlplane.changes import change_records
from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.controlplane.resources import Stored
from healthgate.health.shifts import affected
from healthgate.health.states import timestamp
from healthgate.model.names import GLOBAL, ResourcePath, is_valid_name, resolve_reference
from healthgate.model.resources import (
    SHIFT_MAX,
    SHIFT_MIN,
    NetworkEndpointGroup,
    ServiceAttachment,
    Shift,
)
from healthgate.model.validation import Document, Issue

_WIRE = {"away_from": "awayFrom", "comment": "comment", "project": "project"}
MAX_ACTIVE = 100  # live shifts of one project
KEEP_ENDED = 3600.0  # seconds an expired shift stays listed (?all=true) before it is removed


class ShiftRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    awayFrom: str = Field(min_length=1, max_length=300)
    expiresInSec: int = Field(ge=SHIFT_MIN, le=SHIFT_MAX)
    comment: str = Field(min_length=1, max_length=500)
    force: bool = False
    name: str | None = Field(None, max_length=63)

    @field_validator("comment")
    @classmethod
    def _check_comment(cls, value: str | None) -> str | None:
        return _one_line(value)


class ShiftPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    expiresInSec: int = Field(ge=SHIFT_MIN, le=SHIFT_MAX)
    comment: str | None = Field(None, min_length=1, max_length=500)

    @field_validator("comment")
    @classmethod
    def _check_comment(cls, value: str | None) -> str | None:
        return _one_line(value)


AllQ = Annotated[bool, Query(alias="all", description="expired shifts too (kept for an hour)")]


class ShiftRules:
    """Who may shift what, what a shift covers, and the safety rule."""

    def __init__(self, state: ApiState) -> None:
        self.state = state

    def may_shift(self, who: Principal, project: str) -> None:
        if not who.can_read(project) or who.role not in ("admin", "producer", "consumer"):
            raise AccessError(
                403, f"this token ({who.role} of {who.project}) may not shift traffic"
            )

    def writable(
        self, authorization: str | None, project: str, name: str
    ) -> tuple[Principal, Stored, Shift]:
        """The caller (one who may shift in ``project``) and the stored shift
        it names (PATCH and DELETE; each then checks the caller's role)."""
        who = self.state.writer(authorization)
        self.may_shift(who, project)
        stored = self.state.stored(self.path(project, name))
        shift = stored.resource
        assert isinstance(shift, Shift)
        return who, stored, shift

    def path(self, project: str, name: str) -> ResourcePath:
        return self.state.path_of(project, GLOBAL, "shifts", name)

    def normalise_away(self, project: str, away: str) -> str:
        """A region, or the full path of a PSC NEG or service attachment of ``project``."""
        if is_valid_name(away):
            return away
        here = ResourcePath(project, GLOBAL, "shifts", "x")
        collection = (
            "serviceAttachments"
            if "/serviceAttachments/" in f"/{away}"
            else "networkEndpointGroups"
        )
        try:
            target = resolve_reference(away, here, collection)
        except ValueError as exc:
            raise _invalid("awayFrom", str(exc)) from None
        if target.project != project:
            raise _invalid("awayFrom", f"{target} is not in project {project}")
        found = self.state.control.resources.get(target)
        psc = isinstance(found, NetworkEndpointGroup) and found.psc_target_service
        if not (psc or isinstance(found, ServiceAttachment)):
            raise _invalid("awayFrom", f"{target}: no such PSC NEG or service attachment")
        return str(target)

    def check_role(self, who: Principal, shift: Shift) -> None:
        """A consumer shifts its NEGs, a producer its attachments (admins: either)."""
        away = shift.away_from
        if who.role == "consumer" and "/serviceAttachments/" in away:
            raise AccessError(403, "a consumer shifts its own PSC NEGs, not an attachment")
        if who.role == "producer" and "/networkEndpointGroups/" in away:
            raise AccessError(403, "a producer shifts its service attachments, not a PSC NEG")

    def eligible_after(self, extra: set[str]) -> tuple[list[str], int]:
        """Front ends that have a NEG able to take traffic now, and would have
        none with ``extra`` NEGs shifted: (the ones the caller may read, by
        path; how many in all)."""
        engine = self.state.health.engine
        stranded: list[str] = []
        for frontend in engine.route_table().routes:
            cands = [c for c, _ in engine.failover_order(frontend) if c.accepted]
            before = [c for c in cands if c.eligible]
            after = [c for c in before if c.path not in extra]
            if before and not after:
                stranded.append(frontend)
        return stranded, len(stranded)

    def refuse_stranding(self, who: Principal, shift: Shift, negs: list[str]) -> None:
        stranded, count = self.eligible_after(set(negs))
        if not count:
            return
        if shift.force:
            return  # (an admin's decision: checked before)
        visible = [f for f in stranded if who.can_read(ResourcePath.parse(f).project)]
        hidden = count - len(visible)
        names = ", ".join(visible) + (
            f" and {hidden} front ends of other projects" if hidden else ""
        )
        raise ControlError(
            Refusal.UNSAFE,
            f"this shift would leave {names or f'{count} front ends'} with no backend able to "
            "take traffic (safety rule; an admin may send force: true)",
            [Issue("awayFrom", "would leave front ends with no eligible backend")],
        )

    def view(self, who: Principal, stored: Stored, now: float) -> dict[str, Any]:
        shift = stored.resource
        assert isinstance(shift, Shift)
        negs = affected(shift, self.state.control.resources)
        visible = [n for n in negs if who.can_read(ResourcePath.parse(n).project)]
        return {
            "kind": "Shift",
            "name": shift.name,
            "project": shift.project,
            "selfLink": str(shift.path),
            "awayFrom": shift.away_from,
            "expireTime": timestamp(shift.expire_time),
            "createTime": timestamp(shift.created),
            "secondsLeft": max(0, round(shift.expire_time - now)),
            "active": shift.active(now),
            "actor": shift.actor,
            "comment": shift.comment,
            "force": shift.force,
            "covers": shift.covers,
            "affects": visible,
            "affectsOtherProjects": len(negs) - len(visible),
            "fingerprint": stored.fingerprint,
        }

    def shifts_of(self, project: str) -> list[Stored]:
        return [
            s
            for p, s in self.state.control.stored.items()
            if p.project == project and isinstance(s.resource, Shift)
        ]

    async def housekeep(self, project: str, now: float) -> None:
        """Shifts that ended more than an hour ago leave the store."""
        old = [
            s.resource.path
            for s in self.shifts_of(project)
            if isinstance(s.resource, Shift) and s.resource.expire_time < now - KEEP_ENDED
        ]
        if old:
            await self.state.control.delete(old)

    def new_shift(
        self, who: Principal, project: str, body: ShiftRequest, now: float
    ) -> tuple[Shift, list[str]]:
        """The shift asked for, checked (name, target, role), and the NEGs it covers."""
        name = body.name or f"shift-{secrets.token_hex(4)}"
        if not is_valid_name(name):
            raise _invalid("name", "1-63 characters, lowercase letters, digits and '-'")
        self.path(project, name)  # (the project's name checked: 400 naming it)
        try:
            shift = Shift(
                kind="Shift",
                name=name,
                project=project,
                away_from=self.normalise_away(project, body.awayFrom),
                expire_time=now + body.expiresInSec,
                created=now,
                actor=who.name,
                comment=body.comment,
                force=body.force,
                # a consumer's region shift covers only what a consumer owns
                covers="PSC_NEGS" if who.role == "consumer" else "ALL",
            )
        except ValidationError as exc:  # (a comment with a control character, ...)
            issues = [
                Issue(_WIRE.get(str(e["loc"][0]), str(e["loc"][0])) if e["loc"] else "", e["msg"])
                for e in exc.errors(include_input=False)
            ]
            raise ControlError(Refusal.INVALID, "invalid shift", issues) from None
        self.check_role(who, shift)
        negs = affected(shift, self.state.control.resources)
        if not negs:
            raise _invalid(
                "awayFrom",
                f"{shift.away_from}: no PSC NEG or service attachment of {project} there",
            )
        return shift, negs


def shifts_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["shifts"])
    rules = ShiftRules(state)

    @router.post("/v1/projects/{project}/shifts", status_code=201)
    async def create_shift(
        project: str, body: Annotated[ShiftRequest, Body()], authorization: Auth = None
    ) -> JSONResponse:
        who = state.writer(authorization)
        rules.may_shift(who, project)
        if body.force and who.role != "admin":
            raise AccessError(403, "only an admin may force a shift past the safety rule")
        now = time.time()
        await rules.housekeep(project, now)
        live = [s for s in rules.shifts_of(project) if s.resource.active(now)]  # type: ignore[attr-defined]
        if len(live) >= MAX_ACTIVE:
            raise _invalid(
                "", f"project {project} has {MAX_ACTIVE} active shifts, as many as it may"
            )
        shift, _ = rules.new_shift(who, project, body, now)

        def safe() -> None:
            """The safety rule, against the world each attempt commits over
            (two shifts at once: the second is checked with the first in)."""
            rules.refuse_stranding(who, shift, affected(shift, state.control.resources))

        outcome = await state.control.apply([Document(shift)], create_only=True, check=safe)
        until = timestamp(shift.expire_time)
        await state.recorder.append_changes(
            change_records(
                who.name, "shift", now, created=[shift.path],
                reason=f"shift {shift.name} away from {shift.away_from} until {until}: {shift.comment}"
                + (" (forced past the safety rule)" if shift.force else ""),
            )
        )  # fmt: skip
        return JSONResponse(rules.view(who, outcome.stored[shift.path], now), status_code=201)

    @router.get("/v1/projects/{project}/shifts")
    async def list_shifts(
        project: str, authorization: Auth = None, all_: AllQ = False
    ) -> dict[str, Any]:
        who = state.principal(authorization)
        state.check_read(who, project)
        now = time.time()
        items = [
            rules.view(who, s, now)
            for s in sorted(rules.shifts_of(project), key=lambda s: s.resource.name)
            if all_ or s.resource.active(now)  # type: ignore[attr-defined]
        ]
        return {"items": items}

    @router.get("/v1/projects/{project}/shifts/{name}")
    async def get_shift(project: str, name: str, authorization: Auth = None) -> dict[str, Any]:
        who = state.principal(authorization)
        state.check_read(who, project)
        return rules.view(who, state.stored(rules.path(project, name)), time.time())

    @router.patch("/v1/projects/{project}/shifts/{name}")
    async def extend_shift(
        project: str, name: str, body: Annotated[ShiftPatch, Body()], authorization: Auth = None
    ) -> dict[str, Any]:
        who, stored, shift = rules.writable(authorization, project, name)
        now = time.time()
        if not shift.active(now):
            raise ControlError(Refusal.UNSAFE, f"shift {name} has ended")
        rules.check_role(who, shift)
        changed = shift.model_copy(
            update={
                "expire_time": now + body.expiresInSec,
                "comment": body.comment or shift.comment,
            }
        )
        outcome = await state.control.apply(
            [Document(changed)], fingerprints={shift.path: stored.fingerprint}, replace_only=True
        )
        await state.recorder.append_changes(
            change_records(
                who.name, "shift-extend", now, updated=[shift.path],
                reason=f"shift {name} away from {shift.away_from} now until "
                f"{timestamp(changed.expire_time)}: {changed.comment}",
            )
        )  # fmt: skip
        return rules.view(who, outcome.stored[shift.path], now)

    @router.delete("/v1/projects/{project}/shifts/{name}")
    async def end_shift(project: str, name: str, authorization: Auth = None) -> dict[str, Any]:
        who, _, shift = rules.writable(authorization, project, name)
        rules.check_role(who, shift)
        now = time.time()
        await state.control.delete([shift.path])
        if shift.active(now):
            await state.recorder.append_changes(
                change_records(
                    who.name, "shift-end", now, deleted=[shift.path],
                    reason=f"shift {name} away from {shift.away_from} ended by {who.name} "
                    f"({round(shift.expire_time - now)} s early)",
                )
            )  # fmt: skip
        return {"ended": str(shift.path)}

    return router


def _one_line(value: str | None) -> str | None:
    if value is not None and any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError("one line of text: no control characters")
    return value


def _invalid(field: str, message: str) -> ControlError:
    return ControlError(Refusal.INVALID, message, [Issue(field, message)])
