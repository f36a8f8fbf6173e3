"""Where each new connection or request goes: the data plane following
the routes (route following, apart from the listeners' bookkeeping in
dataplane/listeners.py).

* A **producer** (regional) rule balances over its backend service's
  HEALTHY endpoints: round robin by default, or least-connections (the
  endpoint with the fewest open connections and requests in flight from
  this process; ties in round-robin order). An endpoint that turns
  UNHEALTHY gets no new connections; when none is HEALTHY, all of them
  (fail open, as cloud internal load balancers do).
* A **consumer** (global) rule goes to the published forwarding rule of the
  service attachment its route points at, with the route's fallbacks as
  the next tries; a published rule this process serves itself is expanded
  in place into its own choice of endpoints (the PSC hop then costs
  nothing, with the same semantics).

Routes are read from the engine's immutable snapshot per connection or
request: no lock, and a new route is in use by the very next request after
the transition that caused it. Everything derived from a route or an
endpoint tuple is cached while what it was derived from is the same object.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import random
import time
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import NamedTuple, Protocol

from healthgate.dataplane.affinity import (
    COOKIE_B,
    MAX_COOKIE,
    Cookie,
    CookieSigner,
    cookie_value,
    key_of,
    rank,
    rendezvous,
    set_cookie,
    tag_of,
    target_text,
)
from healthgate.health.engine import EndpointKey, RouteTable
from healthgate.model.lookups import published_rule
from healthgate.model.names import ResourcePath
from healthgate.model.resources import (
    BackendService,
    ForwardingRule,
    InstanceGroup,
    NetworkEndpointGroup,
    Resource,
)

Address = tuple[str, int]
PROPAGATION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class Balance(StrEnum):
    """How a producer listener picks among HEALTHY endpoints."""

    ROUND_ROBIN = "round-robin"
    LEAST_CONNECTIONS = "least-connections"


class Target(NamedTuple):
    """One region of a consumer route: its producer rule and that rule's address."""

    rule: str | None
    address: Address


class _ProducerRule(NamedTuple):
    resources: Mapping[ResourcePath, Resource]  # valid while the resources are these
    backend_service: ResourcePath | None
    port: int  # the rule's port, for endpoints that have none
    slow_start: float = 0.0  # slowStartSec (SPEC §9; 0: off)
    slow_start_min: float = 0.1  # slowStartMinWeightPercent / 100


class _ProducerAddresses(NamedTuple):
    endpoints: tuple[EndpointKey, ...]  # valid while the engine gives this same tuple
    rule: _ProducerRule  # ... and the rule entry is this one
    addresses: list[Address]
    # session affinity's view, made when first asked: each address once,
    # its tag and its weight (its count in the weighted rotation)
    distinct: tuple[Address, ...] = ()
    tags: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    # slow start (SPEC §9): rebuilt at this monotonic time, while an
    # endpoint's weight is still growing (0: nothing is)
    until: float = 0.0


class _RouteTargets(NamedTuple):
    version: int  # valid for this route-table version
    resources: Mapping[ResourcePath, Resource]
    targets: list[Target]
    # running sums of the shares of the first targets when the route splits
    # its new traffic (SPEC §6), else empty
    cumulative: tuple[float, ...] = ()
    # session affinity (SPEC §9): each target's tag, the shares of the
    # first ones, and the tags a sticky client may stay on
    tags: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()
    keep: frozenset[int] = frozenset()
    # a region's published rule is served here with session affinity
    local_affinity: bool = False


class Affinity(NamedTuple):
    """A backend service's session affinity (SPEC §9), as the data plane reads it."""

    resources: Mapping[ResourcePath, Resource]  # valid while the resources are these
    mode: str  # NONE, CLIENT_IP, GENERATED_COOKIE, HEADER_FIELD
    header: bytes = b""  # HEADER_FIELD's header, lowercase
    ttl: int = 0  # the cookie's Max-Age (0: a session cookie)
    sticky: bool = False  # failoverPolicy.stickyFailback


NO_AFFINITY = "NONE"


