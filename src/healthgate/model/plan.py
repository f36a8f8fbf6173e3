"""Plans: what applying or deleting a set of documents would change.

Pure functions over resource sets, so ``apply --dry-run`` and the real apply
compute exactly the same thing, and the store only executes the result.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from healthgate.model.addresses import Reserved, reserved_conflicts, reserved_message
from healthgate.model.index import WorldIndex
from healthgate.model.names import ResourcePath
from healthgate.model.resources import (
    MAX_PORTS_PER_PROJECT,
    CompositeHealthCheck,
    ForwardingRule,
    Resource,
    ServiceAttachment,
)
from healthgate.model.rules import _WILDCARDS, RULES, World, references, validate_documents
from healthgate.model.validation import Document, Issue, check_delete


@dataclass(slots=True)
class Plan:
    create: list[ResourcePath] = field(default_factory=list)
    update: list[ResourcePath] = field(default_factory=list)
    unchanged: list[ResourcePath] = field(default_factory=list)
    delete: list[ResourcePath] = field(default_factory=list)
    result: Mapping[ResourcePath, Resource] = field(default_factory=dict)  # the world after
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
    result = dict(current)
    plan = Plan(result=result)
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
        result[path] = doc.resource
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


# --------------------------------------------------------------------- by the change
#
# The plans above check the whole resulting world. The ones below check a
# change against the world's index (model/index.py), asking the same rules
# (model/rules.py) of the documents the change can affect - the documents
# written, and the resources that reference them - and the world rules by
# index lookups: the work is the change's. The control plane uses them for
# every write of up to INCREMENTAL_MAX documents.

INCREMENTAL_MAX = 500


class _After(Mapping[ResourcePath, Resource]):
    """The world after a change, as a view: the documents written over the world."""

    def __init__(
        self,
        world: Mapping[ResourcePath, Resource],
        written: Mapping[ResourcePath, Resource],
        deleted: frozenset[ResourcePath] = frozenset(),
    ) -> None:
        self.world, self.written, self.deleted = world, written, deleted

    def __getitem__(self, path: ResourcePath) -> Resource:
        found = self.written.get(path)
        if found is not None:
            return found
        if path in self.deleted:
            raise KeyError(path)
        return self.world[path]

    def __contains__(self, path: object) -> bool:
        return path in self.written or (path in self.world and path not in self.deleted)

    def __iter__(self) -> Iterator[ResourcePath]:
        yield from self.written
        for path in self.world:
            if path not in self.written and path not in self.deleted:
                yield path

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _AfterDocuments(Mapping[ResourcePath, Document]):
    """The same, as the documents the rules read (model/rules.py's World)."""

    def __init__(self, after: _After, documents: Mapping[ResourcePath, Document]) -> None:
        self.after, self.documents = after, documents

    def __getitem__(self, path: ResourcePath) -> Document:
        doc = self.documents.get(path)
        return doc if doc is not None else Document(self.after[path])

    def __contains__(self, path: object) -> bool:
        return path in self.after

    def __iter__(self) -> Iterator[ResourcePath]:
        return iter(self.after)

    def __len__(self) -> int:
        return len(self.after)


def plan_change(
    world: Mapping[ResourcePath, Resource],
    index: WorldIndex,
    documents: Sequence[Document],
    reserved: Sequence[Reserved] = (),
) -> Plan:
    """:func:`plan_apply`'s answer for a world whose index is ``index``, in
    proportion to the documents (see above)."""
    plan = Plan()
    by_path: dict[ResourcePath, Document] = {}
    for doc in documents:
        path = doc.resource.path
        if path in by_path:
            continue  # reported below as a duplicate
        by_path[path] = doc
        old = world.get(path)
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
    after = _After(world, {p: d.resource for p, d in by_path.items()})
    plan.result = after
    rules_world = World(_AfterDocuments(after, by_path), offline=False)
    written = set(plan.create) | set(plan.update)
    checked: dict[ResourcePath, Document] = {p: by_path[p] for p in written}
    for path in written:  # (what references a written resource may break with it)
        for user in index.referrers.get(path, {}):
            if user not in checked and user in after:
                checked[user] = by_path.get(user) or Document(after[user])
    found = _duplicates(documents)
    for doc in checked.values():
        found += references(doc, rules_world)
        for check in RULES.get(type(doc.resource), ()):
            found += check(doc, rules_world)
    rules = [by_path[p] for p in written if isinstance(by_path[p].resource, ForwardingRule)]
    found += _listen_conflicts(rules, index, after)
    found += _dns_conflicts(rules, index, after)
    found += _destination_issues(
        [by_path[p] for p in written if isinstance(by_path[p].resource, CompositeHealthCheck)],
        index,
        after,
    )
    found += _port_issues(rules, index, world, by_path)
    for doc in rules:
        rule = doc.resource
        assert isinstance(rule, ForwardingRule)
        found += [
            doc.issue("IPAddress", reserved_message(r)) for r in reserved_conflicts(rule, reserved)
        ]
    plan.issues = [i for i in found if not i.warning]
    plan.warnings = [i for i in found if i.warning]
    return plan


def _spans(rule: ForwardingRule) -> list[tuple[int, int]]:
    if rule.ports is not None:
        return [(p, p) for p in rule.ports]
    first, _, last = (rule.port_range or "0").partition("-")
    return [(int(first), int(last or first))]


def _listen_conflicts(
    rules: Sequence[Document], index: WorldIndex, after: Mapping[ResourcePath, Resource]
) -> list[Issue]:
    """listen_addresses (model/rules.py) for the rules written: each against
    the rules at its address and the wildcards of its family (and, written
    on a wildcard, every address of its family)."""
    issues: list[Issue] = []
    written = {d.resource.path for d in rules}
    for doc in rules:
        fr = doc.resource
        assert isinstance(fr, ForwardingRule)
        family = (fr.ip_protocol, ":" in fr.ip_address)
        keys: set[tuple[str, str]] = {(fr.ip_protocol, fr.ip_address)}
        wildcards = {k for k in index.by_family.get(family, ()) if k[1] in _WILDCARDS}
        keys |= wildcards
        if fr.ip_address in _WILDCARDS:
            keys |= index.by_family.get(family, set())
        others: set[ResourcePath] = set()
        for key in keys:
            others |= index.listening.get(key, set())
        for other_doc in rules:  # (written in the same manifest)
            other_fr = other_doc.resource
            assert isinstance(other_fr, ForwardingRule)
            if (other_fr.ip_protocol, ":" in other_fr.ip_address) == family:
                others.add(other_fr.path)
        mine = _spans(fr)
        for other_path in sorted(others):
            if other_path == fr.path:
                continue
            other = after.get(other_path)
            if not isinstance(other, ForwardingRule) or other.ip_protocol != fr.ip_protocol:
                continue
            same = (
                other.ip_address == fr.ip_address
                or _WILDCARDS.get(other.ip_address) == _WILDCARDS.get(fr.ip_address, -1)
                or other.ip_address in _WILDCARDS
                or (fr.ip_address in _WILDCARDS)
            )
            if not same or (":" in other.ip_address) != family[1]:
                continue
            overlap = next(
                ((max(a, c), min(b, d)) for a, b in mine for c, d in _spans(other)
                 if a <= d and c <= b),
                None,
            )  # fmt: skip
            if overlap is None:
                continue
            if other_path in written and other_path < fr.path:
                continue  # (a pair written together: reported once, on the later)
            owner = (
                str(other_path)
                if other_path.project == fr.project
                else "another project's forwarding rule"
            )
            issues.append(
                doc.issue(
                    "IPAddress",
                    f"{fr.ip_address} {fr.ip_protocol} ports {overlap[0]}-{overlap[1]} "
                    f"are already used by {owner}",
                )
            )
            break
    return issues


def _dns_conflicts(
    rules: Sequence[Document], index: WorldIndex, after: Mapping[ResourcePath, Resource]
) -> list[Issue]:
    """dns_names (model/rules.py) for the rules written."""
    issues: list[Issue] = []
    claimed: dict[str, ResourcePath] = {}
    for doc in sorted(rules, key=lambda d: d.resource.path):
        fr = doc.resource
        assert isinstance(fr, ForwardingRule)
        if fr.dns_name is None:
            continue
        holders = {
            p
            for p in index.dns_names.get(fr.dns_name, ())
            if p != fr.path
            and isinstance(after.get(p), ForwardingRule)
            and after[p].dns_name == fr.dns_name  # type: ignore[attr-defined]
        }
        if fr.dns_name in claimed:
            holders.add(claimed[fr.dns_name])
        claimed.setdefault(fr.dns_name, fr.path)
        if holders:
            other = min(holders)
            owner = str(other) if other.project == fr.project else "another project's rule"
            issues.append(doc.issue("dnsName", f"{fr.dns_name} is already the dnsName of {owner}"))
    return issues


def _destination_issues(
    composites: Sequence[Document], index: WorldIndex, after: Mapping[ResourcePath, Resource]
) -> list[Issue]:
    """destinations (model/rules.py) for the composites written."""
    issues: list[Issue] = []
    mine: dict[ResourcePath, list[ResourcePath]] = {}
    for doc in composites:
        dest = doc.resource.ref("health_destination")
        if dest is not None:
            mine.setdefault(dest, []).append(doc.resource.path)
    for doc in composites:
        res = doc.resource
        dest = res.ref("health_destination")
        if dest is None:
            continue
        sharing = {
            p
            for p in index.destinations.get(dest, ())
            if isinstance(after.get(p), CompositeHealthCheck)
            and after[p].ref("health_destination") == dest
        } | set(mine[dest])
        published = any(
            isinstance(after.get(a), ServiceAttachment) and after[a].ref("target_service") == dest
            for a in index.published.get(dest, ())
        )
        if dest in after and not published:
            issues.append(
                doc.warning(
                    "healthDestination",
                    f"no service attachment publishes {dest}: no consumer's PSC NEG "
                    "follows this composite (its forwarding rule's healthz still does)",
                )
            )
        if len(sharing) > 1:
            names = ", ".join(str(p) for p in sorted(sharing))
            issues.append(
                doc.issue(
                    "healthDestination",
                    f"forwarding rule {dest} is the destination of more than one composite "
                    f"health check ({names})",
                )
            )
        fr = after.get(dest)
        if isinstance(fr, ForwardingRule) and fr.is_global:
            issues.append(
                doc.issue("healthDestination", "must be a regional (producer) forwarding rule")
            )
    return issues


def _port_issues(
    rules: Sequence[Document],
    index: WorldIndex,
    world: Mapping[ResourcePath, Resource],
    by_path: Mapping[ResourcePath, Document],
) -> list[Issue]:
    """The ports of a project's rules together, for the rules written."""
    totals = dict(index.ports)
    for path, doc in by_path.items():
        if not isinstance(doc.resource, ForwardingRule):
            continue
        old = world.get(path)
        if isinstance(old, ForwardingRule):
            totals[old.project] = totals.get(old.project, 0) - old.port_count()
        totals[doc.resource.project] = (
            totals.get(doc.resource.project, 0) + doc.resource.port_count()
        )
    issues = []
    for doc in rules:
        fr = doc.resource
        assert isinstance(fr, ForwardingRule)
        if totals.get(fr.project, 0) > MAX_PORTS_PER_PROJECT:
            issues.append(
                doc.issue(
                    "portRange" if fr.port_range is not None else "ports",
                    f"project {fr.project}'s forwarding rules would listen on "
                    f"{totals[fr.project]} ports, more than the {MAX_PORTS_PER_PROJECT} "
                    "a project may (each is a listening socket)",
                )
            )
    return issues


def plan_delete_change(
    world: Mapping[ResourcePath, Resource], index: WorldIndex, paths: Sequence[ResourcePath]
) -> Plan:
    """:func:`plan_delete`'s answer from the index: what still uses a
    deleted resource is looked up, not found by a pass over the world."""
    plan = Plan()
    gone = set()
    for path in paths:
        if path in world:
            plan.delete.append(path)
            gone.add(path)
        else:
            plan.missing.append(path)
            plan.issues.append(Issue("", f"{path} not found", kind=path.kind, name=str(path)))
    plan.result = _After(world, {}, frozenset(gone))
    for path in plan.delete:
        for who, fields in sorted(index.referrers.get(path, {}).items()):
            if who in gone:
                continue
            for field_name in fields:
                plan.in_use.append(
                    Issue(
                        "",
                        f"{path} is in use: {who} references it in field {field_name}",
                        kind=path.kind,
                        name=str(path),
                    )
                )
    plan.issues += plan.in_use
    return plan


def plan_delete(current: Mapping[ResourcePath, Resource], paths: Sequence[ResourcePath]) -> Plan:
    result = dict(current)
    plan = Plan(result=result)
    for path in paths:
        if path in current:
            plan.delete.append(path)
            del result[path]
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
