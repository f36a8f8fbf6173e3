"""The data plane: a listener per forwarding rule in the store, whose
connections and requests follow the routes.

Two parts, wired here: the listeners' bookkeeping (dataplane/listeners.py:
which rules ask for which listener, opening and closing them) and route
following (dataplane/choice.py: where each new connection or request goes).
:class:`DataPlane` makes each listener's protocol - TCP, UDP or HTTP
(dataplane/tcp.py, udp.py, http.py) - over the choice, keeps the listeners
matched to the rules (:meth:`DataPlane.sync`), and after a failover, with
``drain_on_failover``, closes open TCP connections to a region no longer
routed to (:meth:`DataPlane.routes_changed`; by default a failover moves
*new* connections and requests only).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from healthgate.dataplane.affinity import KEY_BYTES, CookieSigner
from healthgate.dataplane.choice import (
    PROPAGATION_BUCKETS,
    Address,
    Balance,
    HealthView,
    UpstreamChoice,
)
from healthgate.dataplane.counters import ListenerCounters, Trips
from healthgate.dataplane.guard import ConnectionGuard
from healthgate.dataplane.http import HttpProxy
from healthgate.dataplane.http_limits import HttpSettings
from healthgate.dataplane.listeners import (
    Layer,
    Listener,
    ListenerSpec,
    close_listener,
    desired_listeners,
    open_listener,
    reuse_port_hint,
    taken,
)
from healthgate.dataplane.retry import RetryBudget
from healthgate.dataplane.tcp import TcpProxy
from healthgate.dataplane.udp import UdpListener
from healthgate.dataplane.upstream import UpstreamPool
from healthgate.health.evidence import Hops
from healthgate.model.addresses import Reserved
from healthgate.model.change import WorldChange
from healthgate.model.names import ResourcePath
from healthgate.model.resources import (
    BackendService,
    ForwardingRule,
    InstanceGroup,
    NetworkEndpointGroup,
    Resource,
)

log = logging.getLogger("healthgate.dataplane")

# (listener, upstream, successes, errors, errors by kind): /metrics reads these
UpstreamTotal = tuple[str, Address, int, int, Mapping[str, int]]


def upstream_text(address: Address) -> str:
    ip, port = address
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def upstream_view(counts: Iterable[tuple[Address, int, int]]) -> dict[str, dict[str, int]]:
    """A listener's status: ``"ip:port" -> {served, errors}`` (the dashboard's rates)."""
    return {upstream_text(a): {"served": ok, "errors": bad} for a, ok, bad in counts}


__all__ = ["PROPAGATION_BUCKETS", "Balance", "DataPlane", "DataPlaneSettings", "HealthView"]


@dataclass(frozen=True, slots=True)
class DataPlaneSettings:
    enabled: bool = True
    connect_timeout: float = 1.0
    udp_idle_timeout: float = 60.0
    # on failover, close open TCP connections to regions no longer routed to
    # (default: keep them; only new connections move)
    drain_on_failover: bool = False
    balance: Balance = Balance.ROUND_ROBIN
    # listener processes (0: the listeners run in the serving process itself);
    # with workers, each opens every listener with SO_REUSEPORT (dataplane/workers.py)
    workers: int = 0
    reuse_port: bool = False
    # cluster mode (SPEC §4): open only the regional rules of this region and
    # the global rules whose dataPlaneRegion is this region (None: every rule)
    region: str | None = None
    http: HttpSettings = field(default_factory=HttpSettings)
    # open client connections of every front end together (dataplane/guard.py);
    # 0: half of the open-file limit less 4,096 kept for the rest
    max_connections: int = 0
    # connections of one client address, and UDP sessions of one (0: an eighth of the cap, >= 64)
    max_per_source: int = 0
    # UDP sessions of every front end together, and of one /24 or /64 network
    # (0: a quarter of the cap, >= 256; four sources' share) - apart from the
    # connections' cap (dataplane/guard.py)
    max_udp_sessions: int = 0
    max_sessions_per_prefix: int = 0
    # HTTP: request bodies held by every front-end connection together (503 beyond)
    max_buffered: int = 256 * 1024 * 1024
    header_timeout: float = 10.0  # HTTP: a request head must be whole within this
    idle_timeout: float = 60.0  # HTTP: a keep-alive connection with no request is closed
    # serve's own addresses: a rule asking for one gets no listener (model/addresses.py)
    reserved: tuple[Reserved, ...] = ()
    # listening sockets of every rule together (0: a sixteenth of the open-file
    # limit, 64 to 4,096): a rule that does not fit gets no listener, with a log line
    max_listening_sockets: int = 0
    # the keys of the session-affinity cookie (dataplane/affinity.py): the
    # signing one first, then the previous one (empty: a key of this process)
    affinity_keys: tuple[bytes, ...] = ()

    def listening_budget(self) -> int:
        if self.max_listening_sockets:
            return self.max_listening_sockets
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return min(4096, max(64, soft // 16))

    def connection_cap(self) -> int:
        if self.max_connections:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        # each proxied connection may hold an upstream descriptor too
        return max(256, (soft - 4096) // 2)

    def __post_init__(self) -> None:
        if self.balance not in BALANCE_POLICIES:
            raise ValueError(
                f"balance: {self.balance!r} is not one of {', '.join(BALANCE_POLICIES)}"
            )
        object.__setattr__(self, "balance", Balance(self.balance))
        if self.workers < 0:
            raise ValueError(f"workers: must be 0 or more, got {self.workers}")


BALANCE_POLICIES = tuple(b.value for b in Balance)


class FrontAffinity:
    """A consumer L7 front end's session affinity, read per request (the
    front end's backend service may gain or lose it with any apply)."""

    __slots__ = ("choice", "path")

    def __init__(self, choice: UpstreamChoice, path: str) -> None:
        self.choice = choice
        self.path = path

    def on(self) -> bool:
        return self.choice.affine(self.path)

    def groups(
        self, client_ip: str, headers: Sequence[tuple[bytes, bytes]]
    ) -> tuple[list[list[Address]], bytes] | None:
        if not self.on():
            return None
        return self.choice.affine_groups(self.path, client_ip, headers)