class _FirstTries(NamedTuple):
    generation: int  # valid for this engine generation
    resources: Mapping[ResourcePath, Resource]
    addresses: list[Address]  # the first region's candidates
    turns: str | None  # the producer rule whose round robin rotates them
    # a route that splits its traffic: each share's region (candidates,
    # turns) and the running sums of the shares, to draw one per request
    regions: tuple[tuple[list[Address], str | None], ...] = ()
    cumulative: tuple[float, ...] = ()
    affine: bool = False  # session affinity: each request takes the general path
    until: float = 0.0  # slow start: valid until this monotonic time (0: no end)
    # GENERATED_COOKIE without a region served here with affinity: a request
    # carrying a valid cookie takes the fast path (:meth:`UpstreamChoice._cookie_first`),
    # with its regions' tags as the cookie names them, and the shares' weights
    cookie: Affinity | None = None
    tags: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    raw_tags: tuple[int, ...] = ()
    keep: frozenset[int] = frozenset()


class _Verified:
    """A cookie value that verified once: its client's key, and the region
    it was last assigned per plan (so a returning client costs a dict read)."""

    __slots__ = ("cookie", "key", "plan", "region")

    def __init__(self, cookie: Cookie, key: int) -> None:
        self.cookie = cookie
        self.key = key
        self.plan: object = None
        self.region = 0


MAX_VERIFIED = 65_536  # cookie values remembered as verified (then forgotten at once)


class HealthView(Protocol):
    """What the data plane reads of health: the engine itself in the serving
    process, a snapshot of it in a worker process."""

    @property
    def generation(self) -> int:
        """Moves on whenever what the other three return may have changed."""

    def route_table(self) -> RouteTable: ...

    def healthy_endpoints(self, backend_service: ResourcePath) -> tuple[EndpointKey, ...]: ...

    def all_endpoints(self, backend_service: ResourcePath) -> tuple[EndpointKey, ...]: ...


