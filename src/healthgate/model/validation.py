"""Validation: one resource (fields) and a whole set of resources (references).

Every problem is an :class:`Issue` that names where it is - the document
(its index and line in a manifest, and its kind and name) and the field path
(``backends[0].group``) - and says what was expected. Validation never stops
at the first problem: an operator fixing a manifest wants the whole list.

The cross-resource rules (model/rules.py, :func:`validate_documents`) are
those of SPEC §1 "Validation":

* references resolve, to the right collection, to a resource that exists;
* a health source names exactly one backend service, and never a composite;
* a backend service used as a health source is INTERNAL or INTERNAL_MANAGED;
* a published (regional) service's backends are GCE_VM_IP_PORT / GCE_VM_IP
  NEGs or instance groups; a global one's are PSC NEGs;
* a composite has 1-10 sources; a forwarding rule is the destination of at
  most one composite;
* policy, source, composite and what they reference share project and region;
* a resource that others reference cannot be deleted.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from healthgate.model.names import ResourcePath, brief
from healthgate.model.resources import (
    KIND_CLASSES,
    Resource,
)


@dataclass(frozen=True, slots=True)
class Issue:
    """One validation problem, located precisely."""

    field: str
    message: str
    document: int | None = None  # 1-based index in a manifest
    line: int | None = None
    kind: str | None = None
    name: str | None = None  # full path when known, else the bare name
    warning: bool = False  # worth saying, but nothing is refused for it

    def where(self) -> str:
        parts = []
        if self.document is not None:
            at = f"document {self.document}"
            if self.line is not None:
                at += f" (line {self.line})"
            parts.append(at)
        if self.kind or self.name:
            parts.append(f"{self.kind or '?'} {self.name or '?'}")
        return ", ".join(parts)

    def __str__(self) -> str:
        where = self.where()
        field = f"field {self.field}: " if self.field else ""
        return f"{where}: {field}{self.message}" if where else f"{field}{self.message}"

    def to_detail(self) -> dict[str, Any]:
        detail: dict[str, Any] = {"field": self.field, "description": self.message}
        if self.document is not None:
            detail["document"] = self.document
        if self.line is not None:
            detail["line"] = self.line
        if self.name is not None:
            detail["resource"] = self.name
        return detail


class InvalidResources(ValueError):
    """Raised with every issue found; nothing was applied."""

    def __init__(self, issues: Sequence[Issue]) -> None:
        self.issues = list(issues)
        super().__init__("\n".join(str(i) for i in self.issues))


@dataclass(frozen=True, slots=True)
class Document:
    """A parsed resource and where it came from (for error messages)."""

    resource: Resource
    index: int | None = None
    line: int | None = None

    def issue(self, field: str, message: str) -> Issue:
        r = self.resource
        return Issue(field, message, self.index, self.line, r.kind, str(r.path))

    def warning(self, field: str, message: str) -> Issue:
        return replace(self.issue(field, message), warning=True)


# ------------------------------------------------------------------ one resource


def _loc_to_field(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def parse_resource(
    data: Any, index: int | None = None, line: int | None = None
) -> tuple[Resource | None, list[Issue]]:
    """Turn one mapping into a resource, or into the list of what is wrong with it."""

    def issue(field: str, message: str, kind: str | None = None, name: str | None = None) -> Issue:
        return Issue(field, message, index, line, kind, name)

    if not isinstance(data, Mapping):
        return None, [
            issue("", f"expected a mapping with kind, name and project, got {type(data).__name__}")
        ]
    kind = data.get("kind")
    name = data.get("name") if isinstance(data.get("name"), str) else None
    if not isinstance(kind, str) or kind not in KIND_CLASSES:
        known = ", ".join(KIND_CLASSES)
        given = kind if isinstance(kind, str) else None
        return None, [issue("kind", f"expected one of {known}, got {brief(kind)}", given, name)]
    cls = KIND_CLASSES[kind]
    try:
        return cls.model_validate(dict(data)), []
    except ValidationError as exc:
        issues = []
        for err in exc.errors(include_url=False):
            field = _loc_to_field(err["loc"])
            msg = str(err["msg"]).removeprefix("Value error, ")
            # model-level rules say which field they are about as "field: message"
            head, sep, rest = msg.partition(": ")
            if sep and head.replace(".", "").replace("[", "").replace("]", "").isalnum():
                if not field:
                    field, msg = head, rest
                elif err["type"] == "value_error" and head[:1].islower():
                    field, msg = f"{field}.{head}", rest  # (a nested model's own field)
            if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
                msg = "unknown field"
            elif err["type"] in ("missing", "missing_argument"):
                msg = "required field is missing"
            elif "input" in err and err["type"] not in ("value_error",):
                msg = f"{msg} (got {brief(err['input'])})"
            issues.append(issue(field, msg, kind, name))
        return None, issues


# ------------------------------------------------------------------ a set of resources


# ------------------------------------------------------------------ deletion


def referrers(resources: Iterable[Resource]) -> dict[ResourcePath, list[tuple[ResourcePath, str]]]:
    """Who references whom: target -> [(referrer, field)]."""
    out: dict[ResourcePath, list[tuple[ResourcePath, str]]] = defaultdict(list)
    for res in resources:
        for ref in res.references():
            if ref.target is not None:
                out[ref.target].append((res.path, ref.field))
    return out


def check_delete(remaining: Iterable[Resource], deleted: Iterable[ResourcePath]) -> list[Issue]:
    """Issues for each deleted resource that a *remaining* resource still references."""
    users = referrers(remaining)
    issues = []
    for path in deleted:
        for who, field in users.get(path, ()):
            issues.append(
                Issue(
                    "",
                    f"{path} is in use: {who} references it in field {field}",
                    kind=path.kind,
                    name=str(path),
                )
            )
    return issues


def resource_from_wire(data: object) -> Resource:
    """A resource written as its wire form by another healthgate process
    (process/frames.py): parsed and checked again, ValueError naming the
    problems when it is not one."""
    res, issues = parse_resource(data)
    if res is None:
        raise ValueError("; ".join(map(str, issues))[:300] or "not a resource")
    return res
