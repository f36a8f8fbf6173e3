"""The transition log over HTTP: a filtered query, and a live stream
(Server-Sent Events) that resumes from ``Last-Event-ID`` without gaps."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query
from starlette.responses import StreamingResponse

from healthgate.api.auth import Principal
from healthgate.api.state import ApiState, Auth
from healthgate.controlplane.recorder import CLOSING
from healthgate.store.base import LogQuery, record_matches

# an unknown kind or state is a 400 naming the field, not an empty list
EventKind = Literal[
    "Endpoint", "HealthSource", "CompositeHealthCheck", "NetworkEndpointGroup", "Route"
]
KindQ = Annotated[EventKind | None, Query(description="only transitions of this kind")]
StateQ = Annotated[
    Literal["HEALTHY", "UNHEALTHY", "UNKNOWN"] | None,
    Query(alias="state", description="only transitions to this state"),
]


def events_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["events"])

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
        access_token: Annotated[
            str | None,
            Query(max_length=512, description="for EventSource, which cannot send headers"),
        ] = None,
        tail: Annotated[
            int | None,
            Query(ge=0, le=10000, description="first replay about this many recent records"),
        ] = None,
    ) -> StreamingResponse:
        who = state.principal(authorization or (f"Bearer {access_token}" if access_token else None))
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
        return StreamingResponse(
            stream(q),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def stream(q: LogQuery) -> AsyncIterator[bytes]:
        queue = state.recorder.subscribe()
        last = q.after_id
        try:
            yield b": healthgate event stream\n\n"
            while True:  # replay what is stored after `last`
                batch = await asyncio.to_thread(state.store.query_log, replace(q, after_id=last))
                for e in batch:
                    last = e.id
                    yield sse(e.id, e.record)
                if len(batch) < q.limit:
                    break
            while True:
                try:
                    async with asyncio.timeout(state.settings.stream_keepalive):
                        item = await queue.get()
                except TimeoutError:
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

    return router


def sse(event_id: int, record: Mapping[str, Any]) -> bytes:
    return f"id: {event_id}\nevent: transition\ndata: {json.dumps(record, separators=(',', ':'))}\n\n".encode()
