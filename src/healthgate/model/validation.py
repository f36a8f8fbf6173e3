"""Validation: one resource (fields) and a whole set of resources (references).

Every problem is an :class:`Issue` that names where it is - the document
(its index and line in a manifest, and its kind and name) and the field path
(``backends[0].group``) - and says what was expected. Validation never stops
at the first problem: an operator fixing a manifest wants the whole list.

The cross-resource rules are those of SPEC §1 "Validation":

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
    BackendService,
    CompositeHealthCheck,
    ForwardingRule,
    HealthCheck,
    HealthSource,
    InstanceGroup,
    NetworkEndpointGroup,
    Resource,
    ServiceAttachment,
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
            if (
                sep
                and not field
                and head.replace(".", "").replace("[", "").replace("]", "").isalnum()
            ):
                field, msg = head, rest
            if err["type"] == "extra_forbidden":
                msg = "unknown field"
            elif err["type"] == "missing":
                msg = "required field is missing"
            elif "input" in err and err["type"] not in ("value_error",):
                msg = f"{msg} (got {brief(err['input'])})"
            issues.append(issue(field, msg, kind, name))
        return None, issues


# ------------------------------------------------------------------ a set of resources


PUBLISHABLE_NEG_TYPES = ("GCE_VM_IP_PORT", "GCE_VM_IP")


def validate_documents(documents: Sequence[Document], offline: bool = False) -> list[Issue]:
    """Every cross-resource rule over the complete set of resources.

    ``offline`` (``healthgate validate``, no server): a consumer's PSC NEG
    names a producer's service attachment in *another* project, which a
    consumer's manifest does not hold; that reference cannot be checked
    here, so it is reported as a warning, not an error."""
    issues: list[Issue] = []
    by_path: dict[ResourcePath, Document] = {}
    for doc in documents:
        path = doc.resource.path
        if path in by_path:
            issues.append(
                doc.issue(
                    "name", f"duplicate resource {path} (also document {by_path[path].index})"
                )
            )
            continue
        by_path[path] = doc

    def get(path: ResourcePath | None) -> Resource | None:
        doc = by_path.get(path) if path else None
        return doc.resource if doc else None

    destinations: dict[ResourcePath, list[Document]] = defaultdict(list)
    source_services: set[ResourcePath] = set()

    for doc in by_path.values():
        res = doc.resource
        # 1. every reference resolves and exists
        for ref in res.references():
            if ref.target is None:
                message = ref.error or "unresolvable reference"
                if isinstance(res, HealthSource) and "compositeHealthChecks" in ref.raw:
                    message = (
                        "a composite health state is never a health source: "
                        "a health source points at a backend service"
                    )
                issues.append(doc.issue(ref.field, message))
            elif ref.target not in by_path:
                if offline and ref.target.project != res.project:
                    issues.append(
                        doc.warning(
                            ref.field,
                            f"{ref.target} is in another project, not in this manifest: "
                            "not checked offline (apply checks it)",
                        )
                    )
                    continue
                issues.append(doc.issue(ref.field, f"reference to missing resource {ref.target}"))

        if isinstance(res, HealthSource):
            _check_same_scope(doc, issues)
            bs_path = res.ref("sources")
            if bs_path:
                source_services.add(bs_path)
        elif isinstance(res, CompositeHealthCheck):
            _check_same_scope(doc, issues)
            dest = res.ref("health_destination")
            if dest:
                destinations[dest].append(doc)
            seen: set[ResourcePath] = set()
            for i, src in enumerate(res.refs("health_sources")):
                if src in seen:
                    issues.append(
                        doc.issue(f"healthSources[{i}]", f"duplicate health source {src}")
                    )
                seen.add(src)
        elif isinstance(res, BackendService):
            _check_backend_groups(doc, get, issues)
        elif isinstance(res, NetworkEndpointGroup) and res.network_endpoint_type == (
            "PRIVATE_SERVICE_CONNECT"
        ):
            target = res.ref("psc_target_service")
            if target is not None and target.region != res.region:
                issues.append(
                    doc.issue(
                        "pscTargetService",
                        f"a PSC NEG in {res.region} reaches a service attachment of its own "
                        f"region, not {target.region}",
                    )
                )
        elif isinstance(res, ForwardingRule):
            _check_forwarding_rule(doc, get(res.ref("backend_service")), issues)
        elif isinstance(res, ServiceAttachment):
            target = res.ref("target_service")
            if target and (target.project, target.region) != (res.project, res.region):
                issues.append(
                    doc.issue(
                        "targetService",
                        "must be a forwarding rule in the attachment's own project and region",
                    )
                )
            fr = get(target)
            if isinstance(fr, ForwardingRule) and fr.is_global:
                issues.append(
                    doc.issue("targetService", "must be a regional (producer) forwarding rule")
                )

    # a backend service used as a health source is INTERNAL or INTERNAL_MANAGED
    for doc in by_path.values():
        res = doc.resource
        if isinstance(res, HealthSource):
            bs = get(res.ref("sources"))
            if isinstance(bs, BackendService) and bs.load_balancing_scheme not in (
                "INTERNAL",
                "INTERNAL_MANAGED",
            ):
                issues.append(
                    doc.issue(
                        "sources[0]",
                        f"backend service {bs.path} has loadBalancingScheme "
                        f"{bs.load_balancing_scheme}; a health source needs INTERNAL or INTERNAL_MANAGED",
                    )
                )
            if isinstance(bs, BackendService) and bs.is_global:
                issues.append(
                    doc.issue("sources[0]", "a health source names a regional backend service")
                )

    issues += _check_listen_addresses(by_path.values())
    dns_names: dict[str, Document] = {}
    for doc in by_path.values():
        res = doc.resource
        if isinstance(res, ForwardingRule) and res.dns_name is not None:
            other = dns_names.setdefault(res.dns_name, doc)
            if other is not doc:
                issues.append(
                    doc.issue(
                        "dnsName",
                        f"{res.dns_name} is already the dnsName of {other.resource.path}",
                    )
                )

    published = {
        doc.resource.ref("target_service")
        for doc in by_path.values()
        if isinstance(doc.resource, ServiceAttachment)
    }
    for dest, docs in destinations.items():
        if dest in by_path and dest not in published:
            for d in docs:
                issues.append(
                    d.warning(
                        "healthDestination",
                        f"no service attachment publishes {dest}: no consumer's PSC NEG "
                        "follows this composite (its forwarding rule's healthz still does)",
                    )
                )
        if len(docs) > 1:
            names = ", ".join(str(d.resource.path) for d in docs)
            for d in docs:
                issues.append(
                    d.issue(
                        "healthDestination",
                        f"forwarding rule {dest} is the destination of more than one composite health check ({names})",
                    )
                )
        fr = get(dest)
        if isinstance(fr, ForwardingRule) and fr.is_global:
            for d in docs:
                issues.append(
                    d.issue("healthDestination", "must be a regional (producer) forwarding rule")
                )
    return issues


def _check_same_scope(doc: Document, issues: list[Issue]) -> None:
    res = doc.resource
    for ref in res.references():
        t = ref.target
        if t and (t.project, t.region) != (res.project, res.region):
            issues.append(
                doc.issue(
                    ref.field,
                    f"{t} is in project {t.project!r} region {t.region!r}; composite health "
                    f"resources and what they reference must share project {res.project!r} "
                    f"and region {res.region!r}",
                )
            )


def _check_backend_groups(doc: Document, get: Any, issues: list[Issue]) -> None:
    bs = doc.resource
    assert isinstance(bs, BackendService)
    hc = get(bs.ref("health_checks"))
    seen_endpoints: dict[tuple[str, int | None], str] = {}
    group_refs = {r.field: r for r in bs.references() if r.field.startswith("backends[")}
    for i in range(len(bs.backends)):
        field = f"backends[{i}].group"
        ref = group_refs[field]
        group = get(ref.target)
        if group is None:
            continue  # reported as a missing reference
        if bs.is_global:
            if not (
                isinstance(group, NetworkEndpointGroup)
                and group.network_endpoint_type == "PRIVATE_SERVICE_CONNECT"
            ):
                issues.append(
                    doc.issue(
                        field,
                        "a global backend service's backends are PRIVATE_SERVICE_CONNECT network endpoint groups",
                    )
                )
            elif group.project != bs.project:
                # the attachment accepted that NEG's project, not this one: a
                # service of another project must not reach the producer through it
                issues.append(
                    doc.issue(
                        field,
                        f"a global backend service uses PSC NEGs of its own project "
                        f"({bs.project!r}) only: the producer accepted the NEG's project, not this one",
                    )
                )
            continue
        if (group.project, group.region) != (bs.project, bs.region):
            issues.append(
                doc.issue(
                    field, "a regional backend service's groups are in its own project and region"
                )
            )
        if isinstance(group, NetworkEndpointGroup):
            if group.network_endpoint_type not in PUBLISHABLE_NEG_TYPES:
                issues.append(
                    doc.issue(
                        field,
                        f"a published service's backends are GCE_VM_IP_PORT or GCE_VM_IP groups or instance groups, not {group.network_endpoint_type}",
                    )
                )
                continue
            addrs = [(e.ip_address, e.port) for e in group.endpoints]
            port_less = group.network_endpoint_type == "GCE_VM_IP"
        elif isinstance(group, InstanceGroup):
            port = group.serving_port
            addrs = [(inst.ip_address, port) for inst in group.instances]
            port_less = port is None
        else:
            continue
        if port_less and isinstance(hc, HealthCheck) and hc.port is None and addrs:
            issues.append(
                doc.issue(
                    "healthChecks[0]",
                    f"health check {hc.path} has no port, and the endpoints of {group.path} have none either",
                )
            )
        for addr in addrs:
            if addr in seen_endpoints:
                ip, port = addr
                issues.append(
                    doc.issue(field, f"endpoint {ip}:{port} is also in {seen_endpoints[addr]}")
                )
            else:
                seen_endpoints[addr] = str(group.path)


def _check_forwarding_rule(doc: Document, bs: Resource | None, issues: list[Issue]) -> None:
    fr = doc.resource
    assert isinstance(fr, ForwardingRule)
    if not isinstance(bs, BackendService):
        return
    if fr.is_global and bs.project != fr.project:
        issues.append(
            doc.issue(
                "backendService",
                f"a global forwarding rule uses a backend service of its own project ({fr.project!r})",
            )
        )
    if bs.is_global != fr.is_global:
        scope = "global" if fr.is_global else "regional"
        issues.append(
            doc.issue(
                "backendService", f"a {scope} forwarding rule points at a {scope} backend service"
            )
        )
    elif not fr.is_global and (bs.project, bs.region) != (fr.project, fr.region):
        issues.append(
            doc.issue("backendService", "must be in the forwarding rule's own project and region")
        )
    want = "UDP" if bs.protocol == "UDP" else "TCP"
    if fr.ip_protocol != want:
        issues.append(
            doc.issue(
                "IPProtocol", f"backend service protocol {bs.protocol} needs IPProtocol {want}"
            )
        )


_WILDCARDS = {"0.0.0.0": 4, "::": 6}


def _check_listen_addresses(documents: Iterable[Document]) -> list[Issue]:
    """No two forwarding rules listen on the same address, port and protocol
    (a wildcard address overlaps every address of its family): the second
    would not get its listener, or take the first one's after a restart."""
    by_key: dict[tuple[str, str], list[tuple[int, int, Document]]] = defaultdict(list)
    for doc in documents:
        fr = doc.resource
        if isinstance(fr, ForwardingRule):
            if fr.ports is not None:
                ranges = [(p, p) for p in fr.ports]
            else:
                first, _, last = (fr.port_range or "0").partition("-")
                ranges = [(int(first), int(last or first))]
            for lo_, hi_ in ranges:
                by_key[(fr.ip_protocol, fr.ip_address)].append((lo_, hi_, doc))
    issues: list[Issue] = []
    reported: set[ResourcePath] = set()
    for (protocol, ip), spans in by_key.items():
        combined = list(spans)
        family = _WILDCARDS.get(ip)
        for (proto2, ip2), spans2 in by_key.items():
            if proto2 != protocol or ip2 == ip:
                continue
            v6 = ":" in ip2
            if (family is not None and v6 == (family == 6)) or (
                _WILDCARDS.get(ip2) is not None and v6 == (":" in ip)
            ):
                combined += spans2  # a wildcard overlaps every address of its family
        # a sweep in port order: each span is checked against the one reaching
        # furthest before it (O(n log n), not every pair)
        combined.sort(key=lambda span: (span[0], span[1], span[2].resource.path))
        reach: tuple[int, int, Document] | None = None
        for span in combined:
            lo, hi, doc = span
            if reach is not None and lo <= reach[1] and reach[2] is not doc:
                path, other = doc.resource.path, reach[2].resource.path
                if path not in reported:
                    reported.add(path)
                    # name the other rule only inside the same project
                    owner = (
                        str(other)
                        if other.project == path.project
                        else ("another project's forwarding rule")
                    )
                    issues.append(
                        doc.issue(
                            "IPAddress",
                            f"{doc.resource.ip_address} {protocol} ports {lo}-{min(hi, reach[1])} "  # type: ignore[attr-defined]
                            f"are already used by {owner}",
                        )
                    )
            if reach is None or hi > reach[1]:
                reach = span
    return issues


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
