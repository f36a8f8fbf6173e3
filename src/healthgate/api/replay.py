"""Replay over HTTP (SPEC §11): what a candidate world would have done with
the probes' real history, next to what the log says happened.

    POST /v1/replay  {from, to, manifest?}      (times: RFC 3339, or epoch seconds)

``manifest`` is the candidate: documents that replace (or add to) the
resources as they are now, validated like an apply's dry run (a 400 naming
the field, nothing written); without one the current world is replayed,
which reproduces the log. The answer (simulation/replay.py's ``report``):
the first difference, every row side by side, and the endpoints that could
not be replayed exactly (their check changes what is probed) or had no
history.

Who: a token that may write (a viewer replays nothing: it costs CPU) and
may write every candidate document; the rows shown are those of the
projects the token may read. One replay runs at a time (another waits up
to a minute, then 503); it runs in a worker thread. ``GET /v1/history`` is
a node's own histories, which a cluster node asks the others for.
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
from typing import Annotated, Any

import httpx
from fastapi import APIRouter, Body
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from healthgate.api.auth import Principal
from healthgate.api.state import ApiState, Auth
from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.health.history import merged
from healthgate.health.states import HealthState
from healthgate.model.manifest import ManifestLimits, parse_manifest
from healthgate.model.names import ResourcePath
from healthgate.model.practice import epoch_of
from healthgate.model.validation import InvalidResources, Issue
from healthgate.simulation.replay import (
    TRANSITION_KINDS,
    changed_probes,
    compare,
    external_sources,
    in_window,
    replay,
    report,
)
from healthgate.store.base import LogQuery

MAX_WINDOW = 168 * 3600.0  # s: at most a week replayed at once
MAX_RECORDS = 500_000  # log records read for one replay
PEER_TIMEOUT = 30.0  # s for another node's histories
MAX_PEER_ANSWER = 512 << 20


class ReplayRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    from_: str | float = Field(alias="from")
    to: str | float | None = None
    manifest: str | None = Field(None, max_length=16 * 1024 * 1024)

    @field_validator("from_", "to")
    @classmethod
    def _check_time(cls, value: str | float | None) -> str | float | None:
        if value is not None:
            seconds(value)
        return value


def seconds(value: str | float) -> float:
    if isinstance(value, str):
        return epoch_of(value)
    if not math.isfinite(value) or not 0 < value < 4_102_444_800:
        raise ValueError(f"expected seconds since 1970 or an RFC 3339 time, got {value!r}")
    return float(value)


def _invalid(field: str, message: str) -> ControlError:
    return ControlError(Refusal.INVALID, message, [Issue(field, message)])


class Replays:
    def __init__(self, state: ApiState) -> None:
        self.state = state
        self.slot = asyncio.Semaphore(1)

    async def histories(self, authorization: str | None) -> tuple[dict[str, list[bytes]], bool]:
        """This node's histories and, in a cluster, every other live node's."""
        own, cut = await self.state.health.source.histories()
        if self.state.peers is None:
            return own, cut
        out = {p: list(d) for p, d in own.items()}
        headers = {"Authorization": authorization} if authorization else {}
        async with httpx.AsyncClient(timeout=PEER_TIMEOUT, trust_env=False) as client:

            async def ask(url: str) -> tuple[dict[str, list[str]], bool] | None:
                try:
                    async with client.stream("GET", f"{url}/v1/history", headers=headers) as r:
                        body = bytearray()
                        async for chunk in r.aiter_bytes():
                            body += chunk
                            if len(body) > MAX_PEER_ANSWER:
                                return None
                        if r.status_code != 200:
                            return None
                        answer = httpx.Response(200, content=bytes(body)).json()
                        return answer["histories"], bool(answer.get("truncated"))
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    return None

            answers = await asyncio.gather(*(ask(u) for u in self.state.peers().values()))
        for answer in answers:
            if answer is None:
                cut = True
                continue
            items, peer_cut = answer
            cut |= peer_cut
            for path, encoded in items.items():
                out.setdefault(path, []).extend(base64.b64decode(e) for e in encoded)
        return out, cut

    def recorded(self, who: Principal, since: float, until: float) -> list[dict[str, Any]]:
        """(In a worker thread.) The log's transitions and route changes in the window."""
        out: list[dict[str, Any]] = []
        after = 0
        while len(out) < MAX_RECORDS:
            query = LogQuery(since=since, until=until, after_id=after, limit=10_000,
                             kinds=TRANSITION_KINDS)  # fmt: skip
            page = self.state.store.query_log(query)
            out += [dict(e.record) for e in page if who.can_read(str(e.record.get("project")))]
            if len(page) < 10_000:
                break
            after = page[-1].id
        return out