class UpstreamChoice:
    """The choice of upstream per connection or request (see the module doc)."""

    def __init__(self, engine: HealthView, balance: Balance, serving: Mapping[str, object]) -> None:
        self.engine = engine
        self.balance = balance
        # the rules this process listens for (a published rule among them is
        # expanded here into its endpoints)
        self.serving = serving
        self.resources: Mapping[ResourcePath, Resource] = {}
        self._rr: dict[str, int] = {}  # round-robin position per producer rule
        # open connections (L4) and requests in flight (L7) per upstream
        # address, counted with least-connections only
        self.active: dict[Address, int] = {}
        self._seen_version = 0
        # caches, each valid while what it was derived from is the same object
        self._rules: dict[str, _ProducerRule] = {}
        self._upstreams: dict[str, _RouteTargets] = {}
        self._addresses: dict[str, _ProducerAddresses] = {}
        self._plans: dict[str, _FirstTries] = {}  # the fast path's (see first_try)
        self.propagation = [0] * (len(PROPAGATION_BUCKETS) + 1)
        self.propagation_sum = 0.0
        self._affinity: dict[str, Affinity] = {}
        self._verified: dict[bytes, _Verified] = {}  # cookie values that verified
        # slow start: when each endpoint joined a rule's HEALTHY set, and that set
        self._since: dict[str, dict[EndpointKey, float]] = {}
        self._healthy_before: dict[str, set[EndpointKey]] = {}
        self.monotonic = time.monotonic
        # signs and checks the generated affinity cookie (serve sets its keys)
        self.signer = CookieSigner([b"healthgate-unset-affinity-key"])
        self.clock = time.time

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
            for i, (rule, address) in enumerate(self.pick(frontend))
        ]

    def first_try(
        self, frontend: str, consumer: bool, data: bytes = b""
    ) -> tuple[Address, list[Address]] | None:
        """The first try of a request alone (the HTTP fast path's): the first
        address that :meth:`consumer_upstream_groups` (or, for a producer
        rule, :meth:`producer_upstreams`) would give, with the same round
        robin, and every candidate of its region (for the retry to skip when
        that region hangs). The candidates are derived once per engine generation and
        resource change; a request then costs a dict read and a modulo. The
        first request after a route change, which rebuilds them, observes the
        route's propagation. ``data``: the request (a front end with cookie
        affinity reads the cookie there; None sends the request to the
        general path)."""
        plan = self._plans.get(frontend)
        if (
            plan is None
            or plan.generation != self.engine.generation
            or plan.resources is not self.resources
            or (plan.until and self.monotonic() >= plan.until)
        ):
            plan = self._plan(frontend, consumer)
        addresses, turns = plan.addresses, plan.turns
        if plan.affine:
            if plan.cookie is None:
                return None
            i = self._cookie_first(plan, data)
            if i < 0:
                return None
            addresses, turns = plan.regions[i]
        elif plan.cumulative:  # (a split route: the region is drawn by share)
            cumulative = plan.cumulative
            i = bisect.bisect_right(cumulative, random.random() * cumulative[-1])
            addresses, turns = plan.regions[i]
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
        regions: list[tuple[list[Address], str | None]] = []
        cumulative: tuple[float, ...] = ()
        if not consumer:
            addresses, turns = self._producer_addresses(frontend), frontend
        else:
            self.route_used()
            route = self._route_targets(frontend)
            for rule, address in route.targets[: max(1, len(route.cumulative))]:
                local = self._served_here(rule)
                regions.append((self._producer_addresses(local) if local else [address], local))
            if regions:
                addresses, turns = regions[0]
                cumulative = route.cumulative
        affine = consumer and self.affine(frontend)
        cookie: Affinity | None = None
        tags: tuple[str, ...] = ()
        raw: tuple[int, ...] = ()
        weights: tuple[float, ...] = ()
        keep: frozenset[int] = frozenset()
        if affine:
            aff = self.affinity(frontend)
            route = self._route_targets(frontend)
            if aff.mode == "GENERATED_COOKIE" and not route.local_affinity and regions:
                cookie = aff
                raw = route.tags[: len(regions)]
                tags = tuple(target_text(t) for t in raw)
                weights = route.weights
                keep = route.keep
        untils = [
            c.until
            for rule in ([frontend] if not consumer else [t for _, t in regions if t])
            if (c := self._addresses.get(rule)) is not None and c.until
        ]
        plan = _FirstTries(
            generation,
            self.resources,
            addresses,
            turns,
            tuple(regions),
            cumulative,
            affine,
            min(untils, default=0.0),
            cookie,
            tags,
            weights,
            raw,
            keep,
        )
        self._plans[frontend] = plan
        return plan

    def _cookie_client(
        self, aff: Affinity, headers: Sequence[tuple[bytes, bytes]]
    ) -> tuple[Cookie | None, str, int]:
        """A request's valid cookie (None: absent, not ours, expired), its
        client's id - a new one without a valid cookie - and its key."""
        entry = None
        for name, raw in headers:
            if len(name) == 6 and name.lower() == b"cookie":
                value = cookie_value(raw)
                if value is not None:
                    entry = self._verify(value.encode())
                    break
        if entry is not None and (not aff.ttl or self.clock() - entry.cookie.issued <= aff.ttl):
            return entry.cookie, entry.cookie.client, entry.key
        client = self.signer.new_client()
        return None, client, key_of(client.encode())

    def _verify(self, value: bytes) -> _Verified | None:
        """A cookie value verified (once: remembered in a bounded table), or
        None when it is not ours (its expiry is the caller's to check)."""
        entry = self._verified.get(value)
        if entry is None:
            try:
                text = value.decode("ascii")
            except UnicodeDecodeError:
                return None
            cookie = self.signer.read(text, self.clock(), 0)
            if cookie is None:
                return None
            if len(self._verified) >= MAX_VERIFIED:
                self._verified.clear()
            entry = self._verified[value] = _Verified(cookie, key_of(cookie.client.encode()))
        return entry

    def _cookie_first(self, plan: _FirstTries, data: bytes) -> int:
        """The fast path of a request with a valid ``HG_AFFINITY`` cookie:
        the index of its region among the plan's (-1: the general path -
        no cookie, one that does not verify or has expired, or one that
        must be issued again because the client's region changed). A value
        is verified once and remembered (a bounded table)."""
        at = data.find(COOKIE_B)
        if at < 0:
            return -1
        start = at + len(COOKIE_B)
        limit = start + MAX_COOKIE + 1
        end = data.find(b"\r", start, limit)  # (the value ends its line, or at a ";")
        semi = data.find(b";", start, limit)
        if semi >= 0 and (end < 0 or semi < end):
            end = semi
        if end < 0:
            return -1  # (longer than ours)
        entry = self._verify(data[start:end].rstrip())
        if entry is None:
            return -1
        aff = plan.cookie
        assert aff is not None
        if aff.ttl and self.clock() - entry.cookie.issued > aff.ttl:
            return -1
        if entry.plan is not plan:
            entry.plan = plan
            i = -1
            target = entry.cookie.target
            if aff.sticky and target in plan.tags:
                j = plan.tags.index(target)
                if plan.raw_tags[j] in plan.keep:
                    i = j
            if i < 0:
                i = (
                    max(0, rendezvous(entry.key, plan.raw_tags, plan.weights))
                    if plan.weights
                    else 0
                )
            entry.region = i
        i = entry.region
        # (a cookie naming another region than the client's: issued again, by the general path)
        return i if plan.tags[i] == entry.cookie.target else -1

    def _region(self, rule: str | None, address: Address, n: int) -> list[Address]:
        """Up to ``n`` candidates in one region of a route: endpoints of its
        published rule when this process serves that rule (the producer's
        choice, done here), else the rule's address."""
        local = self._served_here(rule)
        return self.producer_upstreams(local, n) if local else [address]

    def _served_here(self, rule: str | None) -> str | None:
        """``rule`` when this process serves that published rule itself (its
        endpoints are then chosen here), else None (reached at its address)."""
        return rule if rule is not None and rule in self.serving else None

    def targets(self, frontend: str) -> list[Target]:
        """(producer rule, its address) per region of the route, resolved once
        per route-table version and resource change, not per request: the
        regions that take a share first (in share order), then the fallbacks."""
        return self._route_targets(frontend).targets

    def _route_targets(self, frontend: str) -> _RouteTargets:
        table = self.engine.route_table()
        cached = self._upstreams.get(frontend)
        if (
            cached is None
            or cached.version != table.version
            or cached.resources is not self.resources
        ):
            route = table.routes.get(frontend)
            targets: list[Target] = []
            weights: list[float] = []
            tags: list[int] = []
            keep: frozenset[int] = frozenset()
            if route is not None and route.attachment is not None:
                keep = frozenset(tag_of(a) for a in route.keep)
                shares = dict(route.split)
                first = list(shares) or [route.attachment]
                # then every other NEG that may take traffic (a dialled-down
                # one too: for the retries of a request its shares could not serve)
                rest = [a for a in (route.attachment, *route.fallbacks) if a not in first]
                for att in (*first, *rest):
                    target = self.rule_of_attachment(att)
                    if target is not None:
                        targets.append(target)
                        tags.append(tag_of(att))
                        if att in shares:
                            weights.append(shares[att])
            cumulative = tuple(itertools.accumulate(weights)) if len(weights) > 1 else ()
            local_affinity = any(
                (local := self._served_here(t.rule)) is not None
                and self.affinity(local).mode != NO_AFFINITY
                for t in targets
            )
            cached = _RouteTargets(
                table.version,
                self.resources,
                targets,
                cumulative,
                tuple(tags),
                tuple(weights) if len(weights) > 1 else (),
                keep,
                local_affinity,
            )
            self._upstreams[frontend] = cached
        return cached

    def pick(self, frontend: str) -> list[Target]:
        """:meth:`targets` for one new connection or request: when the route
        splits its traffic (SPEC §6), the first region is drawn by share and
        the others follow in order."""
        cached = self._route_targets(frontend)
        cumulative = cached.cumulative
        if not cumulative:
            return cached.targets
        i = bisect.bisect_right(cumulative, random.random() * cumulative[-1])
        targets = cached.targets
        return targets if i == 0 else [targets[i], *targets[:i], *targets[i + 1 :]]

    def affinity(self, rule: str) -> Affinity:
        """The session affinity of a rule's backend service (SPEC §9)."""
        cached = self._affinity.get(rule)
        if cached is None or cached.resources is not self.resources:
            fr = self.resources.get(ResourcePath.parse(rule))
            bs_path = fr.ref("backend_service") if isinstance(fr, ForwardingRule) else None
            bs = self.resources.get(bs_path) if bs_path is not None else None
            if isinstance(bs, BackendService):
                cached = Affinity(
                    self.resources,
                    bs.session_affinity,
                    (bs.affinity_header or "").lower().encode(),
                    bs.affinity_cookie_ttl_sec,
                    bs.failover_policy is not None and bs.failover_policy.sticky_failback,
                )
            else:
                cached = Affinity(self.resources, NO_AFFINITY)
            self._affinity[rule] = cached
        return cached

    def affine(self, frontend: str) -> bool:
        """Does a consumer front end's choice depend on the client: its
        backend service has session affinity, or a region's published rule
        served here has (its endpoint then follows the client)."""
        return (
            self.affinity(frontend).mode != NO_AFFINITY
            or self._route_targets(frontend).local_affinity
        )

    def affine_groups(
        self, frontend: str, client_ip: str, headers: Sequence[tuple[bytes, bytes]]
    ) -> tuple[list[list[Address]], bytes]:
        """:meth:`consumer_upstream_groups` for a request of a front end with
        session affinity (dataplane/affinity.py), and the ``Set-Cookie``
        line to add to its answer (b"": none). ``headers`` as received.

        The client's region: with ``stickyFailback`` the one its cookie
        names while that one may keep it; else, when the route splits, the
        rendezvous of its key over the shares; else the route's region.
        The other regions follow in order, for the retries. (A front end
        without affinity whose region is served here with it: its region
        drawn by share as ever, the endpoint by the client.)"""
        aff = self.affinity(frontend)
        self.route_used()
        route = self._route_targets(frontend)
        targets = route.targets
        if not targets:
            return [], b""
        cookie = None
        client = ""
        if aff.mode == "GENERATED_COOKIE":
            cookie, client, key = self._cookie_client(aff, headers)
        else:
            key = _client_key(aff, client, client_ip, headers)
        tags = route.tags
        i = -1
        if aff.sticky and cookie is not None and cookie.target != "-":
            for j, t in enumerate(tags):
                if t in route.keep and target_text(t) == cookie.target:
                    i = j
                    break
        if i < 0 and route.weights:
            if aff.mode == NO_AFFINITY:
                cumulative = route.cumulative
                i = bisect.bisect_right(cumulative, random.random() * cumulative[-1])
            else:
                i = rendezvous(key, tags, route.weights)
        i = max(i, 0)
        ordered = targets if i == 0 else [targets[i], *targets[:i], *targets[i + 1 :]]
        groups = []
        for j, (rule, address) in enumerate(ordered):
            n = 3 if j == 0 else 1
            local = self._served_here(rule)
            if not local:
                groups.append([address])
                continue
            producer = self.affinity(local)
            if producer.mode == NO_AFFINITY:
                groups.append(self.producer_upstreams(local, n))
            else:
                local_key = _client_key(producer, client, client_ip, headers)
                groups.append(self.producer_affine(local, local_key, n))
        line = b""
        if aff.mode == "GENERATED_COOKIE":
            chosen = target_text(tags[i])
            if cookie is None or cookie.target != chosen:
                line = set_cookie(self.signer.issue(chosen, self.clock(), client), aff.ttl)
        return groups, line

    def producer_affine(self, frontend: str, key: int, n: int = 3) -> list[Address]:
        """Up to ``n`` endpoints of a producer rule for a client's key: the
        one it is assigned to by rendezvous over the HEALTHY endpoints'
        weights first (dataplane/affinity.py), then its next choices."""
        addresses = self._producer_addresses(frontend)
        if not addresses:
            return []
        cached = self._addresses[frontend]
        tags, weights = cached.tags, cached.weights
        if not tags:
            distinct = tuple(dict.fromkeys(addresses))
            tags = tuple(tag_of(f"{ip}:{port}") for ip, port in distinct)
            counts: dict[Address, int] = {}
            for a in addresses:
                counts[a] = counts.get(a, 0) + 1
            weights = tuple(float(counts[a]) for a in distinct)
            self._addresses[frontend] = cached._replace(
                distinct=distinct, tags=tags, weights=weights
            )
        distinct = self._addresses[frontend].distinct
        return [distinct[i] for i in rank(key, tags, weights)[:n]]

    def producer_for_client(self, frontend: str, client_ip: str) -> list[Address]:
        """:meth:`producer_upstreams` for one new L4 connection: with
        ``CLIENT_IP`` affinity the client's own endpoint first."""
        if self.affinity(frontend).mode == NO_AFFINITY:
            return self.producer_upstreams(frontend)
        return self.producer_affine(frontend, key_of(client_ip.encode()))

    def consumer_for_client(self, frontend: str, client_ip: str) -> list[Address]:
        """:meth:`consumer_upstreams` for one new L4 connection: with
        ``CLIENT_IP`` affinity the client's own region first."""
        if not self.affine(frontend):
            return self.consumer_upstreams(frontend)
        groups, _ = self.affine_groups(frontend, client_ip, ())
        return [address for group in groups for address in group]

    def rule_of_attachment(self, attachment: str) -> Target | None:
        """(producer forwarding-rule path, its address) of a service attachment."""
        found = published_rule(self.resources, attachment)
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
        if self.balance is Balance.LEAST_CONNECTIONS:
            active = self.active

            def key(i: int) -> tuple[int, int]:
                return (active.get(addresses[i], 0), (i - start) % count)

            best = _distinct([addresses[i] for i in heapq.nsmallest(n, range(count), key=key)], n)
            if len(best) < n < count:  # (a weighted rotation repeats addresses: look further)
                best = _distinct([addresses[i] for i in sorted(range(count), key=key)], n)
            return best
        end = start + n
        if end <= count:
            picked = addresses[start:end]
            if len(set(picked)) == len(picked):  # (no weights: always)
                return picked
        return _distinct(addresses[start:] + addresses[:start], n)

    def _rule(self, frontend: str) -> _ProducerRule:
        """A producer rule's backend service, port and slow start, per resources."""
        rule = self._rules.get(frontend)
        if rule is None or rule.resources is not self.resources:
            fr = self.resources.get(ResourcePath.parse(frontend))
            bs_path = fr.ref("backend_service") if isinstance(fr, ForwardingRule) else None
            port = fr.port_list()[0] if isinstance(fr, ForwardingRule) else 0
            bs = self.resources.get(bs_path) if bs_path is not None else None
            slow, least = 0.0, 0.1
            if isinstance(bs, BackendService):
                slow, least = bs.slow_start_sec, bs.slow_start_min_weight_percent / 100
            rule = self._rules[frontend] = _ProducerRule(self.resources, bs_path, port, slow, least)
        return rule

    def observe_health(self) -> None:
        """Health just changed: the producer rules served here with slow
        start note which endpoints joined their HEALTHY set now (so an
        endpoint's start is when it joined, not its first request after)."""
        for frontend in self.serving:
            rule = self._rule(frontend)
            if not rule.slow_start or rule.backend_service is None:
                continue
            healthy = self.engine.healthy_endpoints(rule.backend_service)
            if self._slow_start(frontend, rule, healthy):
                cached = self._addresses.get(frontend)
                if cached is not None and not cached.until:  # (rebuilt, growing, when next read)
                    del self._addresses[frontend]
                    self._plans.pop(frontend, None)

    def _producer_addresses(self, frontend: str) -> list[Address]:
        """The addresses of a producer rule's HEALTHY endpoints (of all of
        them when none is), in the engine's order."""
        rule = self._rule(frontend)
        bs_path = rule.backend_service
        if bs_path is None:
            return []
        healthy = self.engine.healthy_endpoints(bs_path)
        endpoints = healthy or self.engine.all_endpoints(bs_path)
        cached = self._addresses.get(frontend)
        if (
            cached is None
            or cached.endpoints is not endpoints
            or cached.rule is not rule
            or (cached.until and self.monotonic() >= cached.until)
        ):
            port = rule.port
            weights = endpoint_weights(self.resources, bs_path)
            growing = self._slow_start(frontend, rule, healthy) if rule.slow_start else {}
            until = 0.0
            if growing:
                step = min(1.0, rule.slow_start / 20)  # (the weights move in 5 % steps at most)
                until = self.monotonic() + step
            addresses = weighted(
                [
                    (
                        (ip, p if p is not None else port),
                        _grown(weights.get((ip, p), DEFAULT_WEIGHT), growing.get((ip, p))),
                    )
                    for ip, p in endpoints
                ]
            )
            cached = _ProducerAddresses(endpoints, rule, addresses, until=until)
            self._addresses[frontend] = cached
        return cached.addresses

    def _slow_start(
        self, frontend: str, rule: _ProducerRule, healthy: tuple[EndpointKey, ...]
    ) -> dict[EndpointKey, float]:
        """Slow start (SPEC §9, Envoy's with aggression 1): each endpoint
        that joined the HEALTHY set since the last look (turned HEALTHY, was
        added, returned from ejection) grows from ``slowStartMinWeightPercent``
        of its weight along ``t / slowStartSec``. The factor of each one
        still growing; the first look starts nobody (serve's start, a new rule)."""
        now = self.monotonic()
        now_set = set(healthy)
        since = self._since.setdefault(frontend, {})
        before = self._healthy_before.get(frontend)
        self._healthy_before[frontend] = now_set
        if before is not None:
            for key in now_set - before:
                since[key] = now
        out: dict[EndpointKey, float] = {}
        for key, t0 in list(since.items()):
            elapsed = now - t0
            if key not in now_set or elapsed >= rule.slow_start:
                del since[key]
            else:
                out[key] = max(rule.slow_start_min, elapsed / rule.slow_start)
        return out

    def all_rule_endpoints(self, rule: str) -> list[Address]:
        fr = self.resources.get(ResourcePath.parse(rule))
        if not isinstance(fr, ForwardingRule):
            return []
        bs_path = fr.ref("backend_service")
        port = fr.port_list()[0]
        endpoints = self.engine.all_endpoints(bs_path) if bs_path is not None else ()
        return [(ip, p if p is not None else port) for ip, p in endpoints]

    def route_used(self) -> None:
        """Observe, once per route-table version, how long after its
        publication a request was first routed by it."""
        table = self.engine.route_table()
        if table.version == self._seen_version:
            return
        self._seen_version = table.version
        delay = max(0.0, time.time() - table.published)
        self.propagation[bisect.bisect_left(PROPAGATION_BUCKETS, delay)] += 1
        self.propagation_sum += delay


