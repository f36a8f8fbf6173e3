"""``healthgate export haproxy``: a backend section that follows healthgate.

For a consumer (global) forwarding rule: one server per region - the
address of the producer forwarding rule its PSC NEG reaches - in the rule's
failover order (``failoverPriority``, then locality to ``dataPlaneRegion``,
then name). The first is the active server, the others ``backup``: HAProxy
sends traffic to the active server while it is up, else to the first backup
that is up, and back to the active one as soon as it is up again. Every
server is driven by healthgate's agent (``serve --agent``), which answers for
that region's PSC NEG, so HAProxy moves traffic when healthgate decides to.

A route that splits its traffic when it is exported (``trafficDial``, SPEC
§6) has every region with a share active, each ``weight 100``, and the agent
answers ``up P%``: HAProxy weighs them by share. The exported roles are
fixed: export again when dials are added or removed (the weights an agent
set stay until it sets others).

**Outlier detection** (SPEC §8): a region whose producer backend service has
``outlierDetection`` (``consecutiveErrors`` above 0, or else
``consecutiveGatewayErrors``) gets HAProxy's nearest equivalent on its
server: ``observe layer7`` (``layer4`` in tcp mode) with ``error-limit``
that many errors in a row and ``on-error mark-down``, and a plain ``check``
every ``baseEjectionTimeSec`` with ``rise 1`` - HAProxy marks the server
down on its own real traffic, and takes it back at its next passing check.
What HAProxy has not: failure percentages, ``maxEjectionPercent``, an
ejection time that grows, ``enforcingPercent`` (docs/integrations.md).

**Session affinity** (SPEC §9) of the consumer backend service:
``CLIENT_IP`` is ``balance source`` and ``HEADER_FIELD`` ``balance
hdr(NAME)``, both with ``hash-type consistent`` (weights - the agent's
``up P%`` - shape the hash); ``GENERATED_COOKIE`` is HAProxy's own inserted
cookie ``HG_AFFINITY`` naming the region's server (``maxlife`` from
``affinityCookieTtlSec``), with ``option redispatch`` so a client whose
region is down moves. HAProxy's cookie persists to any server that is up
- a backup included - so a client that failed over stays there after
failback, as ``stickyFailback`` does.
"""

from __future__ import annotations

from collections.abc import Mapping

from healthgate.health.engine import HealthEngine
from healthgate.model.lookups import published_address, published_rule
from healthgate.model.names import ResourcePath
from healthgate.model.resources import BackendService, ForwardingRule, Resource


class ExportError(ValueError):
    """The rule cannot be exported (the message says why)."""


def haproxy_backend(
    engine: HealthEngine,
    resources: Mapping[ResourcePath, Resource],
    frontend: ResourcePath,
    agent: tuple[str, int],
    agent_inter: str = "1s",
    instance: str | None = None,
) -> str:
    fr = resources.get(frontend)
    if not isinstance(fr, ForwardingRule) or not fr.is_global:
        raise ExportError(f"{frontend} is not a global (consumer) forwarding rule")
    bs_path = fr.ref("backend_service")
    bs = resources.get(bs_path) if bs_path is not None else None
    mode = "http" if isinstance(bs, BackendService) and bs.protocol in ("HTTP", "HTTPS") else "tcp"
    agent_host, agent_port = agent
    lines = [
        f"# healthgate export haproxy {frontend}",
        "# One server per region in failover order: the first is active, the others",
        "# backups (HAProxy uses the first backup that is up). healthgate's agent at",
        f"# {agent_host}:{agent_port} answers up / down / maint for each region's PSC NEG.",
        f"backend {frontend.name}",
        f"    mode {mode}",
    ]
    affinity = bs.session_affinity if isinstance(bs, BackendService) else "NONE"
    if affinity == "CLIENT_IP":
        lines += ["    balance source", "    hash-type consistent"]
    elif affinity == "HEADER_FIELD" and isinstance(bs, BackendService):
        lines += [f"    balance hdr({bs.affinity_header})", "    hash-type consistent"]
    elif affinity == "GENERATED_COOKIE" and isinstance(bs, BackendService):
        life = f" maxlife {bs.affinity_cookie_ttl_sec}s" if bs.affinity_cookie_ttl_sec else ""
        lines += [
            f"    cookie HG_AFFINITY insert indirect nocache httponly{life}",
            "    option redispatch",
        ]
    servers = 0
    # (SPEC §11: the agent names this HAProxy's receipts by it, else by its address)
    tag = f" {instance}" if instance else ""
    route = engine.route_table().routes.get(str(frontend))
    shares = {s.neg for s in route.shares} if route is not None and route.split else set()
    for candidate, attachment in engine.failover_order(str(frontend)):
        address = published_address(resources, attachment)
        if address is None:
            lines.append(f"    # {candidate.name}: attachment {attachment} has no forwarding rule")
            continue
        ip, port = address
        host = f"[{ip}]" if ":" in ip else ip
        neg = ResourcePath.parse(candidate.path)
        # (a split route: every region with a share is active, weighted by
        # the agent's "up P%" of this weight; the others are backups)
        backup = " backup" if (candidate.path not in shares if shares else servers) else ""
        lines.append(
            f"    server {candidate.name} {host}:{port}{backup} weight 100 agent-check "
            f"agent-addr {agent_host} agent-port {agent_port} agent-inter {agent_inter} "
            f'agent-send "{neg.project}/{neg.region}/{neg.name}{tag}\\n"'
            + (f" cookie {candidate.name}" if affinity == "GENERATED_COOKIE" else "")
            + _observe(resources, attachment, mode)
        )
        servers += 1
    if not servers:
        raise ExportError(f"{frontend} has no region to send traffic to")
    return "\n".join(lines) + "\n"


def _observe(resources: Mapping[ResourcePath, Resource], attachment: str, mode: str) -> str:
    """HAProxy's equivalent of the region's producer outlierDetection (see
    the module doc), or nothing."""
    found = published_rule(resources, attachment)
    bs_path = found[1].ref("backend_service") if found is not None else None
    bs = resources.get(bs_path) if bs_path is not None else None
    od = bs.outlier_detection if isinstance(bs, BackendService) else None
    if od is None:
        return ""
    limit = od.consecutive_errors or od.consecutive_gateway_errors
    if not limit or not od.enforcing_percent:
        return ""
    layer = "layer7" if mode == "http" else "layer4"
    return (
        f" check inter {od.base_ejection_time_sec}s rise 1 observe {layer} "
        f"error-limit {limit} on-error mark-down"
    )
