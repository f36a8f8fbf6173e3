"""What every hop of healthgate's own listeners counts: one named type per
listener (:class:`ListenerCounters`), never string keys parsed back out.

A listener counts its *events* (connections, requests, retries, refusals,
timeouts: what ``/metrics`` shows per listener) and, per upstream address it
sends to - a region's producer rule, or the endpoints of a rule this process
serves - an :class:`UpstreamCounters`: successes, errors, gateway errors,
errors by kind and the runs of consecutive errors (what an error is:
health/evidence.py). On a hop:

* **L7**: an answer below 500 is a success; an answer 500-599, a per-try
  timeout, or a connection refused or reset before an answer, an error
  (dataplane/http.py);
* **L4**: a connection that could not be made, or that the upstream reset
  before its first byte, an error; one that carried a byte from the
  upstream, or closed cleanly, a success (dataplane/tcp.py);
* **UDP**: a session's socket opened is a success, an ICMP error on it an
  error (dataplane/udp.py).

The C fast path counts a plain request's success itself
(``_speedups.Counters``, the twin of :class:`PyCounters`); every error takes
the Python path. Once a second :meth:`ListenerCounters.take` gives what each
upstream's hops came to since the last time (:class:`~healthgate.health.evidence.Hops`),
which the serving process hands to the outlier detector, the traffic
health sources and the ramps' error gate (controlplane/evidence.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from healthgate import http_scan
from healthgate.health.evidence import GATEWAY_STATUSES, Hops

Address = tuple[str, int]
RUN_KINDS = 10  # the kinds of a run of errors kept, for the reasons
# answered hops by latency: each bucket's upper bound, seconds (the last
# bucket is beyond 30 s); _speedups.c's lat_bounds
LATENCY_BOUNDS: tuple[float, ...] = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0,
)  # fmt: skip
LATENCY_BUCKETS = len(LATENCY_BOUNDS) + 1


class PyCounters:
    """One upstream's counts on one listener (``_speedups.Counters`` in C)."""

    __slots__ = (
        "errors",
        "gateway",
        "gateway_run",
        "kinds",
        "lat",
        "peak",
        "peak_gateway",
        "peak_kinds",
        "run",
        "run_kinds",
        "served",
        "trip",
        "trip_gateway",
    )

    def __init__(self) -> None:
        self.served = 0
        self.errors = 0
        self.gateway = 0
        self.run = 0  # consecutive errors now
        self.gateway_run = 0
        self.peak = 0  # the longest run since the last take (the run carried in counts)
        self.peak_gateway = 0
        # the outlier detector's thresholds for these runs (0: none): a run
        # that reaches one is told at once (Trips), not at the next second
        self.trip = 0
        self.trip_gateway = 0
        self.kinds: dict[str, int] = {}  # errors by kind, in all
        self.run_kinds: list[str] = []  # the kinds of the run now (its first RUN_KINDS)
        self.peak_kinds: list[str] = []  # ... of the longest run since the last take
        self.lat = [0] * LATENCY_BUCKETS  # answered hops per latency bucket, in all

    def add_latency(self, seconds: float) -> None:
        i = 0
        bounds = LATENCY_BOUNDS
        while i < len(bounds) and seconds > bounds[i]:
            i += 1
        self.lat[i] += 1


if http_scan.speedups is not None and hasattr(http_scan.speedups, "Counters"):
    UpstreamCounters: type[PyCounters] = http_scan.speedups.Counters
else:
    UpstreamCounters = PyCounters


def success(c: PyCounters) -> None:
    """A hop that went well (the C fast path does the same for a plain request)."""
    c.served += 1
    c.run = 0
    c.gateway_run = 0
    if c.run_kinds:
        c.run_kinds.clear()


def error(c: PyCounters, kind: str, gateway: bool) -> bool:
    """A hop that failed: its ``kind`` ("500", "timeout", "reset", ...);
    whether a run just reached its trip threshold."""
    c.errors += 1
    c.kinds[kind] = c.kinds.get(kind, 0) + 1
    c.run += 1
    if len(c.run_kinds) < RUN_KINDS:
        c.run_kinds.append(kind)
    if gateway:
        c.gateway += 1
        c.gateway_run += 1
    else:
        c.gateway_run = 0  # (a 500 ends a run of gateway errors, as in Envoy)
    if c.run > c.peak:
        c.peak = c.run
        c.peak_kinds = list(c.run_kinds)
    c.peak_gateway = max(c.peak_gateway, c.gateway_run)
    return (c.trip > 0 and c.run == c.trip) or (
        c.trip_gateway > 0 and c.gateway_run == c.trip_gateway
    )


