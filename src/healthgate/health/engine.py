"""The health engine: probe results and resource changes in, transitions out.

Theory of operation
-------------------
The engine holds two layers.

*Endpoints* are many (up to millions), so they live in parallel arrays indexed
by a small integer *slot*: state, success run, failure run, last result and
the time of the last change - about 40 bytes each, plus the slot's key. Each
slot belongs to one *aggregate*, the endpoint set of one regional backend
service under its one health check, which keeps running counts (total,
healthy, unknown). One probe result is therefore O(1): step the threshold
machine, and when the state flips, adjust two counters.

*Everything above* (health sources, composites, attachments, PSC NEGs,
consumer routes) is small and lives in node objects linked by reverse
indexes. A flip marks the sources of its aggregate dirty; dirty nodes are
re-evaluated level by level (sources, composites, attachments, NEGs, routes),
and a node whose output changed marks its dependents dirty. So a flip costs
O(1) plus the transitions it causes, never a rescan.

Resource changes go through :meth:`HealthEngine.apply`, given the complete
desired set. It diffs against the previous set: an aggregate is rebuilt only
when its backend service, health check or groups changed, and then only the
endpoints that came or went are touched (the others keep their state, which
is the fail-static choice: a changed check is confirmed by the next probes,
not by forgetting what was known).

The engine never reads a clock: every call takes ``now``. It never does I/O.
Records are returned to the caller, which logs, stores and streams them.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from healthgate.health.composite import combine
from healthgate.health.policy import PolicyParams, evaluate
from healthgate.health.routing import Candidate, choose, order
from healthgate.health.states import (
    HealthState,
    Outcome,
    ProbeResult,
    Record,
    RouteChange,
    Transition,
)
from healthgate.health.threshold import RUN_CAP, step
from healthgate.model.names import ResourcePath
from healthgate.model.resources import (
    BackendService,
    CompositeHealthCheck,
    ForwardingRule,
    HealthAggregationPolicy,
    HealthCheck,
    HealthSource,
    InstanceGroup,
    NetworkEndpointGroup,
    Resource,
    ServiceAttachment,
)

UNKNOWN = HealthState.UNKNOWN
HEALTHY = HealthState.HEALTHY
UNHEALTHY = HealthState.UNHEALTHY
_STATES = (UNKNOWN, HEALTHY, UNHEALTHY)
_OK = Outcome.OK  # per-probe outcomes as globals (see the note on Outcome)

EndpointKey = tuple[str, int | None]  # (ip, serving port)


@dataclass(frozen=True, slots=True)
class ProbeTarget:
    """What the scheduler needs to probe one endpoint."""

    slot: int
    backend_service: ResourcePath
    ip: str
    port: int | None  # serving port (None for GCE_VM_IP and port-less groups)
    check: HealthCheck


@dataclass(frozen=True, slots=True)
class EndpointStatus:
    ip: str
    port: int | None
    state: HealthState
    since: float
    last_result: ProbeResult | None
    last_time: float | None
    reason: str


@dataclass(frozen=True, slots=True)
class NodeStatus:
    path: str
    state: HealthState
    reason: str
    since: float


@dataclass(frozen=True, slots=True)
class Route:
    """Where one consumer front end sends new traffic right now."""

    frontend: str
    target: str | None  # PSC NEG path; None = refuse
    attachment: str | None  # the NEG's service attachment path
    mode: str
    reason: str
    since: float
    # attachments to try next, in failover order, for a request the target
    # could not serve (only NEGs that are accepted and not UNHEALTHY)
    fallbacks: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RouteTable:
    """An immutable snapshot; readers take it once per connection, no locks."""

    version: int
    routes: Mapping[str, Route]
    published: float = 0.0  # the engine time (``now``) it was published at


@dataclass(slots=True)
class ApplyResult:
    records: list[Record] = field(default_factory=list)
    added: list[ProbeTarget] = field(default_factory=list)  # new probe work
    removed: list[int] = field(default_factory=list)  # slots no longer probed
    removed_paths: list[str] = field(default_factory=list)  # their endpoint paths
    changed: list[ProbeTarget] = field(default_factory=list)  # same slot, new check


class _Aggregate:
    __slots__ = (
        "all_cache",
        "check",
        "healthy",
        "healthy_cache",
        "hthr",
        "path",
        "slots",
        "total",
        "unknown",
        "uthr",
    )

    def __init__(self, path: ResourcePath, check: HealthCheck) -> None:
        self.path = path
        self.check = check
        self.hthr = check.healthy_threshold
        self.uthr = check.unhealthy_threshold
        self.total = 0
        self.healthy = 0
        self.unknown = 0
        self.slots: dict[EndpointKey, int] = {}
        self.healthy_cache: tuple[EndpointKey, ...] | None = None
        self.all_cache: tuple[EndpointKey, ...] | None = None  # until slots change


class _Node:
    """A source, composite, attachment, PSC NEG or route: small, few."""

    __slots__ = ("delivered", "extra", "path", "reason", "resource", "since", "state")

    def __init__(self, resource: Resource, path: str | None = None) -> None:
        self.resource = resource
        self.path = path or str(resource.path)
        self.state = UNKNOWN
        self.delivered = UNKNOWN  # composites: what reaches the destination
        self.reason = "not evaluated yet"
        self.since = 0.0
        self.extra: object = None  # NEG: accepted flag; route: Route


def endpoint_name(ip: str, port: int | None) -> str:
    """``ip:port``, ``[v6]:port`` or the bare address; see :func:`parse_endpoint_name`."""
    if port is None:
        return ip
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def parse_endpoint_name(name: str) -> EndpointKey:
    if name.startswith("["):
        ip, _, port = name[1:].partition("]:")
        return ip, int(port)
    if name.count(":") == 1:
        ip, _, port = name.partition(":")
        return ip, int(port)
    return name, None


def _reason_for_endpoint(state: HealthState, runs: int, threshold: int, last: str) -> str:
    if state is HEALTHY:
        return f"{runs} consecutive successful probes (healthyThreshold {threshold}); last: {last}"
    return f"{runs} consecutive failed probes (unhealthyThreshold {threshold}); last: {last}"


class HealthEngine:
    def __init__(self) -> None:
        # endpoint arrays, indexed by slot
        self._state = bytearray()
        self._ok = bytearray()
        self._fail = bytearray()
        self._agg = array("i")
        self._last_outcome = bytearray()
        self._last_status = array("H")
        self._last_latency = array("f")
        self._last_time = array("d")
        self._since = array("d")
        self._key: list[EndpointKey | None] = []
        self._free: list[int] = []
        self._last_detail: dict[int, str] = {}
        self._aggs: list[_Aggregate | None] = []
        self._agg_ids: dict[ResourcePath, int] = {}
        self._free_aggs: list[int] = []
        self._ports: dict[int, int] = {}  # interned port numbers

        # everything above the endpoints
        self._resources: dict[ResourcePath, Resource] = {}
        self._policies: dict[str, PolicyParams] = {}
        self._sources: dict[str, _Node] = {}
        self._composites: dict[str, _Node] = {}
        self._attachments: dict[str, _Node] = {}
        self._negs: dict[str, _Node] = {}
        self._routes: dict[str, _Node] = {}
        # reverse indexes (dependents)
        self._sources_by_bs: dict[ResourcePath, list[_Node]] = {}
        self._sources_by_policy: dict[str, list[_Node]] = {}
        self._composites_by_source: dict[str, list[_Node]] = {}
        self._composite_by_destination: dict[str, _Node] = {}
        self._attachments_by_fr: dict[str, list[_Node]] = {}
        self._negs_by_attachment: dict[str, list[_Node]] = {}
        self._routes_by_neg: dict[str, list[_Node]] = {}

        self._route_version = 0
        self._route_table = RouteTable(0, MappingProxyType({}))
        # Moves on whenever a route or any backend service's set of HEALTHY
        # (or of all) endpoints may have changed: readers that derive
        # something from those (the data plane's per-request choice) rebuild
        # it when this differs from what they saw, and read nothing else.
        self.generation = 0
        self._now = 0.0

    # ------------------------------------------------------------------ hot path

    def on_result(self, now: float, slot: int, result: ProbeResult) -> list[Record]:
        """Feed one probe result; returns the transitions it caused (often none)."""
        agg = self._aggs[self._agg[slot]]
        assert agg is not None
        old = self._state[slot]
        outcome = result.outcome
        new, ok, fail = step(
            _STATES[old], self._ok[slot], self._fail[slot], outcome, agg.hthr, agg.uthr
        )
        self._ok[slot] = ok
        self._fail[slot] = fail
        self._last_outcome[slot] = outcome
        self._last_status[slot] = result.status
        self._last_latency[slot] = result.latency
        self._last_time[slot] = now
        if result.detail:
            self._last_detail[slot] = result.detail
        elif self._last_detail:
            self._last_detail.pop(slot, None)
        if new == old:
            return []
        self._state[slot] = new
        self._since[slot] = now
        agg.healthy += (new == HEALTHY) - (old == HEALTHY)
        agg.unknown += (new == UNKNOWN) - (old == UNKNOWN)
        self._endpoints_changed(agg)
        key = self._key[slot]
        assert key is not None
        if new == HEALTHY:
            reason = _reason_for_endpoint(new, ok, agg.hthr, result.describe())
        else:
            reason = _reason_for_endpoint(new, fail, agg.uthr, result.describe())
        records: list[Record] = [
            self._endpoint_transition(now, agg, key, _STATES[old], new, reason)
        ]
        sources = self._sources_by_bs.get(agg.path)
        if sources:
            self._propagate(now, records, sources=sources)
        return records

    def on_results(self, now: float, results: Iterable[tuple[int, ProbeResult]]) -> list[Record]:
        """Feed the results of probes that ended together (a tick's worth);
        returns the transitions they caused. The same as :meth:`on_result`
        for each in turn; the steady state - a success for an endpoint
        already HEALTHY - is taken here without the threshold machine's call:
        what :func:`step` does then is grow the success run (capped), zero the
        failure run and keep the state."""
        records: list[Record] = []
        states, ok_runs, fail_runs = self._state, self._ok, self._fail
        details = self._last_detail
        last_outcome, last_status = self._last_outcome, self._last_status
        last_latency, last_time = self._last_latency, self._last_time
        for slot, result in results:
            if result.outcome is not _OK or states[slot] != HEALTHY:
                records += self.on_result(now, slot, result)
                continue
            run = ok_runs[slot]
            if run < RUN_CAP:
                ok_runs[slot] = run + 1
            fail_runs[slot] = 0
            last_outcome[slot] = _OK
            last_status[slot] = result.status
            last_latency[slot] = result.latency
            last_time[slot] = now
            if result.detail:
                details[slot] = result.detail
            elif details:
                details.pop(slot, None)
        return records

    def _endpoint_transition(
        self,
        now: float,
        agg: _Aggregate,
        key: EndpointKey,
        old: HealthState,
        new: HealthState,
        reason: str,
    ) -> Transition:
        p = agg.path
        name = endpoint_name(*key)
        return Transition(
            now, p.project, p.region, "Endpoint", name, f"{p}/endpoints/{name}", old, new, reason
        )

    # ------------------------------------------------------------------ propagation

    def _propagate(
        self,
        now: float,
        records: list[Record],
        sources: Iterable[_Node] = (),
        composites: Iterable[_Node] = (),
        attachments: Iterable[_Node] = (),
        negs: Iterable[_Node] = (),
        routes: Iterable[_Node] = (),
    ) -> None:
        self._now = now
        dirty_c: dict[str, _Node] = {n.path: n for n in composites}
        for node in sources:
            if self._eval_source(now, node, records):
                for c in self._composites_by_source.get(node.path, ()):
                    dirty_c[c.path] = c
        dirty_a: dict[str, _Node] = {n.path: n for n in attachments}
        for node in dirty_c.values():
            if self._eval_composite(now, node, records):
                dest = node.resource.ref("health_destination")
                for a in self._attachments_by_fr.get(str(dest), ()):
                    dirty_a[a.path] = a
        dirty_n: dict[str, _Node] = {n.path: n for n in negs}
        for node in dirty_a.values():
            if self._eval_attachment(node):
                for n in self._negs_by_attachment.get(node.path, ()):
                    dirty_n[n.path] = n
        dirty_r: dict[str, _Node] = {n.path: n for n in routes}
        for node in dirty_n.values():
            if self._eval_neg(now, node, records):
                for r in self._routes_by_neg.get(node.path, ()):
                    dirty_r[r.path] = r
        changed = False
        for node in dirty_r.values():
            changed |= self._eval_route(now, node, records)
        if changed:
            self._publish_routes()

    def _set(
        self,
        now: float,
        node: _Node,
        kind: str,
        state: HealthState,
        reason: str,
        records: list[Record],
    ) -> bool:
        old = node.state
        node.reason = reason
        if state is old:
            return False
        node.state = state
        node.since = now
        r = node.resource
        records.append(
            Transition(now, r.project, r.region, kind, r.name, node.path, old, state, reason)
        )
        return True

    def _eval_source(self, now: float, node: _Node, records: list[Record]) -> bool:
        res = node.resource
        assert isinstance(res, HealthSource)
        bs = res.ref("sources")
        agg_id = self._agg_ids.get(bs) if bs else None
        policy = self._policies.get(str(res.ref("health_aggregation_policy")))
        if agg_id is None or policy is None:
            return self._set(
                now, node, "HealthSource", UNKNOWN, "backend service or policy missing", records
            )
        agg = self._aggs[agg_id]
        assert agg is not None
        state, reason = evaluate(policy, agg.total, agg.healthy, agg.unknown)
        return self._set(now, node, "HealthSource", state, reason, records)

    def _eval_composite(self, now: float, node: _Node, records: list[Record]) -> bool:
        res = node.resource
        assert isinstance(res, CompositeHealthCheck)
        parts = []
        for p in res.refs("health_sources"):
            src = self._sources.get(str(p))
            if src is None:
                parts.append((p.name, UNKNOWN, "missing"))
            else:
                parts.append((p.name, src.state, src.reason))
        state, reason = combine(parts)
        self._set(now, node, "CompositeHealthCheck", state, reason, records)
        delivered = UNKNOWN if res.mode == "DRY_RUN" else state
        if delivered is node.delivered:
            return False
        node.delivered = delivered
        return True

    def _eval_attachment(self, node: _Node) -> bool:
        res = node.resource
        assert isinstance(res, ServiceAttachment)
        comp = self._composite_by_destination.get(str(res.ref("target_service")))
        if comp is None:
            state, reason = (
                UNKNOWN,
                "no composite health check has this attachment's forwarding rule as destination",
            )
        elif comp.resource.mode == "DRY_RUN":  # type: ignore[attr-defined]
            state = UNKNOWN
            reason = f"composite {comp.resource.name} is in DRY_RUN mode (evaluated {comp.state.name}); delivers UNKNOWN"
        else:
            state, reason = (
                comp.delivered,
                f"composite health of the published service is {comp.delivered.name}",
            )
        changed = state is not node.state
        node.state, node.reason = state, reason
        return changed

    def _eval_neg(self, now: float, node: _Node, records: list[Record]) -> bool:
        res = node.resource
        assert isinstance(res, NetworkEndpointGroup)
        att_path = str(res.ref("psc_target_service"))
        att = self._attachments.get(att_path)
        accepted = True
        if att is None:
            state, reason = UNKNOWN, f"service attachment {att_path} not found"
        else:
            sa = att.resource
            assert isinstance(sa, ServiceAttachment)
            accepted = sa.accepts(res.project)
            if not accepted:
                state = UNKNOWN
                reason = f"connection refused: project {res.project} is not on the consumerAcceptLists of {att_path}"
            else:
                state, reason = att.state, f"{att_path}: {att.reason}"
        accepted_changed = node.extra is not accepted
        node.extra = accepted
        return (
            self._set(now, node, "NetworkEndpointGroup", state, reason, records) or accepted_changed
        )

    def _eval_route(self, now: float, node: _Node, records: list[Record]) -> bool:
        fr = node.resource
        assert isinstance(fr, ForwardingRule)
        bs_path = fr.ref("backend_service")
        bs = self._resources.get(bs_path) if bs_path else None
        candidates = []
        prio: dict[str, int | None] = {}
        if isinstance(bs, BackendService):
            for b, neg_path in zip(bs.backends, bs.refs("backends"), strict=False):
                neg = self._negs.get(str(neg_path))
                if neg is None:
                    continue
                prio[neg.path] = b.failover_priority
                candidates.append(
                    Candidate(
                        neg.path,
                        neg_path.name,
                        neg_path.region,
                        b.failover_priority,
                        neg.state,
                        neg.extra is not False,
                    )
                )
        policy = bs.policy if isinstance(bs, BackendService) else None
        prev: Route | None = node.extra  # type: ignore[assignment]
        choice = choose(
            candidates,
            fr.data_plane_region,
            prev.target if prev else None,
            policy.failback if policy else True,
            (policy.when_all_unhealthy == "FAIL_OPEN") if policy else True,
        )
        fallbacks = tuple(
            self._attachment_of(c.path)
            for c in order(candidates, fr.data_plane_region)
            if c.accepted and c.state is not UNHEALTHY and c.path != choice.target
        )
        if prev is not None and prev.target == choice.target and prev.mode == choice.mode:
            if prev.reason != choice.reason or prev.fallbacks != fallbacks:
                node.extra = Route(
                    prev.frontend,
                    prev.target,
                    prev.attachment,
                    prev.mode,
                    choice.reason,
                    prev.since,
                    fallbacks,
                )
                return True  # republish: readers see the current reason and retry targets
            return False
        attachment = self._attachment_of(choice.target) if choice.target else None
        node.extra = Route(
            node.path, choice.target, attachment, choice.mode, choice.reason, now, fallbacks
        )
        records.append(
            RouteChange(
                now,
                fr.project,
                node.path,
                prev.target if prev else None,
                choice.target,
                choice.mode,
                choice.reason,
            )
        )
        return True

    def _attachment_of(self, neg_path: str) -> str:
        return str(self._negs[neg_path].resource.ref("psc_target_service"))

    def _publish_routes(self) -> None:
        self._route_version += 1
        self.generation += 1
        routes = {p: n.extra for p, n in self._routes.items() if isinstance(n.extra, Route)}
        self._route_table = RouteTable(self._route_version, MappingProxyType(routes), self._now)

    # ------------------------------------------------------------------ resources

    def apply(self, resources: Iterable[Resource], now: float) -> ApplyResult:
        """Make the engine's world the given complete set of (valid) resources."""
        self._now = now
        new = {r.path: r for r in resources}
        old = self._resources
        changed = {p for p, r in new.items() if old.get(p) != r}
        changed |= {p for p in old if p not in new}
        self._resources = new
        result = ApplyResult()
        dirty_sources: dict[str, _Node] = {}

        # 1. endpoint sets of regional backend services
        rebuilt: list[ResourcePath] = []
        for path, res in new.items():
            if isinstance(res, BackendService) and not res.is_global:
                inputs = [path, *res.refs("health_checks"), *res.refs("backends")]
                if any(p in changed for p in inputs):
                    self._rebuild_aggregate(now, res, result)
                    rebuilt.append(path)
        for path in [p for p in self._agg_ids if p not in new]:
            self._drop_aggregate(path, result)
            rebuilt.append(path)

        # 2. the small upper layers: replace changed nodes, keeping their state
        self._policies = {
            str(p): PolicyParams(r.healthy_percent_threshold, r.min_healthy_threshold)
            for p, r in new.items()
            if isinstance(r, HealthAggregationPolicy)
        }
        touched_sources = self._sync_nodes(
            self._sources, new, changed, lambda r: isinstance(r, HealthSource)
        )
        touched_composites = self._sync_nodes(
            self._composites, new, changed, lambda r: isinstance(r, CompositeHealthCheck)
        )
        touched_attachments = self._sync_nodes(
            self._attachments, new, changed, lambda r: isinstance(r, ServiceAttachment)
        )
        touched_negs = self._sync_nodes(
            self._negs,
            new,
            changed,
            lambda r: (
                isinstance(r, NetworkEndpointGroup)
                and r.network_endpoint_type == "PRIVATE_SERVICE_CONNECT"
            ),
        )
        routes_before = set(self._routes)
        route_nodes_touched = self._sync_nodes(
            self._routes, new, changed, lambda r: isinstance(r, ForwardingRule) and r.is_global
        )
        routes_removed = bool(routes_before - set(self._routes))
        self._reindex()

        for n in touched_sources:
            dirty_sources[n.path] = n
        for p in changed:
            if p.collection == "healthAggregationPolicies":
                for n in self._sources_by_policy.get(str(p), ()):
                    dirty_sources[n.path] = n
        for p in rebuilt:
            for n in self._sources_by_bs.get(p, ()):
                dirty_sources[n.path] = n
        dirty_routes = {n.path: n for n in route_nodes_touched}
        for fr_path, node in self._routes.items():
            bs_path = node.resource.ref("backend_service")
            if bs_path in changed:
                dirty_routes[fr_path] = node
        # attachments whose target's composite changed are reached through the
        # composites; a newly created attachment or NEG is evaluated directly.
        self._propagate(
            now,
            result.records,
            sources=list(dirty_sources.values()),
            composites=touched_composites,
            attachments=touched_attachments,
            negs=touched_negs,
            routes=list(dirty_routes.values()),
        )
        if routes_removed:
            self._publish_routes()  # a front end is gone: no snapshot may still carry it
        self.generation += 1  # (whatever changed, readers re-derive)
        return result

    def _sync_nodes(
        self,
        nodes: dict[str, _Node],
        new: Mapping[ResourcePath, Resource],
        changed: set[ResourcePath],
        want: Callable[[Resource], bool],
    ) -> list[_Node]:
        touched = []
        for key in list(nodes):
            if ResourcePath.parse(key) not in new:
                del nodes[key]
        for p in changed:
            r = new.get(p)
            if r is None or not want(r):
                continue
            node = nodes.get(str(p))
            if node is None:
                node = nodes[str(p)] = _Node(r)
            else:
                node.resource = r
            touched.append(node)
        touched.sort(key=lambda n: n.path)
        return touched

    def _reindex(self) -> None:
        self._sources_by_bs = {}
        self._sources_by_policy = {}
        for n in self._sources.values():
            bs = n.resource.ref("sources")
            if bs:
                self._sources_by_bs.setdefault(bs, []).append(n)
            self._sources_by_policy.setdefault(
                str(n.resource.ref("health_aggregation_policy")), []
            ).append(n)
        self._composites_by_source = {}
        self._composite_by_destination = {}
        for n in self._composites.values():
            for s in n.resource.refs("health_sources"):
                self._composites_by_source.setdefault(str(s), []).append(n)
            self._composite_by_destination[str(n.resource.ref("health_destination"))] = n
        self._attachments_by_fr = {}
        for n in self._attachments.values():
            self._attachments_by_fr.setdefault(str(n.resource.ref("target_service")), []).append(n)
        self._negs_by_attachment = {}
        for n in self._negs.values():
            self._negs_by_attachment.setdefault(
                str(n.resource.ref("psc_target_service")), []
            ).append(n)
        self._routes_by_neg = {}
        for n in self._routes.values():
            gbs_path = n.resource.ref("backend_service")
            gbs = self._resources.get(gbs_path) if gbs_path else None
            if isinstance(gbs, BackendService):
                for neg in gbs.refs("backends"):
                    self._routes_by_neg.setdefault(str(neg), []).append(n)

    def _endpoints_of(self, bs: BackendService) -> dict[EndpointKey, None]:
        keys: dict[EndpointKey, None] = {}
        for group_path in bs.refs("backends"):
            group = self._resources.get(group_path)
            if isinstance(group, NetworkEndpointGroup):
                for ep in group.endpoints:
                    port = self._ports.setdefault(ep.port, ep.port) if ep.port else None
                    keys[(ep.ip_address, port)] = None
            elif isinstance(group, InstanceGroup):
                for inst in group.instances:
                    keys[(inst.ip_address, group.serving_port)] = None
        return keys

    def _rebuild_aggregate(self, now: float, bs: BackendService, result: ApplyResult) -> None:
        check = self._resources.get(bs.refs("health_checks")[0])
        assert isinstance(check, HealthCheck), "validated: the health check exists"
        path = bs.path
        agg_id = self._agg_ids.get(path)
        if agg_id is None:
            agg_id = self._free_aggs.pop() if self._free_aggs else len(self._aggs)
            agg = _Aggregate(path, check)
            if agg_id == len(self._aggs):
                self._aggs.append(agg)
            else:
                self._aggs[agg_id] = agg
            self._agg_ids[path] = agg_id
            old_check: HealthCheck | None = None
        else:
            agg_or_none = self._aggs[agg_id]
            assert agg_or_none is not None
            agg = agg_or_none
            old_check = agg.check
            agg.check, agg.hthr, agg.uthr = (
                check,
                check.healthy_threshold,
                check.unhealthy_threshold,
            )

        desired = self._endpoints_of(bs)
        for key in [k for k in agg.slots if k not in desired]:
            slot = agg.slots.pop(key)
            self._free_slot(agg, slot)
            result.removed.append(slot)
            result.removed_paths.append(f"{path}/endpoints/{endpoint_name(*key)}")
        enabled = check.enabled
        toggled = old_check is not None and old_check.enabled != enabled
        if toggled:
            # every kept endpoint changes meaning: disabled = HEALTHY "not checked",
            # re-enabled = UNKNOWN until probes say otherwise
            target = HEALTHY if not enabled else UNKNOWN
            reason = (
                "not checked (health check disabled)"
                if not enabled
                else "health check enabled: waiting for probes"
            )
            for key, slot in agg.slots.items():
                before = self._force_state(now, agg, slot, target)
                if before is not target:
                    result.records.append(
                        self._endpoint_transition(now, agg, key, before, target, reason)
                    )
                if enabled:
                    result.added.append(ProbeTarget(slot, path, key[0], key[1], check))
                else:
                    result.removed.append(slot)
        elif old_check is not None and old_check != check and enabled:
            for key, slot in agg.slots.items():
                result.changed.append(ProbeTarget(slot, path, key[0], key[1], check))
        for key in desired:
            if key in agg.slots:
                continue
            slot = self._alloc_slot(agg_id, key, HEALTHY if not enabled else UNKNOWN, now)
            agg.slots[key] = slot
            self._endpoints_changed(agg, membership=True)
            agg.total += 1
            if enabled:
                agg.unknown += 1
                result.added.append(ProbeTarget(slot, path, key[0], key[1], check))
            else:
                agg.healthy += 1

    def _force_state(self, now: float, agg: _Aggregate, slot: int, new: HealthState) -> HealthState:
        """Set an endpoint's state outside the threshold machine; returns the old one."""
        old = self._state[slot]
        if old == new:
            return _STATES[old]
        self._state[slot] = new
        self._since[slot] = now
        self._ok[slot] = 0
        self._fail[slot] = 0
        agg.healthy += (new == HEALTHY) - (old == HEALTHY)
        agg.unknown += (new == UNKNOWN) - (old == UNKNOWN)
        self._endpoints_changed(agg)
        return _STATES[old]

    def _drop_aggregate(self, path: ResourcePath, result: ApplyResult) -> None:
        agg_id = self._agg_ids.pop(path)
        agg = self._aggs[agg_id]
        assert agg is not None
        for key, slot in agg.slots.items():
            self._free_slot(agg, slot)
            result.removed.append(slot)
            result.removed_paths.append(f"{path}/endpoints/{endpoint_name(*key)}")
        self._aggs[agg_id] = None
        self._free_aggs.append(agg_id)

    def _alloc_slot(self, agg_id: int, key: EndpointKey, state: HealthState, now: float) -> int:
        if self._free:
            slot = self._free.pop()
            self._state[slot] = state
            self._ok[slot] = self._fail[slot] = 0
            self._agg[slot] = agg_id
            self._last_outcome[slot] = 0
            self._last_status[slot] = 0
            self._last_latency[slot] = 0.0
            self._last_time[slot] = -1.0
            self._since[slot] = now
            self._key[slot] = key
            return slot
        slot = len(self._key)
        self._state.append(state)
        self._ok.append(0)
        self._fail.append(0)
        self._agg.append(agg_id)
        self._last_outcome.append(0)
        self._last_status.append(0)
        self._last_latency.append(0.0)
        self._last_time.append(-1.0)
        self._since.append(now)
        self._key.append(key)
        return slot

    def _free_slot(self, agg: _Aggregate, slot: int) -> None:
        self._endpoints_changed(agg, membership=True)
        state = self._state[slot]
        agg.total -= 1
        agg.healthy -= state == HEALTHY
        agg.unknown -= state == UNKNOWN
        self._key[slot] = None
        self._last_detail.pop(slot, None)
        self._free.append(slot)

    # ------------------------------------------------------------------ restarts

    def restore(
        self,
        now: float,
        endpoints: Mapping[str, tuple[HealthState, float]],
        nodes: Mapping[str, tuple[HealthState, str, float]],
        routes: Mapping[str, Route],
    ) -> list[Record]:
        """Resume from persisted states (fail static across restarts).

        ``endpoints`` maps endpoint paths, ``nodes`` source / composite / NEG
        paths, ``routes`` front-end paths to what was last known. Entries for
        things that no longer exist are ignored. Everything is then
        re-evaluated once: only real differences produce records.
        """
        for path, (state, since) in endpoints.items():
            bs_text, _, name = path.rpartition("/endpoints/")
            try:
                ip, port = parse_endpoint_name(name)
                slot = self.slot_of(ResourcePath.parse(bs_text), ip, port)
            except ValueError:
                continue
            if slot is None:
                continue
            agg = self._aggs[self._agg[slot]]
            assert agg is not None
            if agg.check.enabled:
                self._force_state(since, agg, slot, state)
                self._since[slot] = since
        for table in (self._sources, self._composites, self._negs):
            for path, node in table.items():
                if path in nodes:
                    node.state, node.reason, node.since = nodes[path]
                    if table is self._composites:
                        mode = getattr(node.resource, "mode", "ENFORCE")
                        node.delivered = UNKNOWN if mode == "DRY_RUN" else node.state
        for fr_path, route in routes.items():
            route_node = self._routes.get(fr_path)
            if route_node is None:
                continue
            if route.target is None:
                route_node.extra = route
            elif route.target in self._negs:
                att = str(self._negs[route.target].resource.ref("psc_target_service"))
                route_node.extra = Route(
                    fr_path, route.target, att, route.mode, route.reason, route.since
                )
        for att_node in self._attachments.values():
            self._eval_attachment(att_node)
        records: list[Record] = []
        self._propagate(
            now,
            records,
            sources=list(self._sources.values()),
            composites=list(self._composites.values()),
            attachments=list(self._attachments.values()),
            negs=list(self._negs.values()),
            routes=list(self._routes.values()),
        )
        self._publish_routes()
        return records

    # ------------------------------------------------------------------ queries

    @property
    def resources(self) -> Mapping[ResourcePath, Resource]:
        return MappingProxyType(self._resources)

    def route_table(self) -> RouteTable:
        return self._route_table

    def targets(self) -> Iterator[ProbeTarget]:
        """Every endpoint that needs probing (disabled checks are not probed)."""
        for agg in self._aggs:
            if agg is None or not agg.check.enabled:
                continue
            for key, slot in agg.slots.items():
                yield ProbeTarget(slot, agg.path, key[0], key[1], agg.check)

    def endpoint_count(self) -> int:
        return len(self._key) - len(self._free)

    def slot_of(self, backend_service: ResourcePath, ip: str, port: int | None) -> int | None:
        agg_id = self._agg_ids.get(backend_service)
        agg = self._aggs[agg_id] if agg_id is not None else None
        return agg.slots.get((ip, port)) if agg else None

    def endpoint_path(self, slot: int) -> str:
        key = self._key[slot]
        agg = self._aggs[self._agg[slot]]
        if key is None or agg is None:
            return f"(free slot {slot})"
        return f"{agg.path}/endpoints/{endpoint_name(*key)}"

    def last_probe_ok(self, backend_service: ResourcePath) -> list[tuple[EndpointKey, bool]]:
        """(endpoint, did its last probe succeed) for every endpoint probed at
        least once: what /metrics exports, without building full statuses."""
        agg_id = self._agg_ids.get(backend_service)
        agg = self._aggs[agg_id] if agg_id is not None else None
        if agg is None:
            return []
        ok, outcomes, times = Outcome.OK.value, self._last_outcome, self._last_time
        return [(key, outcomes[slot] == ok) for key, slot in agg.slots.items() if times[slot] >= 0]

    def endpoints(self, backend_service: ResourcePath) -> list[EndpointStatus]:
        agg_id = self._agg_ids.get(backend_service)
        agg = self._aggs[agg_id] if agg_id is not None else None
        if agg is None:
            return []
        out = []
        for (ip, port), slot in agg.slots.items():
            state = _STATES[self._state[slot]]
            last: ProbeResult | None = None
            last_time = self._last_time[slot]
            if last_time >= 0:
                last = ProbeResult(
                    Outcome(self._last_outcome[slot]),
                    float(self._last_latency[slot]),
                    self._last_status[slot],
                    self._last_detail.get(slot, ""),
                )
            if not agg.check.enabled:
                reason = "not checked (health check disabled)"
            elif state is UNKNOWN:
                reason = f"{self._ok[slot]} of {agg.hthr} successes, {self._fail[slot]} of {agg.uthr} failures so far"
            elif state is HEALTHY:
                reason = _reason_for_endpoint(
                    state, self._ok[slot], agg.hthr, last.describe() if last else "-"
                )
            else:
                reason = _reason_for_endpoint(
                    state, self._fail[slot], agg.uthr, last.describe() if last else "-"
                )
            out.append(
                EndpointStatus(
                    ip,
                    port,
                    state,
                    self._since[slot],
                    last,
                    last_time if last_time >= 0 else None,
                    reason,
                )
            )
        return out

    def _endpoints_changed(self, agg: _Aggregate, membership: bool = False) -> None:
        """An aggregate's HEALTHY endpoints (with ``membership``, its set of
        endpoints too) changed: drop the cached tuples, and move the
        generation on for the readers that derive from them."""
        agg.healthy_cache = None
        if membership:
            agg.all_cache = None
        self.generation += 1

    def healthy_endpoints(self, backend_service: ResourcePath) -> tuple[EndpointKey, ...]:
        """The HEALTHY endpoints of a backend service, cached until one flips:
        the data plane reads this per connection."""
        agg_id = self._agg_ids.get(backend_service)
        agg = self._aggs[agg_id] if agg_id is not None else None
        if agg is None:
            return ()
        cached = agg.healthy_cache
        if cached is None:
            state = self._state
            cached = agg.healthy_cache = tuple(
                k for k, slot in agg.slots.items() if state[slot] == HEALTHY
            )
        return cached

    def all_endpoints(self, backend_service: ResourcePath) -> tuple[EndpointKey, ...]:
        """Every endpoint of a backend service, cached until one is added or
        removed (the data plane's fail-open choice reads it per connection)."""
        agg_id = self._agg_ids.get(backend_service)
        agg = self._aggs[agg_id] if agg_id is not None else None
        if agg is None:
            return ()
        cached = agg.all_cache
        if cached is None:
            cached = agg.all_cache = tuple(agg.slots)
        return cached

    def counts(self, backend_service: ResourcePath) -> tuple[int, int, int] | None:
        """(total, healthy, unknown) of one backend service."""
        agg_id = self._agg_ids.get(backend_service)
        agg = self._aggs[agg_id] if agg_id is not None else None
        return (agg.total, agg.healthy, agg.unknown) if agg else None

    def backend_services(self) -> list[ResourcePath]:
        return list(self._agg_ids)

    def node_states(self) -> Iterator[tuple[str, NodeStatus]]:
        """(kind, status) of every source, composite and PSC NEG."""
        for kind, table in (
            ("HealthSource", self._sources),
            ("CompositeHealthCheck", self._composites),
            ("NetworkEndpointGroup", self._negs),
        ):
            for node in table.values():
                yield kind, NodeStatus(node.path, node.state, node.reason, node.since)

    def node_status(self, path: ResourcePath | str) -> NodeStatus | None:
        key = str(path)
        for nodes in (self._sources, self._composites, self._negs, self._attachments):
            node = nodes.get(key)
            if node is not None:
                return NodeStatus(node.path, node.state, node.reason, node.since)
        route = self._routes.get(key)
        if route is not None and isinstance(route.extra, Route):
            r = route.extra
            return NodeStatus(key, UNKNOWN, r.reason, r.since)
        return None

    def destination_state(self, forwarding_rule: ResourcePath | str) -> NodeStatus | None:
        """The state delivered to a producer forwarding rule by its composite."""
        comp = self._composite_by_destination.get(str(forwarding_rule))
        if comp is None:
            return None
        return NodeStatus(str(forwarding_rule), comp.delivered, comp.reason, comp.since)
