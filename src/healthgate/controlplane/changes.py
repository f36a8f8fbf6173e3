"""Who changed what (SPEC §6): a ``Change`` record for every accepted write.

Every write that the API accepts - a manifest applied or deleted, a resource
created, replaced or deleted, a shift started, extended or ended - appends
one record per project it touched to the transition log, beside the
engine's transitions:

    {"kind": "Change", "project": "shop", "actor": "alice", "action": "apply",
     "resources": ["projects/shop/regions/us-east1/healthChecks/http-8080"],
     "reason": "updated healthChecks/http-8080 (checkIntervalSec 2 -> 5)", ...}

``actor`` is the token's name (tokens file entries carry a ``name``;
``local`` without tokens). The log is per project, so a project's
principals read their project's changes and nobody else's (consumers
included: a Change is among the kinds a consumer may read). ``to`` holds
the action and ``path`` the one resource touched (or the project), so
``events --kind Change --state delete`` and ``--resource PATH`` find them.

The record is appended after the write commits and before the API answers:
an acknowledged write always has its record; a crash between the two loses
the record of a write that was never acknowledged.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from healthgate.health.states import RecordKind, timestamp
from healthgate.model.names import ResourcePath
from healthgate.model.plan import Plan

MAX_RESOURCES = 100  # paths listed in one record (the summary counts the rest)
MAX_SUMMARY = 300  # characters of the one-line summary


def _short(path: ResourcePath | str) -> str:
    """``healthChecks/http-8080`` from a full path (the summary's way)."""
    parts = str(path).split("/")
    return "/".join(parts[-2:])


def _value(v: Any) -> str:
    text = json.dumps(v, separators=(",", ":"), default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def summary(
    created: Sequence[ResourcePath | str],
    updated: Sequence[ResourcePath | str],
    deleted: Sequence[ResourcePath | str],
    diffs: dict[str, list[tuple[str, Any, Any]]],
) -> str:
    """One line: what was created, updated (with the fields that changed)
    and deleted - bounded, the rest counted."""
    parts: list[str] = []
    for verb, paths in (("created", created), ("updated", updated), ("deleted", deleted)):
        if not paths:
            continue
        named = []
        for path in paths[:3]:
            fields = diffs.get(str(path)) or []
            detail = ", ".join(f"{f} {_value(a)} -> {_value(b)}" for f, a, b in fields[:3])
            more = f", +{len(fields) - 3} fields" if len(fields) > 3 else ""
            named.append(f"{_short(path)}" + (f" ({detail}{more})" if detail else ""))
        rest = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
        parts.append(f"{verb} {', '.join(named)}{rest}")
    text = "; ".join(parts) or "nothing changed"
    return text if len(text) <= MAX_SUMMARY else text[: MAX_SUMMARY - 3] + "..."


def change_records(
    actor: str,
    action: str,
    now: float,
    created: Iterable[ResourcePath] = (),
    updated: Iterable[ResourcePath] = (),
    deleted: Iterable[ResourcePath] = (),
    diffs: dict[str, list[tuple[str, Any, Any]]] | None = None,
    reason: str | None = None,
    extra: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One Change record per project touched (see the module doc)."""
    by_project: dict[str, dict[str, list[ResourcePath]]] = defaultdict(
        lambda: {"created": [], "updated": [], "deleted": []}
    )
    for verb, paths in (("created", created), ("updated", updated), ("deleted", deleted)):
        for path in paths:
            by_project[path.project][verb].append(path)
    out = []
    for project, touched in sorted(by_project.items()):
        paths = [*touched["created"], *touched["updated"], *touched["deleted"]]
        line = reason or summary(
            touched["created"], touched["updated"], touched["deleted"], diffs or {}
        )
        out.append(
            {
                "time": now,
                "timestamp": timestamp(now),
                "project": project,
                "region": "global",
                "kind": RecordKind.CHANGE.value,
                "name": action,
                "path": str(paths[0]) if len(paths) == 1 else f"projects/{project}",
                "from": None,
                "to": action,
                "reason": line,
                "actor": actor,
                "action": action,
                "resources": [str(p) for p in paths[:MAX_RESOURCES]],
                "resourceCount": len(paths),
                **(extra or {}),
            }
        )
    return out


def of_plan(actor: str, action: str, now: float, plan: Plan) -> list[dict[str, Any]]:
    """The Change records of an applied (or deleting) plan."""
    diffs = {str(p): list(c) for p, c in plan.changes_by_path.items()}
    return change_records(actor, action, now, plan.create, plan.update, plan.delete, diffs=diffs)
