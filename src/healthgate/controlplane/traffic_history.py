"""What each consumer front end carried, second by second, region by
region, over the last 15 minutes - for the dashboard's charts.

Each second the evidence sampler hands over every listener's hops
(controlplane/evidence.py); a front end's hops are summed by the region
each upstream address belongs to (its producer rule, or that rule's
endpoints when this data plane serves the rule itself), giving per region
and second: hops, errors, and the p50 and p99 of the answered hops'
latency (dataplane/counters.py's buckets: each figure is its bucket's
upper bound). They go into a ring of ``WINDOW`` seconds per front end and
region, allocated when the front end first carries traffic: 16 bytes a
second, 14.4 KiB per region of a front end (a front end that carries
nothing costs nothing). So a page opened mid-incident shows what came
before, and a reload loses nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence

from healthgate.dataplane.counters import LATENCY_BOUNDS
from healthgate.health.engine import HealthEngine
from healthgate.health.evidence import Address, Hops
from healthgate.model.lookups import published_rule

WINDOW = 900  # seconds kept


def quantile(buckets: Sequence[int], q: float) -> float | None:
    """The upper bound (seconds) of the bucket holding the ``q`` quantile
    (None: no answered hop; the last bucket: beyond 30 s, said as 60)."""
    total = sum(buckets)
    if not total:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(buckets):
        seen += n
        if seen >= rank:
            return LATENCY_BOUNDS[i] if i < len(LATENCY_BOUNDS) else 60.0
    return 60.0


class RegionRing:
    """One region's seconds of one front end: hops, errors, p50 and p99 (ms)."""

    __slots__ = ("errors", "p50", "p99", "requests")

    def __init__(self) -> None:
        self.requests = array("I", bytes(4 * WINDOW))
        self.errors = array("I", bytes(4 * WINDOW))
        self.p50 = array("f", bytes(4 * WINDOW))
        self.p99 = array("f", bytes(4 * WINDOW))

    def put(self, i: int, requests: int, errors: int, p50: float, p99: float) -> None:
        self.requests[i], self.errors[i], self.p50[i], self.p99[i] = requests, errors, p50, p99

    def clear(self, i: int) -> None:
        self.requests[i] = self.errors[i] = 0
        self.p50[i] = self.p99[i] = 0.0


class FrontEndRing:
    __slots__ = ("first", "last", "regions")

    def __init__(self, second: int) -> None:
        self.regions: dict[str, RegionRing] = {}
        self.first = second  # the oldest second kept
        self.last = second - 1  # the newest written

    def advance(self, second: int) -> None:
        """Seconds between the last written and ``second`` (excluded) were quiet."""
        for s in range(max(self.last + 1, second - WINDOW), second):
            for ring in self.regions.values():
                ring.clear(s % WINDOW)
        self.last = max(self.last, second)
        self.first = max(self.first, second - WINDOW + 1)

    def seconds(self, since: int) -> range:
        return range(max(self.first, since), self.last + 1)


