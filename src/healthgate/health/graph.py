"""The graph above the endpoints: sources -> composites -> attachments ->
PSC NEGs -> consumer routes, and how a change propagates through it.

Everything here is small (a node per resource) and linked by reverse
indexes. A flip of an endpoint marks the sources of its backend service
dirty; dirty nodes are re-evaluated level by level (sources, composites,
attachments, NEGs, routes), and a node whose output changed marks its
dependents dirty. So a flip costs O(1) plus the transitions it causes,
never a rescan. Each level's rule is a module of its own (policy.py,
composite.py, routing.py); this module only wires them.

Routes are published as an immutable :class:`RouteTable` after each batch
that changed one.
"""

from __future__ import annotations

from bisect import insort
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from healthgate.health.composite import combine
from healthgate.health.policy import PolicyParams, evaluate
from healthgate.health.ramps import Ramps
from healthgate.health.routing import (
    Candidate,
    Share,
    choose,
    distribute,
    moved,
    order,
    split_text,
)
from healthgate.health.shifts import ShiftEffect, active_effects, ended
from healthgate.health.states import (
    ERROR_WINDOW,
    HealthState,
    Record,
    RecordKind,
    RouteChange,
    Transition,
)
from healthgate.health.traffic import FIRST_REASON as TRAFFIC_FIRST
from healthgate.health.types import Counts, NodeStatus, Route, RouteTable
from healthgate.model.names import ResourcePath
from healthgate.model.resources import (
    BackendService,
    CompositeHealthCheck,
    FailoverPolicy,
    ForwardingRule,
    HealthAggregationPolicy,
    HealthCheck,
    HealthSource,
    NetworkEndpointGroup,
    Resource,
    ServiceAttachment,
    Shift,
)

UNKNOWN = HealthState.UNKNOWN
HEALTHY = HealthState.HEALTHY
UNHEALTHY = HealthState.UNHEALTHY

NEG_HISTORY = 3600.0  # s of NEG changes kept, for a storm hold to roll back over

CountsOf = Callable[[ResourcePath], "Counts | None"]  # a backend service's (the endpoint table)
Index = dict[Any, list["_Node"]]  # a reverse index: a path (or its text) -> the nodes that use it

# a METRIC source before its query first answers (controlplane/metric_sources.py)
METRIC_FIRST = (HealthState.UNKNOWN, "waiting for the metric's first evaluation")


class _Node:
    """A source, composite, attachment, PSC NEG or route: small, few."""

    __slots__ = (
        "accepted",
        "delivered",
        "fraction",
        "indexed",
        "path",
        "reason",
        "resource",
        "route",
        "since",
        "state",
    )

    def __init__(self, resource: Resource, path: str | None = None) -> None:
        self.resource = resource
        self.path = path or str(resource.path)
        self.state = UNKNOWN
        self.delivered = UNKNOWN  # composites: what reaches the destination
        self.reason = "not evaluated yet"
        self.since = 0.0
        self.accepted: bool | None = None  # a PSC NEG's: its attachment accepted it
        self.route: Route | None = None  # a front end's: where its traffic goes
        # healthy / all endpoints: a source's own, a composite's lowest over
        # its sources (SPEC §6 "healthyFraction"), passed on to attachments
        # and PSC NEGs; None while not known
        self.fraction: float | None = None
        # the reverse indexes it is listed in (HealthGraph._index)
        self.indexed: list[tuple[Index, Any]] = []


