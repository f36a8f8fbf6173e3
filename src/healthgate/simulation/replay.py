"""Replay (SPEC §11): real probe history through the engine, in virtual
time, under a candidate world - what would have happened, next to what did.

The input is each probed endpoint's outcome history (health/history.py,
kept by whoever probed it) and the records of the log. The engine - the
same :class:`~healthgate.health.engine.HealthEngine` serve runs - is given
the candidate resources at the start of the history, then every result in
time order: of each run, its first ten results at their exact times and its
last (in between, equal results change nothing). A candidate may change
what is *judged* - thresholds, policies, composites, failover policies,
``expectedStatusCodes`` and ``degradedStatusCodes`` (an HTTP answer's
status is kept, and judged again) - and the replay is exact; it may not
change what is *probed* (a check's type, port, path, host, request,
interval, timeout...): those endpoints are replayed from what their old
check saw, and listed (:attr:`Replay.approximate`). Endpoints with no
history stay UNKNOWN and are listed too.

What is not a probe comes from the log: a TRAFFIC or METRIC source takes
the states its records gave it, when they gave them. Shifts still in the
store take effect from their creation to their end. Holds (failover
storms) follow serve's ``--storm-hold-*`` settings when given. Not
replayed: PUSH reports, the vantages' quorum of a cluster (an endpoint's
histories from several nodes are merged in time order), ejections.

:func:`compare` lines the replayed records up with the recorded ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from healthgate.health.engine import HealthEngine, ProbeTarget
from healthgate.health.history import Run
from healthgate.health.states import HealthState, Outcome, ProbeResult, Record, timestamp
from healthgate.health.storms import StormSettings
from healthgate.model.names import endpoint_path
from healthgate.model.resources import HealthCheck, HealthSource, Resource, Shift

# what a check probes: a candidate that changes one of these is not replayed exactly
PROBED = (
    "type", "port", "host", "request_path", "method", "request_headers", "request_body", "send",
    "expect", "proxy_header", "client_certificate", "ca_certificate", "verify",
    "response_contains", "grpc_service_name", "invert", "check_interval_sec", "timeout_sec",
    "enabled", "ttl_sec",
)  # fmt: skip
TRANSITION_KINDS = ("HealthSource", "CompositeHealthCheck", "NetworkEndpointGroup", "Route")
_JUDGED = (Outcome.OK, Outcome.STATUS, Outcome.DEGRADED)


@dataclass(slots=True)
class Replay:
    records: list[Record] = field(default_factory=list)
    results: int = 0  # results fed
    endpoints: int = 0  # endpoints with history
    history_start: float | None = None
    approximate: dict[str, str] = field(default_factory=dict)  # endpoint path -> why
    no_history: list[str] = field(default_factory=list)


def changed_probes(
    current: Mapping[Any, Resource], candidate: Sequence[Resource]
) -> dict[str, str]:
    """Check path -> the fields a candidate changes that alter what is probed."""
    out = {}
    for res in candidate:
        old = current.get(res.path)
        if isinstance(res, HealthCheck) and isinstance(old, HealthCheck):
            fields = [
                HealthCheck.model_fields[f].alias or f
                for f in PROBED
                if getattr(res, f) != getattr(old, f)
            ]
            if fields:
                out[str(res.path)] = ", ".join(fields)
    return out


def _judged(check: HealthCheck, result: ProbeResult) -> ProbeResult:
    """An HTTP answer judged again by the candidate check's status codes."""
    if result.outcome not in _JUDGED or not result.status or check.invert:
        return result
    status = result.status
    if any(lo <= status <= hi for lo, hi in check.degraded_ranges()):
        outcome = Outcome.DEGRADED
    elif any(lo <= status <= hi for lo, hi in check.status_ranges()):
        outcome = Outcome.OK
    else:
        outcome = Outcome.STATUS
    return result if outcome is result.outcome else result._replace(outcome=outcome)


