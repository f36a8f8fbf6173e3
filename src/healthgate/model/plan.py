"""Plans: what applying or deleting a set of documents would change.

Pure functions over resource sets, so ``apply --dry-run`` and the real apply
compute exactly the same thing, and the store only executes the result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from healthgate.model.addresses import Reserved, reserved_conflicts, reserved_message
from healthgate.model.names import ResourcePath
from healthgate.model.resources import MAX_PORTS_PER_PROJECT, ForwardingRule, Resource
from healthgate.model.rules import validate_documents
from healthgate.model.validation import Document, Issue, check_delete


@dataclass(slots=True)
class Plan:
    create: list[ResourcePath] = field(default_factory=list)
    update: list[ResourcePath] = field(default_factory=list)
    unchanged: list[ResourcePath] = field(default_factory=list)
    delete: list[ResourcePath] = field(default_factory=list)
    result: dict[ResourcePath, Resource] = field(default_factory=dict)  # the world after
    issues: list[Issue] = field(default_factory=list)
    warnings: list[Issue] = field(default_factory=list)  # worth saying; nothing refused for them
    # a delete's refusals, by kind: paths that do not exist, and what is in use
    missing: list[ResourcePath] = field(default_factory=list)
    in_use: list[Issue] = field(default_factory=list)

    @property
    def changes(self) -> int:
        return len(self.create) + len(self.update) + len(self.delete)

    # for each update, what changes: [(field path, before, after)]
    changes_by_path: dict[ResourcePath, list[tuple[str, Any, Any]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "create": [str(p) for p in self.create],
            "update": [str(p) for p in self.update],
            "unchanged": [str(p) for p in self.unchanged],
            "delete": [str(p) for p in self.delete],
            "warnings": [str(w) for w in self.warnings],
            "diff": {
                str(p): [{"field": f, "from": a, "to": b} for f, a, b in changes]
                for p, changes in self.changes_by_path.items()
            },
        }


MISSING: Any = None  # (a field that is absent on one side shows as null)


def field_diff(before: Any, after: Any, at: str = "") -> list[tuple[str, Any, Any]]:
    """The fields that differ between two wire documents, as paths like
    ``backends[0].failoverPriority`` (lists compared item by item)."""
    if isinstance(before, dict) and isinstance(after, dict):
        out = []
        for key in sorted(set(before) | set(after), key=str):
            where = f"{at}.{key}" if at else str(key)
            out += field_diff(before.get(key, MISSING), after.get(key, MISSING), where)
        return out
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        out = []
        for i, (a, b) in enumerate(zip(before, after, strict=True)):
            out += field_diff(a, b, f"{at}[{i}]")
        return out
    return [] if before == after else [(at, before, after)]


def plan_apply(
    current: Mapping[ResourcePath, Resource],
    documents: Sequence[Document],
    reserved: Sequence[Reserved] = (),
) -> Plan:
    """Create or replace every document; validate the whole resulting world.
    A forwarding rule written now may not take one of serve's own addresses
    (``reserved``: model/addresses.py); one already stored is the data
    plane's to skip, not a reason to refuse every other write."""
    plan = Plan(result=dict(current))
    seen: set[ResourcePath] = set()
    for doc in documents:
        path = doc.resource.path
        if path in seen:
            continue  # reported by validate_documents as a duplicate
        seen.add(path)
        old = current.get(path)
        if old is None:
            plan.create.append(path)
        elif old == doc.resource:
            plan.unchanged.append(path)
        else:
            plan.update.append(path)
            plan.changes_by_path[path] = [
                (f, "(secret)", "(secret)") if f in old.SECRET_FIELDS else (f, a, b)
                for f, a, b in field_diff(old.to_wire(), doc.resource.to_wire())
            ]
        plan.result[path] = doc.resource
    # validate the new world, with the documents (for locations) first
    by_path = {d.resource.path: d for d in documents}
    world = [by_path.get(p) or Document(r) for p, r in plan.result.items()]
    found = validate_documents(world) + _duplicates(documents)
    written = set(plan.create) | set(plan.update)
    ports = _ports_by_project(plan.result)
    for doc in documents:
        rule = doc.resource
        if isinstance(rule, ForwardingRule) and rule.path in written:
            found += [
                doc.issue("IPAddress", reserved_message(r))
                for r in reserved_conflicts(rule, reserved)
            ]
            if ports.get(rule.project, 0) > MAX_PORTS_PER_PROJECT:
                found.append(
                    doc.issue(
                        "portRange" if rule.port_range is not None else "ports",
                        f"project {rule.project}'s forwarding rules would listen on "
                        f"{ports[rule.project]} ports, more than the {MAX_PORTS_PER_PROJECT} "
                        "a project may (each is a listening socket)",
                    )
                )
    plan.issues = [i for i in found if not i.warning]
    plan.warnings = [i for i in found if i.warning]
    return plan


def _ports_by_project(world: Mapping[ResourcePath, Resource]) -> dict[str, int]:
    out: dict[str, int] = {}
    for res in world.values():
        if isinstance(res, ForwardingRule):
            out[res.project] = out.get(res.project, 0) + res.port_count()
    return out


def plan_delete(current: Mapping[ResourcePath, Resource], paths: Sequence[ResourcePath]) -> Plan:
    plan = Plan(result=dict(current))
    for path in paths:
        if path in current:
            plan.delete.append(path)
            del plan.result[path]
        else:
            plan.missing.append(path)
            plan.issues.append(Issue("", f"{path} not found", kind=path.kind, name=str(path)))
    plan.in_use = check_delete(plan.result.values(), plan.delete)
    plan.issues += plan.in_use
    return plan


def _duplicates(documents: Sequence[Document]) -> list[Issue]:
    seen: dict[ResourcePath, Document] = {}
    out = []
    for doc in documents:
        path = doc.resource.path
        if path in seen:
            out.append(
                doc.issue("name", f"duplicate resource {path} (also document {seen[path].index})")
            )
        seen[path] = doc
    return out
