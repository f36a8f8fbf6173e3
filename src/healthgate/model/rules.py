"""The cross-resource rules of SPEC §1 "Validation", as a table.

:data:`RULES` maps each kind to its rules, each a function of one document
and the :class:`World` (the whole set being validated) that returns the
issues it finds; :data:`WORLD_RULES` are the rules over the whole set (two
rules at one address, one dnsName twice, one destination for two
composites). Every document's references are checked first, whatever its
kind. Adding a rule is adding a function and a table entry.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence

from healthgate.gcpause import gc_paused
from healthgate.model.checks import Secret, header_value_problem
from healthgate.model.names import ResourcePath
from healthgate.model.practice import PracticeRun
from healthgate.model.resources import (
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
from healthgate.model.validation import Document, Issue

PUBLISHABLE_NEG_TYPES = ("GCE_VM_IP_PORT", "GCE_VM_IP")


class World:
    """The documents being validated, by path."""

    def __init__(self, by_path: Mapping[ResourcePath, Document], offline: bool) -> None:
        self.by_path = by_path
        self.offline = offline

    def get(self, path: ResourcePath | None) -> Resource | None:
        doc = self.by_path.get(path) if path else None
        return doc.resource if doc else None

    def documents(self) -> Iterator[Document]:
        return iter(self.by_path.values())


Rule = Callable[[Document, World], list[Issue]]
WorldRule = Callable[[World], list[Issue]]


def references(doc: Document, world: World) -> list[Issue]:
    """Every reference resolves, to the right collection, to a resource that
    exists (offline, one in another project is a warning: see
    validate_documents)."""
    issues: list[Issue] = []
    res = doc.resource
    for ref in res.references():
        if ref.target is None:
            message = ref.error or "unresolvable reference"
            if isinstance(res, HealthSource) and "compositeHealthChecks" in ref.raw:
                message = (
                    "a composite health state is never a health source: "
                    "a health source points at a backend service"
                )
            issues.append(doc.issue(ref.field, message))
        elif ref.target.collection == "secrets" and ref.target.project != res.project:
            # (said before the target is looked up: whether another
            # project's secret exists is not for this writer to learn)
            message = (
                f"{ref.target} is in project {ref.target.project!r}: a check reads the "
                f"secrets of its own project ({res.project!r}) only"
            )
            issues.append(doc.issue(ref.field, message))
        elif isinstance(res, PracticeRun) and ref.target.project != res.project:
            message = (
                f"{ref.target} is in project {ref.target.project!r}: a practice run watches "
                f"its own project's resources ({res.project!r}) only"
            )
            issues.append(doc.issue(ref.field, message))
        elif ref.target not in world.by_path:
            if world.offline and ref.target.project != res.project:
                issues.append(
                    doc.warning(
                        ref.field,
                        f"{ref.target} is in another project, not in this manifest: "
                        "not checked offline (apply checks it)",
                    )
                )
                continue
            issues.append(doc.issue(ref.field, f"reference to missing resource {ref.target}"))
    return issues


def internal_source(doc: Document, world: World) -> list[Issue]:
    """A backend service used as a health source is regional, INTERNAL or INTERNAL_MANAGED."""
    res = doc.resource
    assert isinstance(res, HealthSource)
    bs = world.get(res.ref("sources"))
    issues: list[Issue] = []
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
        issues.append(doc.issue("sources[0]", "a health source names a regional backend service"))
    return issues


def distinct_sources(doc: Document, world: World) -> list[Issue]:
    """A composite names each health source once."""
    res = doc.resource
    issues: list[Issue] = []
    seen: set[ResourcePath] = set()
    for i, src in enumerate(res.refs("health_sources")):
        if src in seen:
            issues.append(doc.issue(f"healthSources[{i}]", f"duplicate health source {src}"))
        seen.add(src)
    return issues


def psc_target_in_region(doc: Document, world: World) -> list[Issue]:
    """A PSC NEG reaches a service attachment of its own region."""
    res = doc.resource
    assert isinstance(res, NetworkEndpointGroup)
    if res.network_endpoint_type != "PRIVATE_SERVICE_CONNECT":
        return []
    target = res.ref("psc_target_service")
    if target is not None and target.region != res.region:
        return [
            doc.issue(
                "pscTargetService",
                f"a PSC NEG in {res.region} reaches a service attachment of its own "
                f"region, not {target.region}",
            )
        ]
    return []


def attachment_target(doc: Document, world: World) -> list[Issue]:
    """An attachment publishes a regional rule of its own project and region."""
    res = doc.resource
    issues: list[Issue] = []
    target = res.ref("target_service")
    if target and (target.project, target.region) != (res.project, res.region):
        issues.append(
            doc.issue(
                "targetService",
                "must be a forwarding rule in the attachment's own project and region",
            )
        )
    fr = world.get(target)
    if isinstance(fr, ForwardingRule) and fr.is_global:
        issues.append(doc.issue("targetService", "must be a regional (producer) forwarding rule"))
    return issues


def same_scope(doc: Document, world: World) -> list[Issue]:
    """Policy, source, composite and what they reference share project and region."""
    issues: list[Issue] = []
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
    return issues


def check_secrets(doc: Document, world: World) -> list[Issue]:
    """A check reads its own project's secrets only, and each holds what
    its use needs: a header value one line, a client certificate a PEM
    certificate and its key, a CA a PEM certificate (SPEC §10). Checked
    again whenever either is written: a rotated secret must fit too. The
    messages never quote a secret's value."""
    issues: list[Issue] = []
    res = doc.resource
    for ref in res.references():
        t = ref.target
        if t is None or t.collection != "secrets":
            continue
        secret = world.get(t) if t.project == res.project else None  # (references says)
        if not isinstance(secret, Secret):
            continue  # (missing: the references rule says so)
        value = secret.value
        problem: str | None = None
        if ref.field.startswith("requestHeaders"):
            problem = header_value_problem(value)
        elif ref.field.startswith("clientCertificate"):
            if "-----BEGIN CERTIFICATE-----" not in value or "PRIVATE KEY-----" not in value:
                problem = "expected PEM: a certificate (BEGIN CERTIFICATE) and its private key"
        elif "-----BEGIN CERTIFICATE-----" not in value:
            problem = "expected PEM: one or more CA certificates (BEGIN CERTIFICATE)"
        if problem is not None:
            issues.append(doc.issue(ref.field, f"secret {t} does not fit: {problem}"))
    return issues