class HealthGraph:
    def __init__(self, counts: CountsOf) -> None:
        self._counts = counts  # a backend service's endpoint counts (the endpoint table)
        self._resources: Mapping[ResourcePath, Resource] = {}
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
        self._routes_by_bs: dict[ResourcePath, list[_Node]] = {}
        # kept by the change as it comes: PROPORTIONAL backend services, and
        # every Shift resource by path (``_shifts`` is them, in path order)
        self._proportional_bs: set[ResourcePath] = set()
        self._shift_map: dict[str, Shift] = {}

        self._shifts: list[Shift] = []  # every Shift resource, active or not
        self._shifted: dict[str, ShiftEffect] = {}  # PSC NEG path -> the shift keeping it out
        self._active: set[str] = set()  # the shifts in effect (their end not yet recorded)

        self._route_version = 0
        self._decisions = 0  # route decisions (recorded changes) made: their generations
        self._route_table = RouteTable(0, MappingProxyType({}))
        self.generation = 0  # moves on with every route table published
        self._now = 0.0
        # does any consumer spill PROPORTIONAL: only then does a healthy
        # fraction that moves without a state change travel up the graph
        self._proportional = False
        self._ramps = Ramps()  # ramped failbacks in progress (health/ramps.py)
        # TRAFFIC health sources (SPEC §8): their state as judged outside the
        # graph (health/traffic.py: this node's judge, or the nodes' quorum)
        self._traffic: dict[str, tuple[HealthState, str]] = {}
        # a failover storm held (health/storms.py): the NEG states and
        # fractions the routes are computed from while it lasts (None: now's)
        self._held: dict[str, tuple[HealthState, float | None]] | None = None
        self._held_why = ""
        # recent NEG changes (time, path, state and fraction before): what
        # a hold rolls the routes back over
        self._neg_history: deque[tuple[float, str, HealthState, float | None]] = deque()

    def endpoints_flipped(
        self, now: float, backend_service: ResourcePath, records: list[Record]
    ) -> None:
        """An endpoint of ``backend_service`` changed state: propagate."""
        sources = self._sources_by_bs.get(backend_service)
        if sources:
            self._propagate(now, records, sources=sources)

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
        kind: RecordKind,
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
        if res.source_type != "BACKEND_SERVICE":  # judged outside: real traffic, a metric
            if bs is None or self._counts(bs) is None:
                return self._set(
                    now, node, RecordKind.HEALTH_SOURCE, UNKNOWN, "backend service missing", records
                )
            first = (HEALTHY, TRAFFIC_FIRST) if res.source_type == "TRAFFIC" else METRIC_FIRST
            state, reason = self._traffic.get(node.path, first)
            return self._set(now, node, RecordKind.HEALTH_SOURCE, state, reason, records)
        counts = self._counts(bs) if bs else None
        policy = self._policies.get(str(res.ref("health_aggregation_policy")))
        if counts is None or policy is None:
            return self._set(
                now,
                node,
                RecordKind.HEALTH_SOURCE,
                UNKNOWN,
                "backend service or policy missing",
                records,
            )
        state, reason = evaluate(policy, *counts)
        total, healthy, _, degraded = counts
        # (a degraded endpoint serves: it counts in the healthy fraction too)
        moved = self._fraction(node, (healthy + degraded) / total if total else None)
        return self._set(now, node, RecordKind.HEALTH_SOURCE, state, reason, records) or moved

    def set_traffic(
        self, now: float, source: str, state: HealthState, reason: str, records: list[Record]
    ) -> None:
        """A state judged outside the graph - a TRAFFIC source's
        (health/traffic.py), a METRIC source's (controlplane/metric_sources.py):
        propagated."""
        self._traffic[source] = (state, reason)
        node = self._sources.get(source)
        if node is not None:
            self._propagate(now, records, sources=[node])

    def hold_routes(
        self, now: float, held: bool, records: list[Record], since: float = 0.0, why: str = ""
    ) -> None:
        """A failover storm (health/storms.py): while ``held``, routes are
        computed from the NEGs as they were at ``since`` (routes that moved
        after it move back; shifts still act); let go, every route follows
        the NEGs' states again."""
        if held:
            if self._held is None:
                snapshot = {p: (n.state, n.fraction) for p, n in self._negs.items()}
                for t, path, state, fraction in reversed(self._neg_history):
                    if t < since:
                        break
                    if path in snapshot:
                        snapshot[path] = (state, fraction)
                self._held, self._held_why = snapshot, why
                self._propagate(now, records, routes=list(self._routes.values()))
            return
        if self._held is None:
            return
        self._held = None
        self._propagate(now, records, routes=list(self._routes.values()))

    @property
    def holding(self) -> bool:
        return self._held is not None

    def traffic_sources(self) -> dict[str, tuple[ResourcePath, HealthSource, HealthState]]:
        """Every TRAFFIC source: (its backend service, the source, its state now)."""
        out = {}
        for path, node in self._sources.items():
            r = node.resource
            if isinstance(r, HealthSource) and r.source_type == "TRAFFIC":
                bs = r.ref("sources")
                if bs is not None:
                    out[path] = (bs, r, node.state)
        return out

    def _fraction(self, node: _Node, fraction: float | None) -> bool:
        """Set a node's healthy fraction: has it moved in a way that matters
        (some consumer spills PROPORTIONAL)?"""
        moved = fraction != node.fraction
        node.fraction = fraction
        return moved and self._proportional

    def _eval_composite(self, now: float, node: _Node, records: list[Record]) -> bool:
        res = node.resource
        assert isinstance(res, CompositeHealthCheck)
        parts = []
        fractions = []
        for p in res.refs("health_sources"):
            src = self._sources.get(str(p))
            if src is None:
                parts.append((p.name, UNKNOWN, "missing"))
            else:
                parts.append((p.name, src.state, src.reason))
                if src.fraction is not None:
                    fractions.append(src.fraction)
        state, reason = combine(parts)
        self._set(now, node, RecordKind.COMPOSITE, state, reason, records)
        moved = self._fraction(node, min(fractions) if fractions else None)
        delivered = UNKNOWN if res.mode == "DRY_RUN" else state
        if delivered is node.delivered:
            return moved
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
        fraction = None
        if comp is not None and getattr(comp.resource, "mode", "") != "DRY_RUN":
            fraction = comp.fraction
        return self._fraction(node, fraction) or changed

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
        accepted_changed = node.accepted is not accepted
        node.accepted = accepted
        before = (node.state, node.fraction)
        moved = self._fraction(node, att.fraction if att is not None and accepted else None)
        changed = self._set(now, node, RecordKind.NEG, state, reason, records)
        if (node.state, node.fraction) != before:
            history = self._neg_history
            history.append((now, node.path, *before))
            while history and (history[0][0] < now - NEG_HISTORY or len(history) > 100_000):
                history.popleft()
        return changed or accepted_changed or moved

    def _candidates(self, fr: ForwardingRule) -> tuple[list[Candidate], BackendService | None]:
        """A consumer front end's PSC NEGs as route candidates, and its backend service."""
        bs_path = fr.ref("backend_service")
        bs = self._resources.get(bs_path) if bs_path else None
        if not isinstance(bs, BackendService):
            return [], None
        candidates = []
        policy = bs.policy
        proportional = policy.spill == "PROPORTIONAL"
        for b, neg_path in zip(bs.backends, bs.refs("backends"), strict=False):
            neg = self._negs.get(str(neg_path))
            if neg is None:
                continue
            shift = self._shifted.get(neg.path)
            state, neg_fraction = neg.state, neg.fraction
            if self._held is not None and neg.path in self._held:
                state, neg_fraction = self._held[neg.path]  # (a storm held: as it began)
            # spill PROPORTIONAL: a degraded NEG keeps what its healthy part
            # can carry, overprovisioned (SPEC §6); unknown counts as whole
            fraction = neg_fraction if proportional else None
            factor = 1.0
            if fraction is not None:
                factor = min(1.0, policy.overprovisioning_factor * fraction)
            candidates.append(
                Candidate(
                    neg.path,
                    neg_path.name,
                    neg_path.region,
                    b.failover_priority,
                    state,
                    neg.accepted is not False,
                    shift.reason if shift is not None else "",
                    100 if b.traffic_dial is None else b.traffic_dial,
                    factor,
                    fraction,
                )
            )
        return candidates, bs

    def neg_accepted(self, neg: str) -> bool | None:
        """Did the service attachment accept this PSC NEG's connection (None:
        no such NEG)?"""
        node = self._negs.get(neg)
        return None if node is None else node.accepted is not False

    def shifts(self) -> list[Shift]:
        """Every Shift resource, active or run out, in path order."""
        return self._shifts

    def failover_order(self, frontend: str) -> list[tuple[Candidate, str]]:
        """A consumer front end's PSC NEGs in failover order (priority, then
        locality, then name), each with its service attachment's path: what
        other data planes (HAProxy's backup servers, Envoy's priorities) are
        configured from."""
        node = self._routes.get(frontend)
        if node is None:
            return []
        fr = node.resource
        assert isinstance(fr, ForwardingRule)
        candidates, _ = self._candidates(fr)
        return [(c, self._attachment_of(c.path)) for c in order(candidates, fr.data_plane_region)]

    def _eval_route(self, now: float, node: _Node, records: list[Record]) -> bool:
        fr = node.resource
        assert isinstance(fr, ForwardingRule)
        candidates, bs = self._candidates(fr)
        policy = bs.policy if bs is not None else None
        prev = node.route
        region = fr.data_plane_region
        choice = choose(
            candidates,
            region,
            prev.target if prev else None,
            policy.failback if policy else True,
            (policy.when_all_unhealthy == "FAIL_OPEN") if policy else True,
        )
        ramped = self._ramp(now, node, candidates, policy, records)
        overprovisioning = policy.overprovisioning_factor if policy else 1.4
        # where traffic goes (recorded), and - during a ramp - its step now
        full = distribute(candidates, region, choice.target, overprovisioning)
        shares = full
        if ramped is not candidates:
            shares = distribute(ramped, region, choice.target, overprovisioning)
        # the route's target is its first share's NEG: the choice itself,
        # unless it takes nothing (a trafficDial of 0, a ramp at its start)
        target = shares[0].neg if shares else choice.target
        fallbacks = tuple(
            self._attachment_of(c.path)
            for c in order(candidates, region)
            if c.accepted and c.eligible and c.path != target
        )
        keep = tuple(
            self._attachment_of(c.path)
            for c in order(candidates, region)
            if c.accepted and c.eligible and c.take > 0
        )
        single = len(shares) <= 1 and target == choice.target
        split = () if single else tuple((self._attachment_of(s.neg), s.percent) for s in shares)
        reason = choice.reason if single else f"{choice.reason}; shares {split_text(shares)}"
        if self._held is not None:
            reason = f"{reason} (held: {self._held_why})"
        attachment = self._attachment_of(target) if target else None
        full_target = full[0].neg if full else choice.target
        logged_target = None
        if prev is not None:
            logged = prev.recorded if prev.recorded is not None else _shares_of(prev)
            logged_target = logged[0].neg if logged else None
            if (logged_target, prev.mode) == (full_target, choice.mode) and not moved(logged, full):
                # (SPEC §6: no record unless a NEG gains or loses a share, or
                # one moves by 5 points or more - and none per ramp step)
                now_route = replace(
                    prev,
                    target=target,
                    attachment=attachment,
                    reason=reason,
                    fallbacks=fallbacks,
                    split=split,
                    shares=shares,
                    recorded=None if logged == shares else logged,
                    keep=keep,
                )
                if now_route == prev:
                    return False
                node.route = now_route
                return True  # republish: readers see the current reason, retries and split
        self._decisions += 1  # (a recorded change: a decision, SPEC §11)
        node.route = Route(
            node.path,
            target,
            attachment,
            choice.mode,
            reason,
            now,
            fallbacks,
            split,
            shares,
            None if full == shares else full,
            keep,
            self._decisions,
        )
        logged_split = len(full) > 1 or full_target != choice.target
        why = choice.reason if not logged_split else f"{choice.reason}; shares {split_text(full)}"
        if self._held is not None:
            why = f"{why} (held: {self._held_why})"
        records.append(
            RouteChange(
                now,
                fr.project,
                node.path,
                logged_target,
                full_target,
                choice.mode,
                why,
                shares=tuple((s.neg, s.region, s.percent) for s in full) if logged_split else (),
                generation=self._decisions,
            )
        )
        return True

    def _ramp(
        self,
        now: float,
        node: _Node,
        candidates: list[Candidate],
        policy: FailoverPolicy | None,
        records: list[Record],
    ) -> list[Candidate]:
        """Ramped failback (SPEC §6; health/ramps.py): the candidates with their ramps."""
        seconds = policy.failback_ramp_sec if policy is not None else 0
        project = node.resource.project
        return self._ramps.evaluate(now, node.path, project, candidates, seconds, records)

    def abandon_ramp(
        self, now: float, frontend: str, neg: str, total: int, failed: int, records: list[Record]
    ) -> bool:
        """The error gate (controlplane/ramp_gate.py) saw ``failed`` of
        ``total`` requests or connections to a ramping NEG fail: the ramp is
        abandoned (the NEG takes nothing) and starts again from 0 a success
        window later. False when the NEG is not ramping there (nothing done)."""
        node = self._routes.get(frontend)
        if node is None:
            return False
        record = self._ramps.abandon(
            now,
            frontend,
            node.resource.project,
            neg,
            self.ramp_seconds(frontend),
            self._success_window(neg),
            self._max_error_percent(frontend),
            (total, failed),
        )
        if record is None:
            return False
        records.append(record)
        self._propagate(now, records, routes=[node])
        return True

    def gated_ramps(self, now: float) -> dict[str, tuple[float, list[str]]]:
        """Front ends whose backend service sets failbackMaxErrorPercent, with
        it and their NEGs ramping now (started, not ended)."""
        out = {}
        for frontend, negs in self._ramps.running(now).items():
            limit = self._max_error_percent(frontend)
            if limit is not None:
                out[frontend] = (limit, negs)
        return out

    def _max_error_percent(self, frontend: str) -> float | None:
        policy = self._policy_of(frontend)
        return policy.failback_max_error_percent if policy is not None else None

    def _policy_of(self, frontend: str) -> FailoverPolicy | None:
        """The failover policy of a consumer front end's backend service."""
        node = self._routes.get(frontend)
        bs_path = node.resource.ref("backend_service") if node is not None else None
        bs = self._resources.get(bs_path) if bs_path else None
        return bs.policy if isinstance(bs, BackendService) else None

    def _success_window(self, neg: str) -> float:
        """How long the probes behind a PSC NEG take to call it HEALTHY again
        (the slowest health check's healthyThreshold x checkIntervalSec), and
        at least the error gate's window."""
        windows = [ERROR_WINDOW]
        node = self._negs.get(neg)
        att = self._attachments.get(self._attachment_of(neg)) if node is not None else None
        comp = (
            self._composite_by_destination.get(str(att.resource.ref("target_service")))
            if att is not None
            else None
        )
        for src_path in comp.resource.refs("health_sources") if comp is not None else ():
            src = self._resources.get(src_path)
            bs_path = src.ref("sources") if isinstance(src, HealthSource) else None
            bs = self._resources.get(bs_path) if bs_path else None
            for hc_path in bs.refs("health_checks") if isinstance(bs, BackendService) else ():
                hc = self._resources.get(hc_path)
                if isinstance(hc, HealthCheck):
                    windows.append(float(hc.check_interval_sec * hc.healthy_threshold))
        return max(windows)

    def ramp_seconds(self, frontend: str) -> int:
        policy = self._policy_of(frontend)
        return policy.failback_ramp_sec if policy is not None else 0

    def next_ramp_step(self, now: float) -> float | None:
        """When a ramp in progress next moves its shares (None: no ramp)."""
        fronts = self._ramps.ramps
        return self._ramps.next_step(now, {f: self.ramp_seconds(f) for f in fronts})

    def step_ramps(self, now: float, records: list[Record]) -> None:
        """Move every ramp in progress to ``now`` (ended ones are recorded at
        their own end time)."""
        nodes = [self._routes[p] for p in self._ramps.ramps if p in self._routes]
        if nodes:
            self._propagate(now, records, routes=nodes)

    def ramps(self) -> dict[str, dict[str, float]]:
        """Every ramp in progress: front end -> {NEG path: start time}."""
        return self._ramps.snapshot()

    def attachment_of(self, neg_path: str) -> str | None:
        return self._attachment_of(neg_path) if neg_path in self._negs else None

    def _attachment_of(self, neg_path: str) -> str:
        return str(self._negs[neg_path].resource.ref("psc_target_service"))

    def _publish_routes(self) -> None:
        self._route_version += 1
        self.generation += 1
        routes = {p: n.route for p, n in self._routes.items() if n.route is not None}
        self._route_table = RouteTable(self._route_version, MappingProxyType(routes), self._now)

    # ------------------------------------------------------------------ resources

    def sync(
        self,
        now: float,
        new: Mapping[ResourcePath, Resource],
        changed: Collection[ResourcePath],
        rebuilt: Iterable[ResourcePath],
        records: list[Record],
    ) -> None:
        """Make the graph the given world (``new``: all of it, read-only;
        ``changed``: every path put or deleted): replace changed nodes
        (keeping their state), keep the reverse indexes of those alone, and
        re-evaluate what they, and the backend services whose endpoints were
        rebuilt, touch. The work is the change's, never a pass over the world."""
        self._now = now
        self._resources = new
        shifts_changed = self._take_parameters(new, changed)
        # 2. the small upper layers: replace changed nodes, keeping their state
        removed = [0]
        levels = [
            self._sync_nodes(self._sources, new, changed, _is_source, removed),
            self._sync_nodes(self._composites, new, changed, _is_composite, removed),
            self._sync_nodes(self._attachments, new, changed, _is_attachment, removed),
            self._sync_nodes(self._negs, new, changed, _is_psc_neg, removed),
        ]
        removed[0] = 0
        route_nodes_touched = self._sync_nodes(self._routes, new, changed, _is_front_end, removed)
        routes_removed = removed[0] > 0
        dirty_routes = {n.path: n for n in route_nodes_touched}
        for p in changed:  # a global backend service moved: its front ends' NEGs did
            if p.collection == "backendServices":
                for node in list(self._routes_by_bs.get(p, ())):
                    self._unindex(node)
                    self._index(node)
                    dirty_routes[node.path] = node
        proportional = bool(self._proportional_bs)
        if proportional and not self._proportional:
            # the fractions did not travel up the graph until now: once, all of it
            levels = [list(t.values()) for t in (self._sources, self._composites,
                                                 self._attachments, self._negs)]  # fmt: skip
        self._proportional = proportional
        touched_sources, touched_composites, touched_attachments, touched_negs = levels
        dirty_sources = {n.path: n for n in touched_sources}
        for p in changed:
            if p.collection == "healthAggregationPolicies":
                for n in self._sources_by_policy.get(str(p), ()):
                    dirty_sources[n.path] = n
        for p in rebuilt:
            for n in self._sources_by_bs.get(p, ()):
                dirty_sources[n.path] = n
        now = self._sync_shifts(now, new, changed, shifts_changed, dirty_routes, records)
        # attachments whose target's composite changed are reached through the
        # composites; a newly created attachment or NEG is evaluated directly.
        self._propagate(
            now,
            records,
            sources=list(dirty_sources.values()),
            composites=touched_composites,
            attachments=touched_attachments,
            negs=touched_negs,
            routes=list(dirty_routes.values()),
        )
        if routes_removed:
            self._publish_routes()  # a front end is gone: no snapshot may still carry it

    def _take_parameters(
        self, new: Mapping[ResourcePath, Resource], changed: Collection[ResourcePath]
    ) -> bool:
        """What the graph keeps of resources that are not nodes - policies,
        which backend services spill PROPORTIONAL, shifts - for the changed
        paths; whether a shift changed."""
        shifts_changed = False
        for p in changed:
            r = new.get(p)
            if p.collection == "healthAggregationPolicies":
                if isinstance(r, HealthAggregationPolicy):
                    params = PolicyParams(r.healthy_percent_threshold, r.min_healthy_threshold)
                    self._policies[str(p)] = params
                else:
                    self._policies.pop(str(p), None)
            elif p.collection == "backendServices":
                if isinstance(r, BackendService) and r.policy.spill == "PROPORTIONAL":
                    self._proportional_bs.add(p)
                else:
                    self._proportional_bs.discard(p)
            elif p.collection == "shifts":
                shifts_changed = True
                if isinstance(r, Shift):
                    self._shift_map[str(p)] = r
                else:
                    self._shift_map.pop(str(p), None)
        return shifts_changed

    def _sync_shifts(
        self,
        now: float,
        new: Mapping[ResourcePath, Resource],
        changed: Collection[ResourcePath],
        shifts_changed: bool,
        dirty_routes: dict[str, _Node],
        records: list[Record],
    ) -> float:
        """What the shifts cover depends on the shifts and on the PSC NEGs
        and attachments there are: looked at again only when one of those
        moved (a shift's end is the timer's: :meth:`expire_shifts`). The
        time the routes it moved moved at."""
        negs_moved = self._shift_map and any(
            p.collection in ("networkEndpointGroups", "serviceAttachments") for p in changed
        )
        if not shifts_changed and not negs_moved:
            return now
        before = self._shifts
        known = {str(s.path) for s in before}
        self._shifts = sorted(self._shift_map.values(), key=lambda s: str(s.path))
        if shifts_changed:
            active = {str(s.path) for s in self._shifts if s.active(now)}
            # a shift that ended before this change and whose end the timer
            # has not recorded yet (and that the change did not extend) is
            # recorded now, at its own time - never lost to the change
            for shift in sorted(before, key=lambda s: s.expire_time):
                path = str(shift.path)
                if path in self._active and path not in active and not shift.active(now):
                    records.append(ended(shift))
            self._active = active
        shifted = active_effects(new, now) if self._shifts else {}
        if shifted != self._shifted:  # (a shift came, went or moved: every route may change)
            self._shifted = shifted
            dirty_routes.update(self._routes)
            return _shift_time(self._shifts, known, changed, now)
        return now

    # ------------------------------------------------------------------ shifts

    def next_shift_expiry(self, now: float) -> float | None:
        """When the next shift in effect runs out - one whose end is past
        ``now`` but not recorded yet included (its timer is due at once).
        Shifts in effect, not shifts active at ``now``: a timer set again
        between a shift's end and the timer's run (any world change does)
        would otherwise no longer see it - its end never recorded, its
        route left where the shift put it."""
        active = self._active
        ends = [s.expire_time for s in self._shifts if str(s.path) in active]
        return min(ends) if ends else None

    def expire_shifts(self, now: float, records: list[Record]) -> None:
        """Shifts that ran out by ``now``: recorded, each at its own
        ``expireTime`` (and the routes re-evaluated at that time), so that
        every node of a cluster computes the same records."""
        due = sorted(
            (s for s in self._shifts if not s.active(now) and str(s.path) in self._active),
            key=lambda s: s.expire_time,
        )
        for shift in due:
            t = shift.expire_time
            self._active.discard(str(shift.path))
            records.append(ended(shift))
            self._shifted = active_effects(self._resources, t)
            self._propagate(t, records, routes=list(self._routes.values()))

    def _sync_nodes(
        self,
        nodes: dict[str, _Node],
        new: Mapping[ResourcePath, Resource],
        changed: Collection[ResourcePath],
        want: Callable[[Resource], bool],
        removed: list[int],
    ) -> list[_Node]:
        """The nodes of one level for the changed paths: added, replaced
        (their state kept) or removed (counted in ``removed[0]``), and
        re-indexed; the added and replaced ones, by path."""
        touched = []
        for p in changed:
            key = str(p)
            r = new.get(p)
            node = nodes.get(key)
            if r is None or not want(r):
                if node is not None:
                    self._unindex(node)
                    del nodes[key]
                    self._traffic.pop(key, None)
                    removed[0] += 1
                continue
            if node is None:
                node = nodes[key] = _Node(r)
            else:
                self._unindex(node)
                node.resource = r
            touched.append(node)
        for node in touched:
            self._index(node)
        touched.sort(key=lambda n: n.path)
        return touched

    # ------------------------------------------------------------------ reverse indexes

    def _index(self, node: _Node) -> None:
        """Enter a node in the reverse indexes its resource puts it in (each
        list kept in path order), remembering where (:meth:`_unindex`)."""
        r = node.resource
        where: list[tuple[Index, Any]] = []
        if isinstance(r, HealthSource) and r.source_type != "BACKEND_SERVICE":
            pass  # (its state is judged outside: set_traffic)
        elif isinstance(r, HealthSource):
            bs = r.ref("sources")
            if bs:
                where.append((self._sources_by_bs, bs))
            where.append((self._sources_by_policy, str(r.ref("health_aggregation_policy"))))
        elif isinstance(r, CompositeHealthCheck):
            for src in r.refs("health_sources"):
                where.append((self._composites_by_source, str(src)))
            self._composite_by_destination[str(r.ref("health_destination"))] = node
        elif isinstance(r, ServiceAttachment):
            where.append((self._attachments_by_fr, str(r.ref("target_service"))))
        elif isinstance(r, NetworkEndpointGroup):
            where.append((self._negs_by_attachment, str(r.ref("psc_target_service"))))
        elif isinstance(r, ForwardingRule):
            gbs_path = r.ref("backend_service")
            if gbs_path is not None:
                where.append((self._routes_by_bs, gbs_path))
                gbs = self._resources.get(gbs_path)
                if isinstance(gbs, BackendService):
                    for neg in gbs.refs("backends"):
                        where.append((self._routes_by_neg, str(neg)))
        for index, key in where:
            insort(index.setdefault(key, []), node, key=_path_of)
        node.indexed = where

    def _unindex(self, node: _Node) -> None:
        for index, key in node.indexed:
            listed = index.get(key)
            if listed is not None:
                for i, other in enumerate(listed):
                    if other is node:
                        del listed[i]
                        break
                if not listed:
                    del index[key]
        node.indexed = []
        r = node.resource
        if isinstance(r, CompositeHealthCheck):
            dest = str(r.ref("health_destination"))
            if self._composite_by_destination.get(dest) is node:
                del self._composite_by_destination[dest]

    # ------------------------------------------------------------------ restarts

    def restore(
        self,
        now: float,
        nodes: Mapping[str, tuple[HealthState, str, float]],
        routes: Mapping[str, Route],
        ramps: Mapping[str, Mapping[str, float]],
    ) -> list[Record]:
        """Resume nodes, routes and ramps in progress from persisted states,
        then re-evaluate everything once: only real differences produce records."""
        self._ramps.restore(now, {p: r for p, r in ramps.items() if p in self._routes})
        for table in (self._sources, self._composites, self._negs):
            for path, node in table.items():
                if path in nodes:
                    node.state, node.reason, node.since = nodes[path]
                    r = node.resource
                    if isinstance(r, HealthSource) and r.source_type != "BACKEND_SERVICE":
                        self._traffic[path] = (node.state, node.reason)
                    if table is self._composites:
                        mode = getattr(node.resource, "mode", "ENFORCE")
                        node.delivered = UNKNOWN if mode == "DRY_RUN" else node.state
        for fr_path, route in routes.items():
            route_node = self._routes.get(fr_path)
            if route_node is None:
                continue
            if route.target is None:
                route_node.route = route
            elif route.target in self._negs:
                att = str(self._negs[route.target].resource.ref("psc_target_service"))
                route_node.route = replace(route, frontend=fr_path, attachment=att)
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

    def route_table(self) -> RouteTable:
        return self._route_table

    def node_states(self) -> Iterator[tuple[str, NodeStatus]]:
        """(kind, status) of every source, composite and PSC NEG."""
        for kind, table in (
            (RecordKind.HEALTH_SOURCE, self._sources),
            (RecordKind.COMPOSITE, self._composites),
            (RecordKind.NEG, self._negs),
        ):
            for node in table.values():
                yield kind, NodeStatus(node.path, node.state, node.reason, node.since)

    def knows(self, path: str) -> bool:
        """Is there a source, composite, attachment, NEG or front end of this path?"""
        return any(
            path in nodes
            for nodes in (
                self._sources,
                self._composites,
                self._negs,
                self._attachments,
                self._routes,
            )
        )

    def node_status(self, path: ResourcePath | str) -> NodeStatus | None:
        key = str(path)
        for nodes in (self._sources, self._composites, self._negs, self._attachments):
            node = nodes.get(key)
            if node is not None:
                return NodeStatus(node.path, node.state, node.reason, node.since, node.fraction)
        route = self._routes.get(key)
        if route is not None and route.route is not None:
            r = route.route
            return NodeStatus(key, UNKNOWN, r.reason, r.since)
        return None

    def destination_state(self, forwarding_rule: ResourcePath | str) -> NodeStatus | None:
        """The state delivered to a producer forwarding rule by its composite."""
        comp = self._composite_by_destination.get(str(forwarding_rule))
        if comp is None:
            return None
        fraction = None if getattr(comp.resource, "mode", "") == "DRY_RUN" else comp.fraction
        return NodeStatus(str(forwarding_rule), comp.delivered, comp.reason, comp.since, fraction)