def _stream(
    slot: int, check: HealthCheck, runs: Sequence[Run]
) -> Iterator[tuple[float, int, ProbeResult]]:
    for run in runs:
        for t, result in run.flips():
            yield t / 1000, slot, _judged(check, result)


def replay(
    candidate: Sequence[Resource],
    histories: Mapping[str, Sequence[Run]],
    until: float,
    external: Mapping[str, Sequence[tuple[float, HealthState, str]]] | None = None,
    storms: StormSettings | None = None,
    probed_changes: Mapping[str, str] | None = None,
) -> Replay:
    """Replay the histories under ``candidate`` up to ``until`` (seconds).
    ``external``: for TRAFFIC and METRIC sources, (time, state, reason) as
    the log has them, the first being the state at the history's start."""
    out = Replay()
    starts = [runs[0].start / 1000 for runs in histories.values() if runs]
    begin = min(starts) if starts else until
    out.history_start = begin if starts else None
    shifts = sorted((r for r in candidate if isinstance(r, Shift)), key=lambda s: s.created)
    world = [r for r in candidate if not isinstance(r, Shift)]
    engine = HealthEngine()
    if storms is not None:
        engine.set_storm_settings(storms)
    engine.apply(world, begin)
    targets: dict[str, ProbeTarget] = {
        endpoint_path(t.backend_service, t.ip, t.port): t for t in engine.targets()
    }
    streams = []
    for path, target in targets.items():
        runs = histories.get(path)
        if not runs:
            out.no_history.append(path)
            continue
        out.endpoints += 1
        why = (probed_changes or {}).get(str(target.check.path))
        if why:
            out.approximate[path] = f"its check's {why} changed: replayed from what the old one saw"
        streams.append(_stream(target.slot, target.check, runs))
    events: list[tuple[float, int, str, object]] = []
    for source, states in (external or {}).items():
        for t, state, reason in states:
            events.append((max(t, begin), len(events), source, (state, reason)))
    for shift in shifts:
        events.append((max(shift.created, begin), len(events), "", shift))
    events.sort(key=lambda e: (e[0], e[1]))
    records = out.records
    clock = begin
    pending = iter(events)
    nxt = next(pending, None)
    for t, slot, result in heapq.merge(*streams, key=lambda e: e[0]):
        if t > until:
            break
        while nxt is not None and nxt[0] <= t:
            clock = _advance(engine, clock, nxt[0], records)
            records += _event(engine, world, nxt)
            nxt = next(pending, None)
        clock = _advance(engine, clock, t, records)
        records += engine.on_result(t, slot, result)
        out.results += 1
    while nxt is not None and nxt[0] <= until:
        clock = _advance(engine, clock, nxt[0], records)
        records += _event(engine, world, nxt)
        nxt = next(pending, None)
    _advance(engine, clock, until, records)
    return out


def _event(
    engine: HealthEngine, world: list[Resource], event: tuple[float, int, str, object]
) -> list[Record]:
    t, _, source, what = event
    if isinstance(what, Shift):
        world.append(what)
        return engine.apply(world, t).records
    assert isinstance(what, tuple)
    state: HealthState = what[0]
    reason: str = what[1]
    return engine.set_traffic(t, source, state, reason)


def _advance(engine: HealthEngine, then: float, now: float, records: list[Record]) -> float:
    """Time alone moves things: ramps step, shifts run out."""
    while True:
        ramp = engine.next_ramp_step(then)
        shift = engine.next_shift_expiry(then)
        due = [x for x in (ramp, shift) if x is not None and x <= now]
        if not due:
            return max(then, now)
        then = min(due)
        if shift == then:
            records += engine.expire_shifts(then)
        if ramp == then:
            records += engine.step_ramps(then)


def external_sources(candidate: Sequence[Resource]) -> list[str]:
    """The TRAFFIC and METRIC sources: replayed from their records."""
    return [
        str(r.path)
        for r in candidate
        if isinstance(r, HealthSource) and r.source_type in ("TRAFFIC", "METRIC")
    ]


