"""The transition log over HTTP: a filtered query, and a live stream
(Server-Sent Events) that resumes from ``Last-Event-ID`` without gaps."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query
from starlette.responses import StreamingResponse

from healthgate.api.auth import AccessError, Principal
from healthgate.api.state import ApiState, Auth
from healthgate.controlplane.recorder import CLOSING
from healthgate.store.base import LogQuery, record_matches

MAX_TRAFFIC = 50  # front ends whose traffic one stream carries

# an unknown kind or state is a 400 naming the field, not an empty list
EventKind = Literal[
    "Endpoint", "HealthSource", "CompositeHealthCheck", "NetworkEndpointGroup", "Route", "Change",
    "Ramp", "Ejection", "Hold", "PracticeRun", "Convergence",
]  # fmt: skip
KindQ = Annotated[EventKind | None, Query(description="only records of this kind")]
StateQ = Annotated[
    Literal[
        "HEALTHY", "UNHEALTHY", "UNKNOWN", "DEGRADED",
        # a Change record's action
        "apply", "delete", "create", "replace", "shift", "shift-extend", "shift-end",
        # a Ramp record's phase
        "STARTED", "ENDED", "ABANDONED",
        # an Ejection record's phase, a Hold record's
        "EJECTED", "RETURNED", "DETECTED", "HELD", "LIFTED", "RELEASED",
        # a PracticeRun record's phase (and STARTED), a Convergence record's
        "COMPLETED", "CANCELLED", "SKIPPED", "LAGGING", "CAUGHT_UP",
    ]
    | None,
    Query(alias="state", description="only transitions to this state (or Changes of this action)"),
]  # fmt: skip


def events_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["events"])
    streams = EventStreams(state)

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
        state.check_read(who, project)
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

    @router.get("/v1/projects/{project}/events", tags=["events"])
    async def events(
        project: str,
        authorization: Auth = None,
        resource: Annotated[
            str | None, Query(max_length=512, description="a resource path or prefix")
        ] = None,
        kind: KindQ = None,
        state_: StateQ = None,
        since: Annotated[float | None, Query(ge=0, le=1e12, description="epoch seconds")] = None,
        until: Annotated[float | None, Query(ge=0, le=1e12)] = None,
        after: Annotated[int, Query(ge=0, le=2**62)] = 0,
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    ) -> dict[str, Any]:
        q = log_query(
            project,
            state.principal(authorization),
            resource,
            kind,
            state_,
            since,
            until,
            after,
            limit,
        )
        entries = await asyncio.to_thread(state.store.query_log, q)
        return {
            "items": [{"id": e.id, **e.record} for e in entries],
            "last": entries[-1].id if entries else after,
        }

    @router.get(
        "/v1/projects/{project}/events/stream", tags=["events"], response_class=StreamingResponse
    )
    async def event_stream(
        project: str,
        authorization: Auth = None,
        resource: Annotated[str | None, Query(max_length=512)] = None,
        kind: KindQ = None,
        state_: StateQ = None,
        after: Annotated[int | None, Query(ge=0, le=2**62)] = None,
        last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
        tail: Annotated[
            int | None,
            Query(ge=0, le=10000, description="first replay about this many recent records"),
        ] = None,
        traffic: Annotated[
            str | None,
            Query(
                max_length=MAX_TRAFFIC * 64,
                description="front ends (names, comma-separated, at most 50) whose traffic "
                "comes too, each second, as `traffic` events",
            ),
        ] = None,
    ) -> StreamingResponse:
        who = state.principal(authorization)  # (never a token in a URL: SPEC §7)
        streams.room(who)
        frontends = []
        for name in (traffic or "").split(",") if traffic else []:
            frontends.append(str(state.path_of(project, "global", "forwardingRules", name)))
        if len(frontends) > MAX_TRAFFIC:
            raise AccessError(400, f"traffic: at most {MAX_TRAFFIC} front ends")
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
        if frontends:
            state.check_read(who, project)
        return StreamingResponse(
            streams.counted(who, q, frontends),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return router


class EventStreams:
    """The live streams: their bodies, and how many each principal holds
    (SPEC §7: capped per principal, so one viewer cannot take the API)."""

    def __init__(self, state: ApiState) -> None:
        self.state = state
        # a token's live streams (by the token, not by its role: one consumer
        # token's streams used to take the share of every consumer of its project)
        self.open: dict[str, int] = {}

    def room(self, who: Principal) -> None:
        """429 when ``who`` holds as many streams as it may."""
        cap = self.state.settings.max_streams_per_principal
        if self.open.get(who.key, 0) >= cap:
            raise AccessError(
                429,
                f"this token ({who.role} of {who.project}) has {cap} event streams open, "
                "as many as it may",
            )

    async def counted(
        self, who: Principal, q: LogQuery, traffic: list[str] | None = None
    ) -> AsyncIterator[bytes]:
        """A stream counted while it lives (the route refused one over the
        cap; one that got past it in the same instant ends here)."""
        key, open_ = who.key, self.open
        if open_.get(key, 0) >= self.state.settings.max_streams_per_principal:
            yield b'event: error\ndata: {"message": "too many event streams for this token"}\n\n'
            return
        open_[key] = open_.get(key, 0) + 1
        try:
            async for chunk in self.stream(q, traffic or []):
                yield chunk
        finally:
            left = open_[key] - 1
            if left:
                open_[key] = left
            else:
                del open_[key]

    async def stream(self, q: LogQuery, traffic: list[str]) -> AsyncIterator[bytes]:
        state = self.state
        queue = state.recorder.subscribe()
        last = q.after_id
        # (traffic: each second's figures of these front ends; the last sent)
        sent = {f: int(time.time()) for f in traffic}
        wait = (
            min(1.0, state.settings.stream_keepalive)
            if traffic
            else state.settings.stream_keepalive
        )
        try:
            yield b": healthgate event stream\n\n"
            while True:  # replay what is stored after `last`
                batch = await asyncio.to_thread(state.store.query_log, replace(q, after_id=last))
                for e in batch:
                    last = e.id
                    yield sse(e.id, e.record)
                if len(batch) < q.limit:
                    break
            quiet = 0.0
            while True:
                for chunk in self._traffic(sent):
                    quiet = 0.0
                    yield chunk
                try:
                    async with asyncio.timeout(wait):
                        item = await queue.get()
                except TimeoutError:
                    quiet += wait
                    if quiet >= state.settings.stream_keepalive:
                        quiet = 0.0
                        yield b": keepalive\n\n"
                    continue
                if item is None:
                    yield b'event: error\ndata: {"message": "subscriber too slow; reconnect with Last-Event-ID"}\n\n'
                    return
                if item is CLOSING:
                    yield b'event: end\ndata: {"message": "the server is stopping; reconnect with Last-Event-ID"}\n\n'
                    return
                event_id, record = item
                if event_id <= last or not record_matches(q, record):
                    continue
                last = event_id
                yield sse(event_id, record)
        finally:
            state.recorder.unsubscribe(queue)

    def _traffic(self, sent: dict[str, int]) -> list[bytes]:
        """The seconds of each front end written since the last sent (no id:
        they are not in the log, and a reconnect asks for the window again)."""
        history = self.state.traffic
        if history is None or not sent:
            return []
        out = []
        now = int(time.time()) - 1  # (the last whole second)
        for frontend, last in sent.items():
            if now <= last:
                continue
            series = history.series(frontend, last + 1, now)
            sent[frontend] = now
            body = json.dumps({"frontend": frontend, **series}, separators=(",", ":"))
            out.append(f"event: traffic\ndata: {body}\n\n".encode())
        return out


def sse(event_id: int, record: Mapping[str, Any]) -> bytes:
    return f"id: {event_id}\nevent: transition\ndata: {json.dumps(record, separators=(',', ':'))}\n\n".encode()
