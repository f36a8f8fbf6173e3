"""The data plane manager: one listener per forwarding rule in the store.

* A **producer** (regional) forwarding rule listens on ``IPAddress:ports`` and
  balances new connections over its backend service's HEALTHY endpoints
  (layer 4): round robin by default, or least-connections (the endpoint with
  the fewest open connections and requests in flight from this process; ties
  in round-robin order). An endpoint that turns UNHEALTHY gets no new
  connections. When none is HEALTHY it falls back to all of them (fail open,
  as cloud internal load balancers do) rather than refusing everything.
* A **consumer** (global) forwarding rule listens on ``IPAddress:portRange``
  and sends each new connection (TCP) or request (HTTP) to the published
  forwarding rule of the service attachment its route points at, with the
  route's fallbacks as the next tries.

Routes are read from the engine's immutable snapshot per connection or
request: no lock, and a new route is in use by the very next request after
the transition that caused it. Existing TCP connections to a region that
failed are kept by default: a failover moves *new* connections and requests;
with ``drain_on_failover`` they are closed (:meth:`DataPlane.routes_changed`).

A listener that cannot bind (address in use, not a local address) is logged
and reported in ``status()``; the rest of the system goes on.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import heapq
import logging
import resource
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, cast

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from healthgate.dataplane.guard import ConnectionGuard
from healthgate.dataplane.http import HttpProxy, HttpSettings, UpstreamPool
from healthgate.dataplane.tcp import Address, TcpProxy
from healthgate.dataplane.udp import UdpListener
from healthgate.health.engine import EndpointKey, RouteTable
from healthgate.model.lookups import published_rule
from healthgate.model.names import ResourcePath
from healthgate.model.resources import BackendService, ForwardingRule, Resource

log = logging.getLogger("healthgate.dataplane")

PROPAGATION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


@dataclass(frozen=True, slots=True)
class DataPlaneSettings:
    enabled: bool = True
    connect_timeout: float = 1.0
    udp_idle_timeout: float = 60.0
    # on failover, close open TCP connections to regions no longer routed to
    # (default: keep them; only new connections move)
    drain_on_failover: bool = False
    balance: str = "round-robin"  # or "least-connections"
    # listener processes (0: the listeners run in the serving process itself);
    # with workers, each opens every listener with SO_REUSEPORT (runtime/workers.py)
    workers: int = 0
    reuse_port: bool = False
    # cluster mode (SPEC §4): open only the regional rules of this region and
    # the global rules whose dataPlaneRegion is this region (None: every rule)
    region: str | None = None
    http: HttpSettings = field(default_factory=HttpSettings)
    # open client connections of every front end together (dataplane/guard.py);
    # 0: half of the open-file limit less 4,096 kept for the rest
    max_connections: int = 0
    header_timeout: float = 10.0  # HTTP: a request head must be whole within this
    idle_timeout: float = 60.0  # HTTP: a keep-alive connection with no request is closed

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
        if self.workers < 0:
            raise ValueError(f"workers: must be 0 or more, got {self.workers}")


BALANCE_POLICIES = ("round-robin", "least-connections")


@dataclass(frozen=True, slots=True)
class ListenerSpec:
    ip: str
    ports: tuple[int, ...]
    layer: str  # "tcp", "http" or "udp"
    consumer: bool


@dataclass(slots=True)
class Listener:
    spec: ListenerSpec
    servers: list[asyncio.Server] = field(default_factory=list)
    datagrams: list[asyncio.BaseTransport] = field(default_factory=list)
    live: set[TcpProxy] = field(default_factory=set)  # open L4 connections
    error: str | None = None
    stats: dict[str, int] = field(default_factory=dict)


class Target(NamedTuple):
    """One region of a consumer route: its producer rule and that rule's address."""

    rule: str | None
    address: Address


class _ProducerRule(NamedTuple):
    resources: Mapping[ResourcePath, Resource]  # valid while the resources are these
    backend_service: ResourcePath | None
    port: int  # the rule's port, for endpoints that have none


class _ProducerAddresses(NamedTuple):
    endpoints: tuple[EndpointKey, ...]  # valid while the engine gives this same tuple
    rule: _ProducerRule  # ... and the rule entry is this one
    addresses: list[Address]