# ------------------------------------------------------------------ side by side


@dataclass(frozen=True, slots=True)
class Row:
    """One transition or route change: recorded, replayed, or both."""

    path: str
    kind: str
    to: str
    recorded: dict[str, Any] | None
    replayed: dict[str, Any] | None

    @property
    def time(self) -> float:
        either = self.recorded or self.replayed
        assert either is not None
        return float(either["time"])

    @property
    def same(self) -> bool:
        if self.recorded is None or self.replayed is None:
            return False
        return abs(float(self.recorded["time"]) - float(self.replayed["time"])) <= 0.001

    def text(self) -> str:
        name = self.path.rsplit("/", 1)[-1]
        what = f"{self.kind} {name} -> {self.to.rsplit('/', 1)[-1]}"
        if self.recorded is None:
            assert self.replayed is not None
            return f"{timestamp(self.replayed['time'])} {what}: would happen (it did not)"
        if self.replayed is None:
            return f"{timestamp(self.recorded['time'])} {what}: would not happen"
        delta = float(self.replayed["time"]) - float(self.recorded["time"])
        if self.same:
            return f"{timestamp(self.recorded['time'])} {what}: the same"
        later = "later" if delta > 0 else "earlier"
        return f"{timestamp(self.recorded['time'])} {what}: {abs(delta):.1f} s {later}"


MATCH_WITHIN = 900.0  # s: a replayed record matches a recorded one of the same change this close


def compare(recorded: Sequence[dict[str, Any]], replayed: Sequence[dict[str, Any]]) -> list[Row]:
    """The recorded and replayed records lined up: per resource and new
    state in time order, the nearest ones within ``MATCH_WITHIN`` paired."""

    def key(d: dict[str, Any]) -> tuple[str, str, str]:
        return str(d["path"]), str(d["kind"]), str(d.get("to"))

    groups: dict[tuple[str, str, str], tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
    for d in recorded:
        if d.get("kind") in TRANSITION_KINDS:
            groups.setdefault(key(d), ([], []))[0].append(d)
    for d in replayed:
        if d.get("kind") in TRANSITION_KINDS:
            groups.setdefault(key(d), ([], []))[1].append(d)
    rows: list[Row] = []
    for (path, kind, to), (was, would) in groups.items():
        was.sort(key=lambda d: d["time"])
        would.sort(key=lambda d: d["time"])
        j = 0
        for d in was:
            while j < len(would) and would[j]["time"] < d["time"] - MATCH_WITHIN:
                rows.append(Row(path, kind, to, None, would[j]))
                j += 1
            if j < len(would) and abs(would[j]["time"] - d["time"]) <= MATCH_WITHIN:
                rows.append(Row(path, kind, to, d, would[j]))
                j += 1
            else:
                rows.append(Row(path, kind, to, d, None))
        rows += [Row(path, kind, to, None, w) for w in would[j:]]
    rows.sort(key=lambda r: (r.time, r.kind, r.path))
    return rows


def first_difference(rows: Sequence[Row]) -> Row | None:
    return next((r for r in rows if not r.same), None)


def report(rows: Sequence[Row], result: Replay) -> dict[str, Any]:
    """The answer: the first difference first, then every row."""
    first = first_difference(rows)
    return {
        "firstDifference": first.text() if first is not None else None,
        "differences": sum(1 for r in rows if not r.same),
        "rows": [
            {
                "path": r.path,
                "kind": r.kind,
                "to": r.to,
                "recorded": r.recorded,
                "replayed": r.replayed,
                "same": r.same,
                "summary": r.text(),
            }
            for r in rows
        ],
        "results": result.results,
        "endpoints": result.endpoints,
        "historyStart": timestamp(result.history_start) if result.history_start else None,
        "approximate": result.approximate,
        "noHistory": result.no_history,
    }


def in_window(records: Sequence[Record], since: float, until: float) -> list[dict[str, Any]]:
    return [r.to_dict() for r in records if since <= r.time <= until]
