"""A front end's last minutes, for the dashboard's charts (one call per front end).

    GET /v1/projects/{p}/global/forwardingRules/{name}/traffic?seconds=900

* ``series``: per region and second, hops, errors and the p50 / p99 latency
  of the answered ones, as healthgate's own listeners carried them
  (controlplane/traffic_history.py) - then, live, the event stream's
  ``traffic`` events (``events/stream?traffic=NAME,...``);
* ``markers``: the records of the window that explain the picture - the
  front end's route changes, ramps, convergence receipts, the project's
  shifts, holds and practice runs, its NEGs' transitions, and (where the
  token may read the producer) the ejections and TRAFFIC verdicts behind
  it - each with its reason;
* ``endpoints``: per region, the producer's endpoints over the window (a
  state and its changes each), or - above ``STRIP_MAX`` endpoints - the
  count in each state, second by second.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, Query

from healthgate.api.auth import Principal
from healthgate.api.state import ApiState, Auth
from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.controlplane.traffic_history import WINDOW
from healthgate.health.states import HealthState
from healthgate.model.lookups import published_rule
from healthgate.model.names import GLOBAL, ResourcePath, endpoint_name
from healthgate.model.resources import ForwardingRule, HealthSource
from healthgate.store.base import LogQuery

STRIP_MAX = 300  # endpoints of a region drawn one by one; beyond, counted
MARKER_KINDS = (
    "Route", "Ramp", "Change", "Hold", "PracticeRun", "Convergence", "NetworkEndpointGroup",
    "Ejection", "HealthSource",
)  # fmt: skip
MAX_MARKERS = 2000
STATES = ("HEALTHY", "DEGRADED", "UNHEALTHY", "UNKNOWN")

SecondsQ = Annotated[int, Query(ge=10, le=WINDOW, description="how far back (seconds)")]


class FrontEndPicture:
    """What one front end's charts show (see the module doc)."""

    def __init__(self, state: ApiState, who: Principal, frontend: ResourcePath) -> None:
        self.state = state
        self.who = who
        self.frontend = str(frontend)
        self.project = frontend.project
        engine = state.health.engine
        # per region: its NEG, and the producer backend service behind it (if readable)
        self.regions: dict[str, tuple[str, ResourcePath | None]] = {}
        for candidate, attachment in engine.failover_order(self.frontend):
            found = published_rule(engine.resources, attachment)
            bs = found[1].ref("backend_service") if found is not None else None
            if bs is not None and not who.can_read(bs.project):
                bs = None
            self.regions[candidate.region] = (candidate.path, bs)

    def relevant(self, record: dict[str, Any]) -> bool:
        kind, path = record.get("kind"), str(record.get("path"))
        if not self.who.can_read(str(record.get("project"))):
            return False
        if kind in ("Route", "Ramp", "Convergence"):
            return str(record.get("frontend", path)) == self.frontend
        if kind in ("Hold", "PracticeRun"):
            return record.get("project") == self.project or kind == "Hold"
        if kind == "Change":
            return record.get("project") == self.project and str(record.get("to")).startswith(
                "shift"
            )
        if kind == "NetworkEndpointGroup":
            return any(neg == path for neg, _ in self.regions.values())
        services = {str(bs) for _, bs in self.regions.values() if bs is not None}
        if kind == "Ejection":
            return record.get("backendService") in services
        if kind == "HealthSource":  # (a TRAFFIC or METRIC source's verdict)
            source = self.state.control.resources.get(ResourcePath.parse(path))
            return (
                isinstance(source, HealthSource)
                and source.source_type in ("TRAFFIC", "METRIC")
                and str(source.ref("sources")) in services
            )
        return False

    def markers(self, since: float) -> list[dict[str, Any]]:
        """(In a worker thread.) The window's records worth marking."""
        out: list[dict[str, Any]] = []
        after = 0
        while True:
            page = self.state.store.query_log(
                LogQuery(since=since, kinds=MARKER_KINDS, after_id=after, limit=5000)
            )
            out += [dict(e.record) | {"id": e.id} for e in page if self.relevant(dict(e.record))]
            if len(page) < 5000 or len(out) >= MAX_MARKERS:
                return out[-MAX_MARKERS:]
            after = page[-1].id

    def endpoints(self, since: int, now: int) -> dict[str, Any]:
        """(In a worker thread.) Per region, the endpoints over the window."""
        engine = self.state.health.engine
        out: dict[str, Any] = {}
        for region, (_, bs) in self.regions.items():
            if bs is None:
                out[region] = {"visible": False}
                continue
            current = engine.endpoints(bs)
            changes: dict[str, list[tuple[float, str, str]]] = {}
            query = LogQuery(path_prefix=f"{bs}/endpoints/", kind="Endpoint", since=since,
                             limit=20_000)  # fmt: skip
            for e in self.state.store.query_log(query):
                name = str(e.record["path"]).rsplit("/", 1)[-1]
                changes.setdefault(name, []).append(
                    (float(e.record["time"]), str(e.record["from"]), str(e.record["to"]))
                )
            strips = []
            for ep in current:
                name = endpoint_name(ep.ip, ep.port)
                mine = changes.get(name, [])
                first = mine[0][1] if mine else ep.state.name
                strips.append((name, first, [(round(t, 3), to) for t, _, to in mine]))
            if len(strips) <= STRIP_MAX:
                out[region] = {
                    "visible": True,
                    "endpoints": [{"name": n, "start": s, "changes": c} for n, s, c in strips],
                }
            else:
                out[region] = {"visible": True, "counts": _counts(strips, since, now)}
        return out