def backend_groups(doc: Document, world: World) -> list[Issue]:
    """A published service's groups are its own project's and region's
    GCE_VM_IP_PORT / GCE_VM_IP NEGs or instance groups (a global one's, PSC
    NEGs of its own project); no endpoint in two groups; a port-less group
    needs a check with a port."""
    issues: list[Issue] = []
    get = world.get
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
    return issues


def forwarding_rule(doc: Document, world: World) -> list[Issue]:
    """A rule and its backend service agree on scope, project, region and protocol."""
    issues: list[Issue] = []
    fr = doc.resource
    assert isinstance(fr, ForwardingRule)
    bs = world.get(fr.ref("backend_service"))
    if not isinstance(bs, BackendService):
        return issues
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
    return issues


_WILDCARDS = {"0.0.0.0": 4, "::": 6}


def listen_addresses(world: World) -> list[Issue]:
    """No two forwarding rules listen on the same address, port and protocol
    (a wildcard address overlaps every address of its family): the second
    would not get its listener, or take the first one's after a restart."""
    by_key: dict[tuple[str, str], list[tuple[int, int, Document]]] = defaultdict(list)
    for doc in world.documents():
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
    # a wildcard overlaps every address of its family: the keys by (protocol,
    # family), and the wildcards apart (few: no pass over every pair of keys,
    # which cost 33 s at 10,000 rules)
    family_keys: dict[tuple[str, bool], list[tuple[str, str]]] = defaultdict(list)
    wildcard_keys: dict[tuple[str, bool], list[tuple[str, str]]] = defaultdict(list)
    for key in by_key:
        family_keys[(key[0], ":" in key[1])].append(key)
        if key[1] in _WILDCARDS:
            wildcard_keys[(key[0], ":" in key[1])].append(key)
    for (protocol, ip), spans in by_key.items():
        combined = list(spans)
        overlapping = family_keys if ip in _WILDCARDS else wildcard_keys
        for key2 in overlapping.get((protocol, ":" in ip), ()):
            if key2[1] != ip:
                combined += by_key[key2]
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