class Trips:
    """The outlier detector's thresholds per upstream address, of one data
    plane (``consecutiveErrors``, ``consecutiveGatewayErrors`` of the
    backend services that eject: dataplane/manager.py keeps them), and
    what to call when a run reaches one - the evidence is then taken at
    once, so an endpoint is ejected after its threshold, not a second's
    worth of errors later."""

    __slots__ = ("by_address", "hook")

    def __init__(self) -> None:
        self.by_address: dict[Address, tuple[int, int]] = {}
        self.hook: Callable[[], None] | None = None

    def tripped(self) -> None:
        if self.hook is not None:
            self.hook()


class ListenerCounters:
    """One listener's counters: its events, and per upstream address an
    :class:`UpstreamCounters` (see the module doc)."""

    __slots__ = ("_last", "events", "trips", "upstreams")

    def __init__(self, events: dict[str, int] | None = None, trips: Trips | None = None) -> None:
        self.trips = trips
        # connections, requests, retries, refusals... (given: a caller's own dict)
        self.events: dict[str, int] = {} if events is None else events
        self.upstreams: dict[Address, PyCounters] = {}
        # per upstream: (served, errors, gateway, errors by kind, latencies) at the last take
        self._last: dict[Address, tuple[int, int, int, dict[str, int], tuple[int, ...]]] = {}

    def of(self, address: Address) -> PyCounters:
        c = self.upstreams.get(address)
        if c is None:
            c = self.upstreams[address] = UpstreamCounters()
            if self.trips is not None:
                c.trip, c.trip_gateway = self.trips.by_address.get(address, (0, 0))
        return c

    def error(self, address: Address, kind: str, gateway: bool) -> None:
        """A hop to ``address`` failed (see the module doc)."""
        if error(self.of(address), kind, gateway) and self.trips is not None:
            self.trips.tripped()

    def latency(self, address: Address, seconds: float) -> None:
        """An answer came from ``address`` this long after its request (the
        head's arrival, or the whole answer's when it came in one read)."""
        self.of(address).add_latency(seconds)

    def answered(self, address: Address, status: int) -> None:
        """An HTTP answer from ``address``: below 500 a success, else an error."""
        if status >= 500:
            self.error(address, str(status), status in GATEWAY_STATUSES)
        else:
            success(self.of(address))

    def set_trips(self) -> None:
        """The thresholds changed: every counter takes its own again."""
        by_address = self.trips.by_address if self.trips is not None else {}
        for address, c in self.upstreams.items():
            c.trip, c.trip_gateway = by_address.get(address, (0, 0))

    def event(self, name: str, n: int = 1) -> None:
        self.events[name] = self.events.get(name, 0) + n

    def take(self) -> dict[Address, Hops]:
        """What each upstream's hops came to since the last take (upstreams
        without a hop since are left out); the runs' peaks start again from
        the runs as they are now."""
        out: dict[Address, Hops] = {}
        last = self._last
        for address, c in self.upstreams.items():
            before = last.get(address)
            served, errors = c.served, c.errors
            if before is not None and before[0] == served and before[1] == errors:
                continue
            b_served, b_errors, b_gateway, b_kinds, b_lat = before or (0, 0, 0, {}, ())
            kinds = {}
            if errors != b_errors:
                kinds = {k: n - b_kinds.get(k, 0) for k, n in c.kinds.items()}
                kinds = {k: n for k, n in kinds.items() if n > 0}
            lat = tuple(c.lat)
            out[address] = Hops(
                served - b_served,
                errors - b_errors,
                c.gateway - b_gateway,
                kinds,
                c.peak,
                c.peak_gateway,
                tuple(c.peak_kinds),
                tuple(n - b for n, b in zip(lat, b_lat, strict=True)) if b_lat else lat,
            )
            last[address] = (served, errors, c.gateway, dict(c.kinds) if kinds else b_kinds, lat)
            c.peak = c.run
            c.peak_gateway = c.gateway_run
            c.peak_kinds = list(c.run_kinds)
        return out

    def reset_runs(self, address: Address) -> None:
        """An upstream was ejected (health/outliers.py): its runs start
        again from nothing (so that its return is judged afresh, as in Envoy)."""
        c = self.upstreams.get(address)
        if c is not None:
            c.run = c.gateway_run = c.peak = c.peak_gateway = 0
            c.run_kinds.clear()
            c.peak_kinds = []

    def served(self) -> Iterator[tuple[Address, int, int]]:
        """(upstream, successes, errors) in all (for /metrics)."""
        for address, c in self.upstreams.items():
            yield address, c.served, c.errors

    def errors_by_kind(self) -> Iterator[tuple[Address, str, int]]:
        for address, c in self.upstreams.items():
            for kind, n in c.kinds.items():
                yield address, kind, n