def replay_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["replay"])
    replays = Replays(state)

    @router.get("/v1/history")
    async def history(authorization: Auth = None) -> dict[str, Any]:
        """This node's outcome histories (encoded, base64), of the endpoints
        of the projects the token may read."""
        who = state.writer(authorization)
        items, cut = await state.health.source.histories()
        shown = {
            path: [base64.b64encode(d).decode() for d in data]
            for path, data in items.items()
            if who.can_read(ResourcePath.parse(path.split("/endpoints/")[0]).project)
        }
        return {"histories": shown, "truncated": cut}

    @router.post("/v1/replay")
    async def run_replay(
        body: Annotated[dict[str, Any], Body()], authorization: Auth = None
    ) -> dict[str, Any]:
        """Replay the probes' history under a candidate world (SPEC §11)."""
        who = state.writer(authorization)
        try:
            req = ReplayRequest.model_validate(body)
        except ValidationError as exc:
            issues = [
                Issue(".".join(str(p) for p in e["loc"]).replace("from_", "from"), e["msg"])
                for e in exc.errors(include_input=False)
            ]
            raise ControlError(Refusal.INVALID, "invalid replay request", issues) from None
        now = time.time()
        since, until = seconds(req.from_), seconds(req.to) if req.to is not None else now
        if until <= since:
            raise _invalid("to", "must be after from")
        if until - since > MAX_WINDOW:
            raise _invalid("from", f"at most {MAX_WINDOW / 3600:g} hours are replayed at once")
        until = min(until, now)
        candidate = dict(state.control.resources)
        if req.manifest:
            try:
                docs = parse_manifest(
                    req.manifest, ManifestLimits(max_bytes=state.settings.max_manifest_bytes)
                )
            except InvalidResources as exc:
                raise ControlError(Refusal.INVALID, "invalid manifest", exc.issues) from None
            for doc in docs:
                state.check_document(who, doc)
            outcome = await state.control.apply(docs, dry_run=True)
            candidate = dict(outcome.plan.result)
        probed = changed_probes(state.control.resources, list(candidate.values()))
        try:
            async with asyncio.timeout(60):
                await replays.slot.acquire()
        except TimeoutError:
            raise ControlError(
                Refusal.UNAVAILABLE, "another replay is running; try again"
            ) from None
        try:
            histories, cut = await replays.histories(authorization)
            runs = merged(histories)
            begin = min((r[0].start / 1000 for r in runs.values() if r), default=since)
            recorded = await asyncio.to_thread(replays.recorded, who, min(begin, since), until)
            external = _external(state, list(candidate.values()), recorded, begin)
            result = await asyncio.to_thread(
                replay, list(candidate.values()), runs, until, external,
                state.health.engine.storms.settings, probed,
            )  # fmt: skip
        finally:
            replays.slot.release()
        shown = [d for d in in_window(result.records, since, until)
                 if who.can_read(str(d.get("project")))]  # fmt: skip
        was = [d for d in recorded if since <= float(d["time"]) <= until]
        out = report(compare(was, shown), result)
        out.update(
            {
                "from": req.from_,
                "to": req.to,
                "historyTruncated": cut,
                "approximate": {
                    p: why for p, why in result.approximate.items() if who.can_read(p.split("/")[1])
                },
                "noHistory": [p for p in result.no_history if who.can_read(p.split("/")[1])],
            }
        )
        return out

    return router


def _external(
    state: ApiState, candidate: list[Any], recorded: list[dict[str, Any]], begin: float
) -> dict[str, list[tuple[float, HealthState, str]]]:
    """TRAFFIC and METRIC sources, as the log has them: the state at the
    history's start (the first record's from, else the state now), then each
    record's."""
    out: dict[str, list[tuple[float, HealthState, str]]] = {}
    by_path: dict[str, list[dict[str, Any]]] = {}
    for d in recorded:
        by_path.setdefault(str(d.get("path")), []).append(d)
    for source in external_sources(candidate):
        records = sorted(by_path.get(source, []), key=lambda d: d["time"])
        if records:
            first = HealthState[str(records[0].get("from") or "UNKNOWN")]
            reason = "as recorded before the window"
        else:
            node = state.health.engine.node_status(source)
            first = node.state if node is not None else HealthState.UNKNOWN
            reason = node.reason if node is not None else "not evaluated yet"
        out[source] = [(begin, first, reason)] + [
            (float(d["time"]), HealthState[str(d["to"])], str(d.get("reason", ""))) for d in records
        ]
    return out