def dns_names(world: World) -> list[Issue]:
    """A dnsName is one rule's."""
    issues: list[Issue] = []
    seen: dict[str, Document] = {}
    for doc in world.documents():
        res = doc.resource
        if isinstance(res, ForwardingRule) and res.dns_name is not None:
            other = seen.setdefault(res.dns_name, doc)
            if other is not doc:
                path = other.resource.path  # (named only inside the same project)
                owner = str(path) if path.project == res.project else "another project's rule"
                issues.append(
                    doc.issue("dnsName", f"{res.dns_name} is already the dnsName of {owner}")
                )
    return issues


def destinations(world: World) -> list[Issue]:
    """A forwarding rule is the destination of at most one composite, a
    regional one; a destination no attachment publishes is a warning."""
    by_dest: dict[ResourcePath, list[Document]] = defaultdict(list)
    published = set()
    for doc in world.documents():
        res = doc.resource
        if isinstance(res, CompositeHealthCheck):
            dest = res.ref("health_destination")
            if dest:
                by_dest[dest].append(doc)
        elif isinstance(res, ServiceAttachment):
            published.add(res.ref("target_service"))
    issues: list[Issue] = []
    for dest, docs in by_dest.items():
        if dest in world.by_path and dest not in published:
            issues += [
                d.warning(
                    "healthDestination",
                    f"no service attachment publishes {dest}: no consumer's PSC NEG "
                    "follows this composite (its forwarding rule's healthz still does)",
                )
                for d in docs
            ]
        if len(docs) > 1:
            names = ", ".join(str(d.resource.path) for d in docs)
            issues += [
                d.issue(
                    "healthDestination",
                    f"forwarding rule {dest} is the destination of more than one composite "
                    f"health check ({names})",
                )
                for d in docs
            ]
        fr = world.get(dest)
        if isinstance(fr, ForwardingRule) and fr.is_global:
            issues += [
                d.issue("healthDestination", "must be a regional (producer) forwarding rule")
                for d in docs
            ]
    return issues


def practice_targets(doc: Document, world: World) -> list[Issue]:
    """What a practice run watches is what its checks can read: a front end
    is a consumer's (global) forwarding rule, a NEG a PSC NEG; and what it
    moves away from is its own project's (SPEC §11)."""
    res = doc.resource
    assert isinstance(res, PracticeRun)
    issues: list[Issue] = []
    for ref in res.references():
        target = world.get(ref.target) if ref.target else None
        if ref.target is None or target is None or ref.target.project != res.project:
            continue  # (the references rule says so)
        if isinstance(target, ForwardingRule) and not target.is_global:
            issues.append(doc.issue(ref.field, "must be a consumer front end (a global rule)"))
        if isinstance(target, NetworkEndpointGroup) and not target.psc_target_service:
            issues.append(doc.issue(ref.field, "must be a PSC network endpoint group"))
    if "/" in res.away_from and ResourcePath.parse(res.away_from).project != res.project:
        issues.append(doc.issue("awayFrom", f"must be in project {res.project}"))
    return issues


RULES: dict[type[Resource], tuple[Rule, ...]] = {
    HealthSource: (same_scope, internal_source),
    CompositeHealthCheck: (same_scope, distinct_sources),
    BackendService: (backend_groups,),
    HealthCheck: (check_secrets,),
    NetworkEndpointGroup: (psc_target_in_region,),
    ForwardingRule: (forwarding_rule,),
    ServiceAttachment: (attachment_target,),
    PracticeRun: (practice_targets,),
}

WORLD_RULES: tuple[WorldRule, ...] = (listen_addresses, dns_names, destinations)


def check_world(by_path: Mapping[ResourcePath, Document], offline: bool) -> list[Issue]:
    """Every rule: each document's references and its kind's rules, then the world's."""
    world = World(by_path, offline)
    issues: list[Issue] = []
    for doc in by_path.values():
        issues += references(doc, world)
        for rule in RULES.get(type(doc.resource), ()):
            issues += rule(doc, world)
    for world_rule in WORLD_RULES:
        issues += world_rule(world)
    return issues


def validate_documents(documents: Sequence[Document], offline: bool = False) -> list[Issue]:
    with gc_paused():  # (a large world: healthgate/gcpause.py)
        return _validate_documents(documents, offline)


def _validate_documents(documents: Sequence[Document], offline: bool) -> list[Issue]:
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
    return issues + check_world(by_path, offline)