DEFAULT_WEIGHT = 128
MOST_SLOTS = 4096  # a weighted rotation is at most this long (weights scaled down)


def _grown(weight: int, factor: float | None) -> int:
    """An endpoint's weight during its slow start (``factor`` None: none)."""
    if factor is None or weight <= 0:
        return weight
    return max(1, round(weight * factor))


def endpoint_weights(
    resources: Mapping[ResourcePath, Resource], backend_service: ResourcePath
) -> dict[tuple[str, int | None], int]:
    """(ip, port) -> weight of a backend service's endpoints and instances
    that have one (SPEC §6; the others weigh 128)."""
    bs = resources.get(backend_service)
    out: dict[tuple[str, int | None], int] = {}
    if not isinstance(bs, BackendService):
        return out
    for group in bs.refs("backends"):
        res = resources.get(group)
        if isinstance(res, NetworkEndpointGroup):
            for ep in res.endpoints:
                if ep.weight is not None:
                    out[(ep.ip_address, ep.port)] = ep.weight
        elif isinstance(res, InstanceGroup):
            for inst in res.instances:
                if inst.weight is not None:
                    out[(inst.ip_address, res.serving_port)] = inst.weight
    return out


def weighted(items: list[tuple[Address, int]]) -> list[Address]:
    """A rotation in which each address appears in proportion to its weight,
    spread out (smooth weighted round robin, as nginx's); weight 0 drains -
    the address is left out, so it gets no new connection. Equal weights:
    the addresses as they are."""
    live = [(a, w) for a, w in items if w > 0]
    if len({w for _, w in live}) <= 1:
        return [a for a, _ in live]
    divisor = 0
    for _, w in live:
        divisor = math.gcd(divisor, w)
    scaled = [(a, w // divisor) for a, w in live]
    total = sum(w for _, w in scaled)
    if total > MOST_SLOTS:
        scaled = [(a, max(1, w * MOST_SLOTS // total)) for a, w in scaled]
        total = sum(w for _, w in scaled)
    current = [0] * len(scaled)
    out = []
    for _ in range(total):
        for i, (_, w) in enumerate(scaled):
            current[i] += w
        best = max(range(len(scaled)), key=lambda i: current[i])
        current[best] -= total
        out.append(scaled[best][0])
    return out


def _client_key(
    aff: Affinity, client: str, client_ip: str, headers: Sequence[tuple[bytes, bytes]]
) -> int:
    """A client's key under one backend service's affinity: its cookie's id
    (``client``), its header's value, else its address (CLIENT_IP, or a
    request without the header or the cookie)."""
    if aff.mode == "GENERATED_COOKIE" and client:
        return key_of(client.encode())
    if aff.mode == "HEADER_FIELD" and (value := _header(headers, aff.header)):
        return key_of(value)
    return key_of(client_ip.encode())


def _header(headers: Sequence[tuple[bytes, bytes]], lower: bytes) -> bytes | None:
    """The first value of a header, by its lowercase name."""
    n = len(lower)
    for name, value in headers:
        if len(name) == n and name.lower() == lower:
            return value
    return None


def _distinct(addresses: list[Address], n: int) -> list[Address]:
    """The first ``n`` different addresses (a weighted rotation repeats them)."""
    out: list[Address] = []
    for a in addresses:
        if a not in out:
            out.append(a)
            if len(out) == n:
                break
    return out