def _counts(
    strips: list[tuple[str, str, list[tuple[float, str]]]], since: int, now: int
) -> dict[str, list[int]]:
    """Per state, how many endpoints were in it at each second."""
    seconds = now - since + 1
    delta = {s: [0] * (seconds + 1) for s in STATES}
    for _, start, changes in strips:
        state, at = start, float(since)
        for t, to in changes:
            i, j = int(at) - since, max(0, min(seconds, int(t) - since))
            delta[state][max(0, i)] += 1
            delta[state][j] -= 1
            state, at = to, t
        delta[state][max(0, int(at) - since)] += 1
        delta[state][seconds] -= 1
    out = {}
    for s, d in delta.items():
        running, counts = 0, []
        for i in range(seconds):
            running += d[i]
            counts.append(running)
        out[s] = counts
    return out


def traffic_router(state: ApiState) -> APIRouter:
    router = APIRouter(tags=["dashboard"])

    @router.get("/v1/projects/{project}/global/forwardingRules/{name}/traffic")
    async def traffic(
        project: str, name: str, authorization: Auth = None, seconds: SecondsQ = WINDOW
    ) -> dict[str, Any]:
        """The front end's last ``seconds``: series per region, markers, endpoints."""
        who = state.principal(authorization)
        state.check_read(who, project)
        path = state.path_of(project, GLOBAL, "forwardingRules", name)
        rule = state.stored(path).resource
        if not isinstance(rule, ForwardingRule) or not rule.is_global:
            raise ControlError(Refusal.INVALID, f"{path} is not a consumer front end")
        now = int(time.time())
        since = now - seconds + 1
        picture = FrontEndPicture(state, who, path)
        markers, endpoints = await asyncio.gather(
            asyncio.to_thread(picture.markers, since),
            asyncio.to_thread(picture.endpoints, since, now),
        )
        history = state.traffic
        series = history.series(str(path), since, now) if history is not None else {}
        return {
            "frontend": str(path),
            "now": now,
            "series": series,
            "markers": markers,
            "endpoints": endpoints,
            "regions": {r: neg for r, (neg, _) in picture.regions.items()},
            "states": [s.name for s in HealthState],
        }

    return router