class _RouteTargets(NamedTuple):
    version: int  # valid for this route-table version
    resources: Mapping[ResourcePath, Resource]
    targets: list[Target]


class _FirstTries(NamedTuple):
    generation: int  # valid for this engine generation
    resources: Mapping[ResourcePath, Resource]
    addresses: list[Address]  # the first region's candidates
    turns: str | None  # the producer rule whose round robin rotates them


class HealthView(Protocol):
    """What the data plane reads of health: the engine itself in the serving
    process, a snapshot of it in a worker process."""

    @property
    def generation(self) -> int:
        """Moves on whenever what the other three return may have changed."""

    def route_table(self) -> RouteTable: ...

    def healthy_endpoints(self, backend_service: ResourcePath) -> tuple[EndpointKey, ...]: ...

    def all_endpoints(self, backend_service: ResourcePath) -> tuple[EndpointKey, ...]: ...


class DataPlane:
    def __init__(self, engine: HealthView, settings: DataPlaneSettings | None = None) -> None:
        self.engine = engine
        self.settings = settings or DataPlaneSettings()
        self.listeners: dict[str, Listener] = {}
        self.pool = UpstreamPool(self.settings.http)
        s = self.settings
        self.guard = ConnectionGuard(s.connection_cap(), s.header_timeout, s.idle_timeout)
        self._rr: dict[str, int] = {}  # round-robin position per producer rule
        # open connections (L4) and requests in flight (L7) per upstream
        # address, counted with least-connections only
        self.active: dict[Address, int] = {}
        self._resources: Mapping[ResourcePath, Resource] = {}
        self._seen_version = 0
        self._live: dict[str, set[TcpProxy]] = {}
        # caches, each valid while what it was derived from is the same object
        self._rules: dict[str, _ProducerRule] = {}
        self._upstreams: dict[str, _RouteTargets] = {}
        self._addresses: dict[str, _ProducerAddresses] = {}
        self._plans: dict[str, _FirstTries] = {}  # the fast path's (see first_try)
        self.propagation = [0] * (len(PROPAGATION_BUCKETS) + 1)
        self.propagation_sum = 0.0

    # ------------------------------------------------------------------ listeners

    def _desired(self, resources: Mapping[ResourcePath, Resource]) -> dict[str, ListenerSpec]:
        out: dict[str, ListenerSpec] = {}
        for path, res in resources.items():
            if not isinstance(res, ForwardingRule) or not self._serves(res):
                continue
            bs_path = res.ref("backend_service")
            bs = resources.get(bs_path) if bs_path else None
            if not isinstance(bs, BackendService):
                continue
            if res.ip_protocol == "UDP":
                layer = "udp"
            elif res.is_global and bs.protocol == "HTTP":
                layer = "http"
            else:
                layer = "tcp"
            out[str(path)] = ListenerSpec(
                res.ip_address, tuple(res.port_list()), layer, res.is_global
            )
        return out

    def _serves(self, rule: ForwardingRule) -> bool:
        region = self.settings.region
        if region is None:
            return True
        return (rule.data_plane_region if rule.is_global else rule.region) == region

    async def sync(self, resources: Mapping[ResourcePath, Resource]) -> None:
        """Open, close or reopen listeners to match the forwarding rules."""
        self._resources = resources
        if not self.settings.enabled:
            return
        desired = self._desired(resources)
        for path in [p for p in self.listeners if desired.get(p) != self.listeners[p].spec]:
            await self._close(self.listeners.pop(path))
        for path, spec in desired.items():
            if path not in self.listeners:
                self.listeners[path] = await self._open(path, spec)

    async def _open(self, path: str, spec: ListenerSpec) -> Listener:
        listener = Listener(spec)
        loop = asyncio.get_running_loop()
        factory = self._factory(path, spec, listener.stats)
        listener.live = self._live.pop(path, listener.live)
        for port in spec.ports:
            try:
                if spec.layer == "udp":
                    transport, _ = await loop.create_datagram_endpoint(
                        cast(Callable[[], asyncio.DatagramProtocol], factory),
                        local_addr=(spec.ip, port),
                        reuse_port=self.settings.reuse_port or None,
                    )
                    listener.datagrams.append(transport)
                    continue
                server = await loop.create_server(
                    cast(Callable[[], asyncio.Protocol], factory),
                    spec.ip,
                    port,
                    reuse_address=True,
                    reuse_port=self.settings.reuse_port or None,
                    backlog=1024,
                )
                listener.servers.append(server)
            except OSError as exc:
                listener.error = f"cannot listen on {spec.ip}:{port}: {exc.strerror or exc}"
                log.error("%s: %s", path, listener.error)
        if listener.servers or listener.datagrams:
            log.info(
                "%s: listening on %s port(s) %s (%s)",
                path,
                spec.ip,
                ",".join(map(str, spec.ports)),
                spec.layer,
            )
        return listener

    def _factory(
        self, path: str, spec: ListenerSpec, stats: dict[str, int]
    ) -> Callable[[], asyncio.BaseProtocol]:
        s = self.settings
        if spec.consumer:

            def choose() -> list[Address]:
                return self.consumer_upstreams(path)
        else:

            def choose() -> list[Address]:
                return self.producer_upstreams(path)

        if spec.layer == "udp":
            return lambda: UdpListener(choose, s.udp_idle_timeout, stats)
        # connections / requests in flight per upstream: only least-connections reads them
        active = self.active if s.balance == "least-connections" else None
        if spec.layer == "http":
            if spec.consumer:

                def groups() -> list[list[Address]]:
                    return self.consumer_upstream_groups(path)
            else:

                def groups() -> list[list[Address]]:
                    return [self.producer_upstreams(path)]

            first = None
            if s.balance == "round-robin":  # (least-connections looks at every request's load)

                def first() -> tuple[Address, list[Address]] | None:
                    return self.first_try(path, spec.consumer)

            return lambda: HttpProxy(
                groups, self.pool, s.http, stats, self._route_used, active, first, self.guard
            )
        live = self._live.setdefault(path, set())
        return lambda: TcpProxy(choose, s.connect_timeout, stats, live, active, self.guard)

    async def _close(self, listener: Listener) -> None:
        for transport in listener.datagrams:
            transport.close()
        for server in listener.servers:
            server.close()
        for server in listener.servers:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await server.wait_closed()

    async def close(self, grace: float = 0.0) -> None:
        """Stop accepting at once; give the open client connections up to
        ``grace`` seconds to end, then close them."""
        for listener in self.listeners.values():
            await self._close(listener)
        self.listeners.clear()
        closed = await self.guard.drain(grace)
        if closed:
            log.info("closed %d front-end connections still open after %g s", closed, grace)
        self.pool.close()
        self.guard.close()

    # ------------------------------------------------------------------ choices

    def consumer_upstreams(self, frontend: str) -> list[Address]:
        """Where a consumer front end's next connection or request goes, in order.

        The route's region first, then its fallbacks. A region's published
        rule that this process serves itself is expanded in place into its own
        choice of healthy endpoints (the producer's round robin, done here):
        the PSC hop then costs nothing, with the same semantics. A rule served
        elsewhere is reached at its address.
        """
        return [address for group in self.consumer_upstream_groups(frontend) for address in group]

    def consumer_upstream_groups(self, frontend: str) -> list[list[Address]]:
        """The same, one group per region, for the HTTP proxy: a try that times
        out gives up on its whole region, a fast failure tries the next
        endpoint of the same region."""
        # the chosen region gets a few endpoints to try, the others one each
        return [
            self._region(rule, address, 3 if i == 0 else 1)
            for i, (rule, address) in enumerate(self._targets(frontend))
        ]

    def first_try(self, frontend: str, consumer: bool) -> tuple[Address, list[Address]] | None:
        """The first try of a request alone (the HTTP fast path's): the first
        address that :meth:`consumer_upstream_groups` (or, for a producer
        rule, :meth:`producer_upstreams`) would give, with the same round
        robin, and every candidate of its region (for the retry to skip when
        that region hangs). The candidates are derived once per engine generation and
        resource change; a request then costs a dict read and a modulo. The
        first request after a route change, which rebuilds them, observes the
        route's propagation."""
        plan = self._plans.get(frontend)
        if (
            plan is None
            or plan.generation != self.engine.generation
            or plan.resources is not self._resources
        ):
            plan = self._plan(frontend, consumer)
        addresses, turns = plan.addresses, plan.turns
        count = len(addresses)
        if count < 2 or turns is None:
            return (addresses[0], addresses) if count else None
        turn = self._rr.get(turns, 0)
        self._rr[turns] = turn + 1
        return addresses[turn % count], addresses

    def _plan(self, frontend: str, consumer: bool) -> _FirstTries:
        """The first region's candidates for :meth:`first_try`."""
        generation = self.engine.generation
        addresses: list[Address] = []
        turns: str | None = None
        if not consumer:
            addresses, turns = self._producer_addresses(frontend), frontend
        else:
            self._route_used()
            targets = self._targets(frontend)
            if targets:
                rule, address = targets[0]
                turns = self._served_here(rule)
                addresses = self._producer_addresses(turns) if turns else [address]
        plan = _FirstTries(generation, self._resources, addresses, turns)
        self._plans[frontend] = plan
        return plan

    def _region(self, rule: str | None, address: Address, n: int) -> list[Address]:
        """Up to ``n`` candidates in one region of a route: endpoints of its
        published rule when this process serves that rule (the producer's
        choice, done here), else the rule's address."""
        local = self._served_here(rule)
        return self.producer_upstreams(local, n) if local else [address]

    def _served_here(self, rule: str | None) -> str | None:
        """``rule`` when this process serves that published rule itself (its
        endpoints are then chosen here), else None (reached at its address)."""
        return rule if rule is not None and rule in self.listeners else None

    def _targets(self, frontend: str) -> list[Target]:
        """(producer rule, its address) per region of the route, resolved once
        per route-table version and resource change, not per request."""
        table = self.engine.route_table()
        cached = self._upstreams.get(frontend)
        if (
            cached is None
            or cached.version != table.version
            or cached.resources is not self._resources
        ):
            route = table.routes.get(frontend)
            targets: list[Target] = []
            if route is not None and route.attachment is not None:
                for att in (route.attachment, *route.fallbacks):
                    target = self.rule_of_attachment(att)
                    if target is not None:
                        targets.append(target)
            cached = _RouteTargets(table.version, self._resources, targets)
            self._upstreams[frontend] = cached
        return cached.targets

    def rule_of_attachment(self, attachment: str) -> Target | None:
        """(producer forwarding-rule path, its address) of a service attachment."""
        found = published_rule(self._resources, attachment)
        if found is None:
            return None
        path, fr = found
        return Target(str(path), (fr.ip_address, fr.port_list()[0]))

    def producer_upstreams(self, frontend: str, n: int = 3) -> list[Address]:
        """Up to ``n`` endpoints of a producer rule's backend service, HEALTHY
        ones only (all of them when none is): rotated round robin, or with
        least-connections the least busy first (ties in round-robin order).
        Read per connection or request: the addresses are rebuilt only when
        the engine's endpoint tuple or the rule changes."""
        addresses = self._producer_addresses(frontend)
        count = len(addresses)
        if not count:
            return []
        turn = self._rr.get(frontend, 0)
        self._rr[frontend] = turn + 1
        start = turn % count
        if self.settings.balance == "least-connections":
            active = self.active
            best = heapq.nsmallest(
                n, range(count), key=lambda i: (active.get(addresses[i], 0), (i - start) % count)
            )
            return [addresses[i] for i in best]
        end = start + n
        if end <= count:
            return addresses[start:end]
        return (addresses[start:] + addresses[:start])[:n]

    def _producer_addresses(self, frontend: str) -> list[Address]:
        """The addresses of a producer rule's HEALTHY endpoints (of all of
        them when none is), in the engine's order."""
        rule = self._rules.get(frontend)
        if rule is None or rule.resources is not self._resources:
            fr = self._resources.get(ResourcePath.parse(frontend))
            bs_path = fr.ref("backend_service") if isinstance(fr, ForwardingRule) else None
            port = fr.port_list()[0] if isinstance(fr, ForwardingRule) else 0
            rule = self._rules[frontend] = _ProducerRule(self._resources, bs_path, port)
        bs_path = rule.backend_service
        if bs_path is None:
            return []
        endpoints = self.engine.healthy_endpoints(bs_path) or self.engine.all_endpoints(bs_path)
        cached = self._addresses.get(frontend)
        if cached is None or cached.endpoints is not endpoints or cached.rule is not rule:
            port = rule.port
            addresses = [(ip, p if p is not None else port) for ip, p in endpoints]
            cached = _ProducerAddresses(endpoints, rule, addresses)
            self._addresses[frontend] = cached
        return cached.addresses

    def routes_changed(self, frontends: list[str]) -> None:
        """Called with the front ends whose route just changed. With
        ``drain_on_failover``, their open TCP connections to a region that is
        no longer routed to are closed; by default they are kept."""
        if not self.settings.drain_on_failover:
            return
        for frontend in frontends:
            listener = self.listeners.get(frontend)
            if listener is None or not listener.live:
                continue
            allowed: set[Address] = set()
            for rule, address in self._targets(frontend)[:1]:  # the region routed to now
                allowed.add(address)
                if rule is not None:
                    allowed |= set(self._all_rule_endpoints(rule))
            drained = [c for c in listener.live if c.upstream_address not in allowed]
            for conn in drained:
                conn.drain()
            if drained:
                listener.stats["drained"] = listener.stats.get("drained", 0) + len(drained)
                log.info("%s: drained %d connection(s) after failover", frontend, len(drained))

    def _all_rule_endpoints(self, rule: str) -> list[Address]:
        fr = self._resources.get(ResourcePath.parse(rule))
        if not isinstance(fr, ForwardingRule):
            return []
        bs_path = fr.ref("backend_service")
        port = fr.port_list()[0]
        endpoints = self.engine.all_endpoints(bs_path) if bs_path is not None else ()
        return [(ip, p if p is not None else port) for ip, p in endpoints]

    def _route_used(self) -> None:
        """Observe, once per route-table version, how long after its
        publication a request was first routed by it."""
        table = self.engine.route_table()
        if table.version == self._seen_version:
            return
        self._seen_version = table.version
        delay = max(0.0, time.time() - table.published)
        self.propagation[bisect.bisect_left(PROPAGATION_BUCKETS, delay)] += 1
        self.propagation_sum += delay

    def listener_stats(self) -> dict[str, dict[str, int]]:
        return {path: li.stats for path, li in self.listeners.items()}

    def status(self) -> dict[str, dict[str, object]]:
        return {
            path: {
                "ip": li.spec.ip,
                "ports": list(li.spec.ports),
                "layer": li.spec.layer,
                "error": li.error,
                **li.stats,
            }
            for path, li in self.listeners.items()
        }


class DataPlaneMetrics(Protocol):
    @property
    def propagation(self) -> list[int]: ...

    @property
    def propagation_sum(self) -> float: ...

    def listener_stats(self) -> dict[str, dict[str, int]]: ...


class DataPlaneService(DataPlaneMetrics, Protocol):
    """What the serving process drives, whichever runs the listeners: the
    in-process :class:`DataPlane` or the worker processes' pool."""

    async def sync(self, resources: Mapping[ResourcePath, Resource]) -> None:
        """Open, keep or close listeners to match the forwarding rules."""

    def routes_changed(self, frontends: list[str]) -> None: ...

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
        events = CounterMetricFamily(
            "healthgate_listener_events",
            "Connections, requests, retries, refusals and timeouts per listener",
            labels=["listener", "event"],
        )
        served = CounterMetricFamily(
            "healthgate_listener_served",
            "Requests and connections served, per listener and upstream",
            labels=["listener", "upstream"],
        )
        for path, stats in self.dp.listener_stats().items():
            for key, value in sorted(stats.items()):
                if key.startswith("served_by "):
                    served.add_metric([path, key.removeprefix("served_by ")], value)
                else:
                    events.add_metric([path, key], value)
        yield events
        yield served