class TrafficHistory:
    def __init__(self, engine: HealthEngine) -> None:
        self.engine = engine
        self.rings: dict[str, FrontEndRing] = {}
        self._regions: dict[str, dict[Address, str]] = {}  # front end -> address -> region
        self._generation = -1

    def region_of(self, frontend: str) -> dict[Address, str]:
        """Where each upstream address of a front end belongs (rebuilt when
        the engine's routes or endpoints may have changed)."""
        engine = self.engine
        if engine.generation != self._generation:
            self._regions.clear()
            self._generation = engine.generation
        found = self._regions.get(frontend)
        if found is None:
            found = self._regions[frontend] = {}
            for candidate, attachment in engine.failover_order(frontend):
                for address in upstreams(engine, attachment):
                    found[address] = candidate.region
        return found

    def observe(self, now: float, hops: Mapping[str, Mapping[Address, Hops]]) -> None:
        """One second of every listener's hops (controlplane/evidence.py)."""
        second = int(now)
        routes = self.engine.route_table().routes
        for frontend, per_address in hops.items():
            if frontend not in routes:
                continue  # (a producer rule's listener)
            regions = self.region_of(frontend)
            by_region: dict[str, list[Hops]] = {}
            for address, h in per_address.items():
                by_region.setdefault(regions.get(address, "other"), []).append(h)
            ring = self.rings.get(frontend)
            if ring is None:
                ring = self.rings[frontend] = FrontEndRing(second)
            # (a second sampled twice - early, for an outlier's trip - adds up)
            again = second <= ring.last
            this = max(second, ring.last)
            if not again:
                ring.advance(this)
            i = this % WINDOW
            for region, parts in by_region.items():
                r = ring.regions.get(region)
                if r is None:
                    r = ring.regions[region] = RegionRing()
                    for s in ring.seconds(ring.first):  # (quiet before: zeros)
                        r.clear(s % WINDOW)
                lat = _summed(h.latency for h in parts)
                p50, p99 = quantile(lat, 0.5), quantile(lat, 0.99)
                r.put(
                    i,
                    sum(h.total for h in parts) + (r.requests[i] if again else 0),
                    sum(h.errors for h in parts) + (r.errors[i] if again else 0),
                    max(1000 * p50 if p50 is not None else 0.0, r.p50[i] if again else 0.0),
                    max(1000 * p99 if p99 is not None else 0.0, r.p99[i] if again else 0.0),
                )
            if not again:
                for region, r in ring.regions.items():
                    if region not in by_region:
                        r.clear(i)

    def forget(self, frontends: Iterable[str]) -> None:
        for f in frontends:
            self.rings.pop(f, None)

    def series(self, frontend: str, since: int, now: int) -> dict[str, object]:
        """The seconds from ``since`` to ``now`` as arrays per region (a
        second the front end carried nothing is 0)."""
        start = max(since, now - WINDOW + 1)
        ring = self.rings.get(frontend)
        out: dict[str, dict[str, list[float]]] = {}
        if ring is not None:
            kept = [
                s % WINDOW if ring.first <= s <= ring.last else -1 for s in range(start, now + 1)
            ]
            for region, r in sorted(ring.regions.items()):
                out[region] = {
                    "requests": [r.requests[i] if i >= 0 else 0 for i in kept],
                    "errors": [r.errors[i] if i >= 0 else 0 for i in kept],
                    "p50Ms": [round(r.p50[i], 3) if i >= 0 else 0.0 for i in kept],
                    "p99Ms": [round(r.p99[i], 3) if i >= 0 else 0.0 for i in kept],
                }
        return {"start": start, "step": 1, "regions": out}

    def latest(self, frontend: str) -> int | None:
        ring = self.rings.get(frontend)
        return ring.last if ring is not None else None

    def nbytes(self) -> int:
        """Bytes of the rings' arrays (the ring's bounded memory)."""
        return sum(16 * WINDOW for ring in self.rings.values() for _ in ring.regions)


def _summed(latencies: Iterable[tuple[int, ...]]) -> list[int]:
    out: list[int] = []
    for lat in latencies:
        if not lat:
            continue
        if not out:
            out = list(lat)
        else:
            for i, n in enumerate(lat):
                out[i] += n
    return out


def upstreams(engine: HealthEngine, attachment: str) -> set[Address]:
    """Where a front end's traffic to a service attachment goes: its
    producer rule's address, and - when this data plane serves that rule
    itself - the rule's endpoints."""
    found = published_rule(engine.resources, attachment)
    if found is None:
        return set()
    fr = found[1]
    port = fr.port_list()[0]
    out = {(fr.ip_address, port)}
    bs = fr.ref("backend_service")
    if bs is not None:
        out |= {(ip, p or port) for ip, p in engine.all_endpoints(bs)}
    return out