def _path_of(node: _Node) -> str:
    return node.path


def _is_source(r: Resource) -> bool:
    return isinstance(r, HealthSource)


def _is_composite(r: Resource) -> bool:
    return isinstance(r, CompositeHealthCheck)


def _is_attachment(r: Resource) -> bool:
    return isinstance(r, ServiceAttachment)


def _is_psc_neg(r: Resource) -> bool:
    return (
        isinstance(r, NetworkEndpointGroup) and r.network_endpoint_type == "PRIVATE_SERVICE_CONNECT"
    )


def _is_front_end(r: Resource) -> bool:
    return isinstance(r, ForwardingRule) and r.is_global


def _shift_time(
    shifts: list[Shift], known: set[str], changed: Collection[ResourcePath], now: float
) -> float:
    """When routes moved by a new shift moved: the shift's own creation time
    when it was written alone (as the shifts API writes it), so that every
    node of a cluster records the same route change at the same time - the
    elected writer's record and the others' are then one record (else ``now``)."""
    if not changed or any(p.collection != "shifts" for p in changed):
        return now
    fresh = [s.created for s in shifts if str(s.path) not in known]
    return min(now, max(fresh)) if fresh else now


def _shares_of(route: Route) -> tuple[Share, ...]:
    """A route's shares; one restored from the store has none written down:
    all of it went to its target."""
    if route.shares or route.target is None:
        return route.shares
    return (Share(route.target, "", 100.0, ""),)