AppliedHook = Callable[[str, Mapping[str, int]], None]


class DataPlane:
    def __init__(self, engine: HealthView, settings: DataPlaneSettings | None = None) -> None:
        self.engine = engine
        self.settings = s = settings or DataPlaneSettings()
        self.listeners: dict[str, Listener] = {}
        # told which route generations the listeners now route by (SPEC §11:
        # convergence receipts): (instance - "" for this process, the
        # generation of each front end's route)
        self.on_applied: AppliedHook | None = None
        self.pool = UpstreamPool(s.http)
        self.guard = ConnectionGuard(
            s.connection_cap(),
            s.header_timeout,
            s.idle_timeout,
            max_buffered=s.max_buffered,
            max_per_source=s.max_per_source,
            max_udp_sessions=s.max_udp_sessions,
            max_sessions_per_prefix=s.max_sessions_per_prefix,
        )
        self.choice = UpstreamChoice(engine, s.balance, self.listeners)
        self.choice.signer = CookieSigner(s.affinity_keys or (secrets.token_bytes(KEY_BYTES),))
        self._live: dict[str, set[TcpProxy]] = {}
        self._unfitted: set[str] = set()  # rules without a listener for want of sockets
        # forwarding rule -> its backend service, and the reverse
        self._bs_of_rule: dict[str, ResourcePath] = {}
        self._rules_by_bs: dict[ResourcePath, set[str]] = {}
        self._hinted = not s.reuse_port
        # the outlier detector's thresholds per endpoint address (SPEC §8):
        # producer backend services with outlierDetection -> theirs
        self.trips = Trips()
        self._ejecting: dict[ResourcePath, tuple[int, int]] = {}

    # what tests and the fast path read of the choice
    @property
    def active(self) -> dict[Address, int]:
        return self.choice.active

    def first_try(self, frontend: str, consumer: bool) -> tuple[Address, list[Address]] | None:
        return self.choice.first_try(frontend, consumer)

    @property
    def propagation(self) -> list[int]:
        return self.choice.propagation

    @property
    def propagation_sum(self) -> float:
        return self.choice.propagation_sum

    # ------------------------------------------------------------------ listeners

    async def sync(self, resources: Mapping[ResourcePath, Resource]) -> None:
        """Open, close or reopen listeners to match the forwarding rules of
        a whole world (tests and tools; serve is told changes)."""
        await self.apply_change(WorldChange(0, 0.0, resources, resources, whole=True))

    async def apply_change(self, change: WorldChange) -> None:
        """Open, close or reopen the listeners the change concerns: the
        forwarding rules it put or deleted, and those whose backend service
        it put (every rule, for a new world); rules that did not fit before
        are tried again."""
        # (a new view each change: the choice's caches hold the one they were made from)
        self.choice.resources = MappingProxyType(change.world)
        self._index_rules(change)
        self._update_trips(change)
        if not self.settings.enabled:
            return
        world = change.world
        if change.whole:
            concerned = set(self.listeners) | {
                str(p) for p, r in world.items() if isinstance(r, ForwardingRule)
            }
        else:
            concerned = self._concerned(change)
        concerned |= {p for p, li in self.listeners.items() if li.retry}
        rules = {}
        for text in concerned:
            rule_path = ResourcePath.parse(text)
            if rule_path in world:
                rules[rule_path] = world[rule_path]
        desired = desired_listeners(rules, self.settings.region, world)
        if desired and not self._hinted:
            self._hinted = True
            hint = reuse_port_hint()
            if hint is not None:
                log.warning("%s", hint)
        for text in concerned:
            listener = self.listeners.get(text)
            if listener is not None and (listener.retry or desired.get(text) != listener.spec):
                await close_listener(self.listeners.pop(text))
        await self._open(desired)

    def _concerned(self, change: WorldChange) -> set[str]:
        """The rules a change may move: put or deleted, or of a backend service it put."""
        out: set[str] = set()
        for p in change.changed:
            if p.collection == "forwardingRules":
                out.add(str(p))
            elif p.collection == "backendServices":
                out.update(self._rules_by_bs.get(p, ()))
        return out

    def _index_rules(self, change: WorldChange) -> None:
        """Which rules use each backend service (for :meth:`_concerned`)."""
        paths: Iterable[ResourcePath] = change.world if change.whole else change.changed
        for p in paths:
            if p.collection != "forwardingRules":
                continue
            old = self._bs_of_rule.pop(str(p), None)
            if old is not None:
                users = self._rules_by_bs.get(old)
                if users is not None:
                    users.discard(str(p))
                    if not users:
                        del self._rules_by_bs[old]
            rule = change.world.get(p)
            bs = rule.ref("backend_service") if isinstance(rule, ForwardingRule) else None
            if bs is not None:
                self._bs_of_rule[str(p)] = bs
                self._rules_by_bs.setdefault(bs, set()).add(str(p))

    def on_trip(self, hook: Callable[[], None]) -> None:
        """Called when a run of errors reaches an outlier threshold."""
        self.trips.hook = hook

    def _update_trips(self, change: WorldChange) -> None:
        """Which endpoint addresses have consecutive-error thresholds, and
        which: kept for the backend services with outlierDetection (few),
        looked at again when one of them, a group or a rule changed."""
        world = change.world
        paths: Iterable[ResourcePath] = world if change.whole else change.changed
        moved = change.whole
        for p in paths:
            if p.collection == "backendServices":
                bs = world.get(p)
                od = bs.outlier_detection if isinstance(bs, BackendService) else None
                if od is not None:
                    self._ejecting[p] = (od.consecutive_errors, od.consecutive_gateway_errors)
                else:
                    self._ejecting.pop(p, None)
                moved = True
            elif p.collection in ("networkEndpointGroups", "instanceGroups", "forwardingRules"):
                moved = True
        if not moved or (not self._ejecting and not self.trips.by_address):
            return
        by_address: dict[Address, tuple[int, int]] = {}
        for bs_path, thresholds in self._ejecting.items():
            bs = world.get(bs_path)
            if not isinstance(bs, BackendService):
                continue
            for rule in self._rules_by_bs.get(bs_path, ()):
                fr = world.get(ResourcePath.parse(rule))
                if not isinstance(fr, ForwardingRule) or fr.is_global:
                    continue
                port = fr.port_list()[0]
                for group_path in bs.refs("backends"):
                    group = world.get(group_path)
                    if isinstance(group, NetworkEndpointGroup):
                        for ep in group.endpoints:
                            by_address[(ep.ip_address, ep.port or port)] = thresholds
                    elif isinstance(group, InstanceGroup):
                        for inst in group.instances:
                            by_address[(inst.ip_address, group.serving_port or port)] = thresholds
        if by_address != self.trips.by_address:
            self.trips.by_address = by_address
            for li in self.listeners.values():
                li.counters.set_trips()

    async def _open(self, desired: Mapping[str, ListenerSpec]) -> None:
        budget = self.settings.listening_budget()
        sockets = sum(len(li.servers) + len(li.datagrams) for li in self.listeners.values())
        for path, spec in sorted(desired.items()):
            if path not in self.listeners:
                conflicts = taken(spec, self.settings.reserved)
                if conflicts:
                    self.listeners[path] = self._refused(path, spec, conflicts)
                    continue
                if sockets + len(spec.ports) > budget:
                    error = (
                        f"not listening: its {len(spec.ports)} port(s) would pass the "
                        f"{budget} listening sockets the data plane may hold ({sockets} held)"
                    )
                    if path not in self._unfitted:  # (once, not at every sync)
                        self._unfitted.add(path)
                        log.error("%s: %s (serve --max-listening-sockets)", path, error)
                    self.listeners[path] = Listener(spec, error=error, retry=True)
                    continue
                listener = Listener(spec, counters=ListenerCounters(trips=self.trips))
                factory = self._factory(path, spec, listener.counters)
                # the TCP connections the factory's proxies add themselves to
                listener.live = self._live.pop(path, listener.live)
                self._unfitted.discard(path)
                self.listeners[path] = opened = await open_listener(
                    path, spec, factory, self.settings.reuse_port, listener
                )
                sockets += len(opened.servers) + len(opened.datagrams)

    @staticmethod
    def _refused(path: str, spec: ListenerSpec, conflicts: list[Reserved]) -> Listener:
        """A stored rule on one of serve's own addresses: no listener (the
        API and the integrations stay reachable, so it can be fixed)."""
        r = conflicts[0]
        error = f"not listening: {r.ip}:{r.port} is serve's own address ({r.what})"
        log.error("%s: %s; delete or change the rule", path, error)
        return Listener(spec, error=error)

    def _factory(
        self, path: str, spec: ListenerSpec, counters: ListenerCounters
    ) -> Callable[[], asyncio.BaseProtocol]:
        s = self.settings
        choice = self.choice
        if spec.consumer:

            def choose() -> list[Address]:
                return choice.consumer_upstreams(path)
        else:

            def choose() -> list[Address]:
                return choice.producer_upstreams(path)

        if spec.layer is Layer.UDP:
            return lambda: UdpListener(choose, s.udp_idle_timeout, counters, guard=self.guard)
        # connections / requests in flight per upstream: only least-connections reads them
        active = choice.active if s.balance is Balance.LEAST_CONNECTIONS else None
        if spec.layer is Layer.HTTP:
            if spec.consumer:

                def groups() -> list[list[Address]]:
                    return choice.consumer_upstream_groups(path)
            else:

                def groups() -> list[list[Address]]:
                    return [choice.producer_upstreams(path)]

            first: Callable[[bytes], tuple[Address, list[Address]] | None] | None = None
            if (
                s.balance is Balance.ROUND_ROBIN
            ):  # (least-connections looks at every request's load; a partial: no Python frame)
                first = functools.partial(choice.first_try, path, spec.consumer)

            budget = (
                RetryBudget(functools.partial(self._retry_limits, path)) if spec.consumer else None
            )
            affine = FrontAffinity(choice, path) if spec.consumer else None
            return lambda: HttpProxy(
                groups,
                self.pool,
                s.http,
                counters,
                choice.route_used,
                active,
                first,
                self.guard,
                budget,
                affine,
            )
        live = self._live.setdefault(path, set())
        if spec.consumer:

            def for_client(client_ip: str) -> list[Address]:
                return choice.consumer_for_client(path, client_ip)
        else:

            def for_client(client_ip: str) -> list[Address]:
                return choice.producer_for_client(path, client_ip)

        return lambda: TcpProxy(for_client, s.connect_timeout, counters, live, active, self.guard)

    def _retry_limits(self, rule: str) -> tuple[float, int] | None:
        """A consumer rule's retry budget (SPEC §8) as its backend service has
        it now: (percent, minConcurrent), or None (unbounded). Looked up per
        retry into another region, never per request."""
        resources = self.choice.resources
        fr = resources.get(ResourcePath.parse(rule))
        bs_path = fr.ref("backend_service") if isinstance(fr, ForwardingRule) else None
        bs = resources.get(bs_path) if bs_path is not None else None
        budget = bs.policy.retry_budget if isinstance(bs, BackendService) else None
        return None if budget is None else (budget.percent, budget.min_concurrent)

    async def close(self, grace: float = 0.0) -> None:
        """Stop accepting at once; give the open client connections up to
        ``grace`` seconds to end, then close them."""
        for listener in self.listeners.values():
            await close_listener(listener)
        self.listeners.clear()
        closed = await self.guard.drain(grace)
        if closed:
            log.info("closed %d front-end connections still open after %g s", closed, grace)
        self.pool.close()
        self.guard.close()

    # ------------------------------------------------------------------ after a failover

    def serving(self) -> list[str]:
        """The rules this data plane listens for now."""
        return [
            p
            for p, li in self.listeners.items()
            if li.error is None and (li.servers or li.datagrams)
        ]

    def routes_changed(self, frontends: list[str]) -> None:
        """Called with the front ends whose route just changed. With
        ``drain_on_failover``, their open TCP connections to a region that is
        no longer routed to are closed; by default they are kept. (Called
        on every change of health: slow start notes who joined, too.)"""
        self.choice.observe_health()
        if self.on_applied is not None:  # (SPEC §11: these listeners read the routes per request)
            routes = self.engine.route_table().routes
            self.on_applied("", {f: routes[f].generation for f in self.serving() if f in routes})
        if not self.settings.drain_on_failover:
            return
        for frontend in frontends:
            listener = self.listeners.get(frontend)
            if listener is None or not listener.live:
                continue
            allowed: set[Address] = set()
            for rule, address in self.choice.targets(frontend)[:1]:  # the region routed to now
                allowed.add(address)
                if rule is not None:
                    allowed |= set(self.choice.all_rule_endpoints(rule))
            drained = [c for c in listener.live if c.upstream_address not in allowed]
            for conn in drained:
                conn.drain()
            if drained:
                listener.counters.event("drained", len(drained))
                log.info("%s: drained %d connection(s) after failover", frontend, len(drained))

    def listener_events(self) -> dict[str, dict[str, int]]:
        return {path: li.counters.events for path, li in self.listeners.items()}

    def take_hops(self) -> dict[str, dict[Address, Hops]]:
        """Per listener, what each upstream's hops came to since the last
        call (dataplane/counters.py): the evidence of SPEC §8, once a second."""
        out = {}
        for path, li in self.listeners.items():
            hops = li.counters.take()
            if hops:
                out[path] = hops
        return out

    def reset_runs(self, addresses: Iterable[Address]) -> None:
        """Upstreams just ejected: their runs of errors start again from nothing."""
        wanted = list(addresses)
        for li in self.listeners.values():
            for address in wanted:
                li.counters.reset_runs(address)

    def upstream_totals(self) -> Iterator[UpstreamTotal]:
        """(listener, upstream, successes, errors, errors by kind), in all."""
        for path, li in self.listeners.items():
            for address, c in li.counters.upstreams.items():
                yield path, address, c.served, c.errors, c.kinds

    def status(self) -> dict[str, dict[str, object]]:
        return {
            path: {
                "ip": li.spec.ip,
                "ports": list(li.spec.ports),
                "layer": str(li.spec.layer),
                "error": li.error,
                **li.counters.events,
                "upstreams": upstream_view(
                    (a, c.served, c.errors) for a, c in li.counters.upstreams.items()
                ),
            }
            for path, li in self.listeners.items()
        }


