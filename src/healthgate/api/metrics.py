"""Prometheus metrics, read from the engine at scrape time.

Nothing is counted on the probe path except a probe-duration histogram (an
array increment). Label sets are bounded: outcomes are a fixed set, states
and transition kinds too, and per-endpoint series stop at
``MAX_ENDPOINT_SERIES`` (the per-backend-service counts are always complete).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.registry import Collector

from healthgate.controlplane.health_service import HealthService
from healthgate.controlplane.recorder import TransitionRecorder
from healthgate.controlplane.webhooks import WebhookDispatcher
from healthgate.health.states import Outcome, RecordKind
from healthgate.probes.stats import LAG_BUCKETS, PROBE_BUCKETS

MAX_ENDPOINT_SERIES = 10_000
STATES = ("UNKNOWN", "HEALTHY", "UNHEALTHY", "DEGRADED")


class EngineCollector(Collector):
    def __init__(self, health: HealthService, recorder: TransitionRecorder) -> None:
        self.health = health
        self.recorder = recorder

    def collect(self) -> Iterator[Metric]:
        engine = self.health.engine
        stats = self.health.totals()  # this process's probing and its workers' together
        hist = HistogramMetricFamily(
            "healthgate_probe_duration_seconds",
            "Probe duration, connect to verdict, by outcome",
            labels=["outcome"],
        )
        for outcome in Outcome:
            buckets = stats.buckets.get(outcome)
            if buckets is None:
                continue
            cumulative, acc = [], 0
            for bound, n in zip((*PROBE_BUCKETS, float("inf")), buckets, strict=True):
                acc += n
                cumulative.append(("+Inf" if bound == float("inf") else repr(bound), acc))
            hist.add_metric([outcome.name], cumulative, stats.sums[outcome])
        yield hist

        bs_gauge = GaugeMetricFamily(
            "healthgate_backend_service_endpoints",
            "Endpoints of a backend service by state",
            labels=["backend_service", "state"],
        )
        for path in engine.backend_services():
            counts = engine.counts(path)
            if counts is None:
                continue
            name = str(path)
            bs_gauge.add_metric([name, "HEALTHY"], counts.healthy)
            bs_gauge.add_metric([name, "UNKNOWN"], counts.unknown)
            bs_gauge.add_metric([name, "UNHEALTHY"], counts.unhealthy)
            bs_gauge.add_metric([name, "DEGRADED"], counts.degraded)
        yield bs_gauge
        yield from self._passive()

        state_gauge = GaugeMetricFamily(
            "healthgate_health_state",
            "State of sources, composites and PSC NEGs: 1 for the state it is in, 0 for the others",
            labels=["kind", "path", "state"],
        )
        for kind, node in engine.node_states():
            for state in STATES:
                state_gauge.add_metric(
                    [kind, node.path, state], 1 if node.state.name == state else 0
                )
        yield state_gauge

        yield from self._routes()

        transitions = CounterMetricFamily(
            "healthgate_transitions",
            "State transitions logged, by kind and new state",
            labels=["kind", "to"],
        )
        route_changes = CounterMetricFamily(
            "healthgate_route_changes",
            "Consumer route changes, by the route's new mode (normal, fail-open, fail-closed)",
            labels=["mode"],
        )
        for (kind, to), n in sorted(self.recorder.counts.items()):
            if kind == RecordKind.ROUTE:
                route_changes.add_metric([to], n)
            else:
                transitions.add_metric([kind, to], n)
        yield transitions
        yield route_changes

        yield CounterMetricFamily(
            "healthgate_probes_started", "Probes started", value=stats.started
        )
        yield CounterMetricFamily(
            "healthgate_probes_late",
            "Probes started more than 10 ms after their due time",
            value=stats.late,
        )
        yield CounterMetricFamily(
            "healthgate_probes_skipped",
            "Probes that could not start for want of a file descriptor (no result: starvation)",
            value=stats.skipped,
        )
        yield CounterMetricFamily(
            "healthgate_probes_suspect",
            "Probe timeouts discarded because the prober lagged",
            value=stats.suspect,
        )
        yield GaugeMetricFamily(
            "healthgate_probes_in_flight", "Probes running now", value=stats.in_flight
        )
        tls = CounterMetricFamily(
            "healthgate_probe_tls_handshakes",
            "TLS handshakes of HTTPS checks, by whether a session was resumed",
            labels=["resumed"],
        )
        tls.add_metric(["true"], stats.tls_resumed)
        tls.add_metric(["false"], stats.tls_handshakes - stats.tls_resumed)
        yield tls
        yield CounterMetricFamily(
            "healthgate_prober_deferred_ticks",
            "Scheduler ticks that left due probes or results for the next tick (prober overloaded)",
            value=stats.deferred_ticks,
        )
        lag = HistogramMetricFamily(
            "healthgate_prober_lag_seconds",
            "How late each prober tick ran (event-loop lag)",
        )
        acc, cumulative = 0, []
        for bound, n in zip((*LAG_BUCKETS, float("inf")), stats.lag_buckets, strict=True):
            acc += n
            cumulative.append(("+Inf" if bound == float("inf") else repr(bound), acc))
        lag.add_metric([], cumulative, stats.lag_sum)
        yield lag

    def _passive(self) -> Iterator[Metric]:
        """Real traffic as evidence (SPEC §8): ejections and storm holds now."""
        engine = self.health.engine
        ejected = GaugeMetricFamily(
            "healthgate_endpoints_ejected",
            "Endpoints of a backend service ejected from real traffic now (SPEC 8)",
            labels=["backend_service"],
        )
        for path in engine.backend_services():
            n = len(engine.ejected(path))
            if n:
                ejected.add_metric([str(path)], n)
        yield ejected
        held = GaugeMetricFamily(
            "healthgate_storm_hold",
            "1 while a failover storm hold keeps routes where they were (SPEC 8)",
            labels=["hold", "regions"],
        )
        for hold in engine.holds():
            held.add_metric([hold.hold_id, ",".join(hold.regions)], 1)
        yield held

    def _routes(self) -> Iterator[Metric]:
        engine = self.health.engine
        routes = GaugeMetricFamily(
            "healthgate_route_info",
            "Where each consumer front end sends new traffic (1 per front end)",
            labels=["frontend", "target", "mode"],
        )
        failed_over = GaugeMetricFamily(
            "healthgate_route_failed_over",
            "1 while a consumer front end sends new traffic anywhere but its first NEG in "
            "failover order (failed over, or refusing), else 0",
            labels=["frontend"],
        )
        for route in engine.route_table().routes.values():
            routes.add_metric([route.frontend, route.target or "", route.mode], 1)
            order = engine.failover_order(route.frontend)
            first = order[0][0].path if order else None
            failed_over.add_metric([route.frontend], 0 if route.target == first else 1)
        yield routes
        yield failed_over


def endpoint_series(health: HealthService) -> str:
    """``healthgate_endpoint_probe_success``, one series per probed endpoint
    (at most MAX_ENDPOINT_SERIES), written as text directly: through metric
    objects, 10,000 endpoints took 300-600 ms of the event loop per scrape -
    time the prober did not have. Label values are resource paths and IP
    addresses, which need no escaping."""
    return "".join(endpoint_series_parts(health))


def endpoint_series_parts(health: HealthService, per_part: int = 1000) -> Iterator[str]:
    """:func:`endpoint_series` in parts of ``per_part`` endpoints, for a
    response that gives the event loop back between them: the whole text for
    10,000 endpoints (1.3 MB) takes 12-15 ms to build, and the prober's ticks
    are 2 ms apart at that size."""
    engine = health.engine
    yield (
        "# HELP healthgate_endpoint_probe_success 1 if the endpoint's last probe succeeded, else 0\n"
        "# TYPE healthgate_endpoint_probe_success gauge\n"
    )
    left = MAX_ENDPOINT_SERIES
    for path in list(engine.backend_services()):
        if left <= 0:
            break
        prefix = f'healthgate_endpoint_probe_success{{backend_service="{path}",endpoint="'
        pairs = engine.last_probe_ok(path)[:left]
        left -= len(pairs)
        for start in range(0, len(pairs), per_part):
            lines = []
            for (ip, port), ok in pairs[start : start + per_part]:
                lines.append(f"{prefix}{ip}:{port}" if port else f"{prefix}{ip}")
                lines.append('"} 1.0\n' if ok else '"} 0.0\n')
            yield "".join(lines)


OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


def render_metrics(
    health: HealthService,
    recorder: TransitionRecorder,
    collectors: Sequence[Collector] = (),
    openmetrics: bool = False,
) -> str:
    """Every series but the per-endpoint ones (:func:`endpoint_series_parts`),
    in Prometheus text or (``openmetrics``) OpenMetrics without its closing
    ``# EOF``, which the caller writes after the per-endpoint series."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(health, recorder))
    for collector in collectors:
        registry.register(collector)
    if openmetrics:
        text: bytes = openmetrics_latest(registry)  # type: ignore[no-untyped-call]
        return text.decode().removesuffix("# EOF\n")
    return generate_latest(registry).decode()


