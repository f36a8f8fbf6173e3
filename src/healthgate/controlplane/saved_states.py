"""Saved engine states: transition records in, state-store entries out, and back.

The state store keeps, last write wins, ``endpoint/<endpoint path>``,
``node/<source, composite or NEG path>`` and ``route/<front-end path>``:
what a restart (or a new leader, in a cluster) resumes from instead of
UNKNOWN.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from healthgate.health.engine import HealthEngine, Route
from healthgate.health.routing import Share
from healthgate.health.states import HealthState, RouteMode
from healthgate.store.base import sane_time

log = logging.getLogger("healthgate.control")


def encode_record_states(records: Sequence[Any]) -> dict[str, Any]:
    """Records -> state-store puts (last write wins)."""
    puts: dict[str, Any] = {}
    for r in records:
        d = r.to_dict()
        if d["kind"] in ("Change", "Ejection", "Hold", "PracticeRun", "Convergence"):
            # (a shift that ended, a practice run's or a data plane's record:
            # no state to resume; ejections and holds
            # are the running process's, and end with it)
            continue
        if d["kind"] == "Ramp":  # the front end's ramps in progress after it
            puts["ramp/" + d["frontend"]] = {"ramps": d["ramps"]}
            continue
        if d["kind"] == "Route":
            puts["route/" + d["frontend"]] = {
                "target": d["to"],
                "mode": d["mode"],
                "reason": d["reason"],
                "since": d["time"],
                "attachment": getattr(r, "attachment", None),
                # a split route's shares (SPEC §6): so that a restart does not
                # take the split for a change and record it again
                "shares": d.get("shares", []),
            }
        elif d["kind"] == "Endpoint":
            puts["endpoint/" + d["path"]] = {"state": d["to"], "since": d["time"]}
        else:
            puts["node/" + d["path"]] = {
                "state": d["to"],
                "reason": d["reason"],
                "since": d["time"],
            }
    return puts


def decode_states(
    states: Mapping[str, Any],
) -> tuple[
    dict[str, tuple[HealthState, float]],
    dict[str, tuple[HealthState, str, float]],
    dict[str, Route],
    dict[str, dict[str, float]],
]:
    """The stored states: endpoints, nodes, routes and ramps in progress
    (front end -> {NEG path: start}); an unreadable entry is skipped, logged."""
    endpoints: dict[str, tuple[HealthState, float]] = {}
    nodes: dict[str, tuple[HealthState, str, float]] = {}
    routes: dict[str, Route] = {}
    ramps: dict[str, dict[str, float]] = {}
    for key, v in states.items():
        kind, _, path = key.partition("/")
        try:
            if kind == "ramp":
                ramps[path] = _ramps(v["ramps"])
            elif kind == "endpoint":
                endpoints[path] = (HealthState[v["state"]], sane_time(v["since"]))
            elif kind == "node":
                nodes[path] = (HealthState[v["state"]], str(v["reason"]), sane_time(v["since"]))
            elif kind == "route":
                target, attachment = v["target"], v.get("attachment")
                if not all(x is None or isinstance(x, str) for x in (target, attachment)):
                    raise ValueError("target and attachment are paths")
                routes[path] = Route(
                    path,
                    target,
                    attachment,
                    RouteMode(v["mode"]),
                    str(v["reason"]),
                    sane_time(v["since"]),
                    shares=_shares(v.get("shares")),
                )
        except (KeyError, TypeError, ValueError):
            log.warning("ignoring unreadable stored state %s", key)
    return endpoints, nodes, routes, ramps


def _ramps(value: Any) -> dict[str, float]:
    if not isinstance(value, list) or len(value) > 1000:
        raise ValueError("ramps: a list")
    out = {}
    for r in value:
        if not isinstance(r, dict) or not isinstance(r.get("neg"), str):
            raise ValueError("ramps: {neg, start}")
        out[r["neg"]] = sane_time(r["start"])
    return out


def engine_states(engine: HealthEngine) -> dict[str, Any]:
    """Every source, composite, NEG and route state the engine holds now, as
    state-store puts: what a newly elected leader writes once, so that the
    stored states are whole even if transitions fell between two leaders."""
    puts: dict[str, Any] = {}
    for _kind, status in engine.node_states():
        puts["node/" + status.path] = {
            "state": status.state.name,
            "reason": status.reason,
            "since": status.since,
        }
    for frontend, route in engine.route_table().routes.items():
        # as last recorded (during a ramp: where traffic is going)
        shares = route.shares if route.recorded is None else route.recorded
        target = shares[0].neg if route.recorded is not None and shares else route.target
        puts["route/" + frontend] = {
            "target": target,
            "mode": route.mode,
            "reason": route.reason,
            "since": route.since,
            "attachment": route.attachment if target == route.target else None,
            "shares": [
                {"neg": s.neg, "region": s.region, "percent": s.percent}
                for s in shares
                if len(shares) > 1
            ],
        }
    for frontend, ramps in engine.ramps().items():
        puts["ramp/" + frontend] = {"ramps": [{"neg": n, "start": t} for n, t in ramps.items()]}
    return puts


def _shares(value: Any) -> tuple[Share, ...]:
    """A stored route's shares (none: all of it to its target); checked, as
    every value read back from a store."""
    if not value:
        return ()
    if not isinstance(value, list) or len(value) > 1000:
        raise ValueError("shares: a list")
    out = []
    for s in value:
        percent = float(s["percent"])
        if not (isinstance(s["neg"], str) and isinstance(s["region"], str) and 0 < percent <= 100):
            raise ValueError("shares: {neg, region, percent}")
        out.append(Share(s["neg"], s["region"], percent, ""))
    return tuple(out)
