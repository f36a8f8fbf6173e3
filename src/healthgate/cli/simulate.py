"""``healthgate simulate``: the timeline of a what-if scenario."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from healthgate.cli.render import table
from healthgate.health.states import (
    ConvergenceRecord,
    Ejection,
    Hold,
    PracticeRecord,
    RampChange,
    Record,
    RouteChange,
    ShiftEnded,
    Transition,
)
from healthgate.health.windows import failure_window, success_window
from healthgate.model.resources import HealthCheck, Resource
from healthgate.simulation.runner import SimulationResult
from healthgate.simulation.scenario import Scenario


def _short(path: str | None) -> str:
    if path is None:
        return "(refuse)"
    parts = path.split("/")
    # projects/P/regions/R/C/N -> P/R/N ; projects/P/global/C/N -> P/global/N
    if len(parts) >= 6 and parts[2] == "regions":
        return f"{parts[1]}/{parts[3]}/{'/'.join(parts[5:])}"
    if len(parts) >= 5:
        return f"{parts[1]}/global/{'/'.join(parts[4:])}"
    return path


def windows(resources: Sequence[Resource], scenario: Scenario) -> list[dict[str, Any]]:
    out = []
    for r in resources:
        if isinstance(r, HealthCheck):
            out.append(
                {
                    "healthCheck": str(r.path),
                    "failureWindowSec": failure_window(
                        r.timeout_sec, r.check_interval_sec, r.unhealthy_threshold
                    ),
                    "refusedWindowSec": failure_window(
                        0, r.check_interval_sec, r.unhealthy_threshold
                    ),
                    "successWindowSec": success_window(
                        scenario.response_time, r.check_interval_sec, r.healthy_threshold
                    ),
                }
            )
    return out


def to_json(result: SimulationResult, resources: Sequence[Resource], scenario: Scenario) -> str:
    routes = result.engine.route_table().routes
    doc = {
        "timeline": [r.to_dict() for r in result.records],
        "probes": result.probes,
        "windows": windows(resources, scenario),
        "finalRoutes": {
            k: {
                "target": v.target,
                "mode": v.mode,
                "reason": v.reason,
                "shares": [
                    {"neg": s.neg, "region": s.region, "percent": s.percent} for s in v.shares
                ],
            }
            for k, v in routes.items()
        },
    }
    return json.dumps(doc, indent=2)


def to_table(
    result: SimulationResult, resources: Sequence[Resource], scenario: Scenario, endpoints: bool
) -> str:
    rows = []
    for rec in result.records:
        rows.append(_row(rec, scenario.epoch))
    shown = [
        r
        for r, rec in zip(rows, result.records, strict=True)
        if endpoints or rec.kind != "Endpoint"
    ]
    out = [table(["TIME", "KIND", "RESOURCE", "CHANGE", "REASON"], shown)]
    out.append("")
    out.append("Detection windows (SPEC §2.1, from the first failing or passing probe):")
    for w in windows(resources, scenario):
        out.append(
            f"  {_short(w['healthCheck'])}: hang {w['failureWindowSec']:g} s, refused "
            f"{w['refusedWindowSec']:g} s, recovery {w['successWindowSec']:g} s"
        )
    moves = [r for r in result.records if isinstance(r, RouteChange)]
    out.append("")
    out.append(
        f"{result.probes} probes simulated over {scenario.duration:g} s; {len(moves)} route changes."
    )
    return "\n".join(out)


def _row(rec: Record, epoch: float = 0.0) -> list[str]:
    t = f"{rec.time - epoch:8.3f}"
    if isinstance(rec, Transition):
        res = f"{rec.project}/{rec.region}/{rec.name}"
        if rec.kind == "Endpoint":
            res = _short(rec.path).replace("/endpoints/", " ")
        return [t, rec.kind, res, f"{rec.previous.name} -> {rec.current.name}", rec.reason]
    if isinstance(rec, ShiftEnded):
        return [t, "Change", rec.path, "shift ended", rec.to_dict()["reason"]]
    if isinstance(rec, RampChange):
        return [t, "Ramp", _short(rec.frontend), f"{_short(rec.neg)} {rec.phase}", rec.reason]
    if isinstance(rec, Ejection):
        return [t, "Ejection", _short(rec.path).replace("/endpoints/", " "), rec.phase, rec.reason]
    if isinstance(rec, Hold):
        return [t, "Hold", rec.hold_id, rec.phase.value, rec.reason]
    if isinstance(rec, PracticeRecord):
        return [t, "PracticeRun", rec.name, rec.phase.value, rec.reason]
    if isinstance(rec, ConvergenceRecord):
        return [t, "Convergence", _short(rec.frontend), rec.phase.value, rec.reason]
    return [
        t,
        "Route",
        _short(rec.frontend),
        f"{_short(rec.previous)} -> {_short(rec.current)}",
        rec.reason,
    ]