class ClusterCollector(Collector):
    """Cluster mode: this node's view of the cluster (what the shipped alerts
    watch: a node missing, a node cut off from etcd, records not written)."""

    def __init__(self, status: Callable[[], dict[str, object]]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        s = self.status()
        members = s.get("members")
        yield GaugeMetricFamily(
            "healthgate_cluster_members",
            "Live nodes of the cluster as this node sees them",
            value=len(members) if isinstance(members, dict) else 0,
        )
        yield GaugeMetricFamily(
            "healthgate_cluster_member",
            "1 while this node is a member (its etcd session alive), 0 while cut off from etcd",
            value=1 if s.get("member") else 0,
        )
        yield GaugeMetricFamily(
            "healthgate_cluster_leader",
            "1 while this node is the elected writer of the log",
            value=1 if s.get("leading") else 0,
        )
        unwritten = s.get("unwrittenRecords")
        yield GaugeMetricFamily(
            "healthgate_cluster_unwritten_records",
            "Transitions this node decided in the last minute that the log does not hold yet",
            value=unwritten if isinstance(unwritten, int) else 0,
        )
        swept = s.get("opinionsSwept")
        yield CounterMetricFamily(
            "healthgate_cluster_opinions_swept",
            "Opinions of endpoints gone from the world, or of vantages they no longer have,"
            " that this node deleted as the leader",
            value=swept if isinstance(swept, int) else 0,
        )
        states_swept = s.get("statesSwept")
        yield CounterMetricFamily(
            "healthgate_cluster_states_swept",
            "Saved states of resources that left the world while no node led, that this node"
            " deleted as the leader",
            value=states_swept if isinstance(states_swept, int) else 0,
        )
        breaks, stuck = s.get("etcdWatchBreaks"), s.get("etcdWatchesStuck")
        yield CounterMetricFamily(
            "healthgate_etcd_watch_breaks",
            "etcd watches of this node that broke and were resumed",
            value=breaks if isinstance(breaks, int) else 0,
        )
        yield GaugeMetricFamily(
            "healthgate_etcd_watches_stuck",
            "etcd watches of this node broken 5 times or more in a row at one revision: "
            "it sees no change past that revision there",
            value=stuck if isinstance(stuck, int) else 0,
        )


class WebhookCollector(Collector):
    """Per webhook: how far behind its deliveries are (the shipped alert
    "webhook deliveries behind" watches the oldest undelivered record)."""

    def __init__(self, dispatcher: WebhookDispatcher) -> None:
        self.dispatcher = dispatcher

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        behind = GaugeMetricFamily(
            "healthgate_webhook_behind_records",
            "Records a webhook wants that are not acknowledged yet (at most 1000 counted)",
            labels=["webhook"],
        )
        oldest = GaugeMetricFamily(
            "healthgate_webhook_oldest_undelivered_seconds",
            "Age of the oldest record a webhook has not had acknowledged (0: none)",
            labels=["webhook"],
        )
        dropped = CounterMetricFamily(
            "healthgate_webhook_dropped_records",
            "Records given up after 24 hours of failed deliveries",
            labels=["webhook"],
        )
        for path, status in sorted(self.dispatcher.statuses().items()):
            behind.add_metric([path], status.behind)
            oldest.add_metric([path], max(0.0, now - status.oldest) if status.oldest else 0.0)
            dropped.add_metric([path], status.dropped)
        yield behind
        yield oldest
        yield dropped