class DataPlaneMetrics(Protocol):
    @property
    def propagation(self) -> list[int]: ...

    @property
    def propagation_sum(self) -> float: ...

    def listener_events(self) -> dict[str, dict[str, int]]: ...

    def upstream_totals(self) -> Iterable[UpstreamTotal]: ...


class DataPlaneService(DataPlaneMetrics, Protocol):
    """What the serving process drives, whichever runs the listeners: the
    in-process :class:`DataPlane` or the worker processes' pool."""

    async def apply_change(self, change: WorldChange) -> None:
        """Open, keep or close the listeners the change concerns."""

    def routes_changed(self, frontends: list[str]) -> None: ...

    on_applied: AppliedHook | None

    def take_hops(self) -> dict[str, dict[Address, Hops]]:
        """Per listener, the hops of each upstream since the last call."""

    def reset_runs(self, addresses: Iterable[Address]) -> None:
        """Upstreams just ejected: their runs start again."""

    def on_trip(self, hook: Callable[[], None]) -> None:
        """Called when a run of errors reaches an outlier threshold (the
        evidence is then taken at once)."""

    def status(self) -> dict[str, dict[str, object]]: ...

    async def close(self, grace: float = 0.0) -> None: ...


class DataPlaneCollector(Collector):
    """The data plane's families, for the client library to write: route
    propagation, listener events, requests served per upstream."""

    def __init__(self, dp: DataPlaneMetrics) -> None:
        self.dp = dp

    def collect(self) -> Iterator[Metric]:
        hist = HistogramMetricFamily(
            "healthgate_route_propagation_seconds",
            "From a route change to the first request routed by it",
        )
        acc, cumulative = 0, []
        for bound, n in zip((*PROPAGATION_BUCKETS, float("inf")), self.dp.propagation, strict=True):
            acc += n
            cumulative.append(("+Inf" if bound == float("inf") else repr(bound), acc))
        hist.add_metric([], cumulative, self.dp.propagation_sum)
        yield hist
        events_family = CounterMetricFamily(
            "healthgate_listener_events",
            "Connections, requests, retries, refusals and timeouts per listener",
            labels=["listener", "event"],
        )
        served = CounterMetricFamily(
            "healthgate_listener_served",
            "Requests and connections an upstream served well, per listener and upstream",
            labels=["listener", "upstream"],
        )
        failed = CounterMetricFamily(
            "healthgate_listener_upstream_failures",
            "Requests and connections that failed at an upstream (SPEC 8: 5xx, timeout, "
            "reset, refused), per listener and upstream",
            labels=["listener", "upstream"],
        )
        kinds = CounterMetricFamily(
            "healthgate_listener_upstream_errors",
            "Errors of an upstream by kind (a status, timeout, reset, refused, unreachable)",
            labels=["listener", "upstream", "kind"],
        )
        for path, events in self.dp.listener_events().items():
            for key, value in sorted(events.items()):
                events_family.add_metric([path, key], value)
        for path, address, ok, errors, by_kind in self.dp.upstream_totals():
            upstream = upstream_text(address)
            served.add_metric([path, upstream], ok)
            if errors:
                failed.add_metric([path, upstream], errors)
                for kind, n in sorted(by_kind.items()):
                    kinds.add_metric([path, upstream, kind], n)
        yield events_family
        budget = CounterMetricFamily(
            "healthgate_retry_budget_exhausted",
            "Requests refused a retry into another region: the front end's retry budget was spent",
            labels=["listener"],
        )
        for path, events in self.dp.listener_events().items():
            if "retry_budget_exhausted" in events:
                budget.add_metric([path], events["retry_budget_exhausted"])
        yield budget
        yield served
        yield failed
        yield kinds
