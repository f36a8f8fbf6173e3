"""Convergence receipts carried in (SPEC §11): every data plane's word that
it applied a route decision goes to the tracker (health/convergence.py),
which says who has and who has not; this module wires them and acts.

* **decisions**: each Route record of the engine (its generation, its time,
  the front end's NEGs);
* **healthgate's listeners**: in this process, the data plane itself says
  which generations it routes by (at once: it reads the route table per
  connection); each data-plane worker, when it has taken the health
  snapshot holding the decision (dataplane/workers.py's ``Applied``);
* **Envoy**: the ACK (no error) of an EDS version - the versions
  serve pushed are remembered with the generations they carried
  (:meth:`ConvergenceMonitor.xds_version`), the last 256;
* **HAProxy**: the agent's answers, by the asking HAProxy's address (or
  the name its ``agent-send`` adds after the NEG, ``PROJECT/REGION/NAME
  INSTANCE``);
* **DNS**: the first answer for the front end's ``dnsName`` after it.

Once a second the tracker's LAGGING and CAUGHT_UP records are written -
by this node itself in a cluster (they are its data planes'), with the
others' records otherwise; ``healthgate_convergence_seconds{data_plane}``
and ``healthgate_convergence_lagging{data_plane}`` are its metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from healthgate.controlplane.health_service import HealthListener, HealthService
from healthgate.health.convergence import BUCKETS, ConvergenceTracker, Decision
from healthgate.health.states import Record, RouteChange
from healthgate.model.names import ResourcePath
from healthgate.model.resources import BackendService, ForwardingRule

log = logging.getLogger("healthgate.convergence")

XDS_VERSIONS = 256  # xDS versions remembered with their generations


def _short(path: str | None) -> str:
    return path.rsplit("/", 1)[-1] if path else "(refuse)"


class ConvergenceMonitor(HealthListener, Collector):
    def __init__(
        self,
        health: HealthService,
        write: Callable[[list[Record]], None],
        alert_after: float = 30.0,
        node: str = "",
    ) -> None:
        self.health = health
        self.write = write  # (the records: with the others', or by this node in a cluster)
        self.tracker = ConvergenceTracker(alert_after=alert_after, node=node)
        self.own = node or "serve"  # this process's listeners' instance name
        self._xds: OrderedDict[int, dict[str, int]] = OrderedDict()
        self._task: asyncio.Task[None] | None = None
        health.listen(self)

    # ------------------------------------------------------------------ decisions

    def records(self, records: list[Record]) -> None:
        for r in records:
            if isinstance(r, RouteChange) and r.generation:
                negs = frozenset(c.path for c, _ in self.health.engine.failover_order(r.frontend))
                summary = f"{_short(r.previous)} -> {_short(r.current)}"
                if r.shares:
                    summary += " (" + ", ".join(f"{p:g}% {reg}" for _, reg, p in r.shares) + ")"
                self.tracker.decided(
                    Decision(r.frontend, r.project, r.generation, r.time, negs, summary)
                )

    # ------------------------------------------------------------------ receipts

    def holds(self, instance: str, generations: Mapping[str, int]) -> None:
        """healthgate's listeners (this process's, or a worker's) route by these."""
        name = self.own if instance == "" else f"{self.own}/{instance}"
        self.tracker.holds("healthgate", name, generations, self.health.clock())

    def xds_version(self, version: int) -> None:
        """serve pushed xDS ``version``: the generations it carries."""
        routes = self.health.engine.route_table().routes
        self._xds[version] = {f: r.generation for f, r in routes.items()}
        while len(self._xds) > XDS_VERSIONS:
            self._xds.popitem(last=False)

    def xds_ack(
        self,
        instance: str,
        version: int,
        clusters: tuple[str, ...],
        projects: frozenset[str] | None,
    ) -> None:
        """An Envoy ACKed an EDS ``version`` for these clusters (() - all)."""
        generations = self._xds.get(version)
        if generations is None:
            return
        resources = self.health.engine.resources
        held = {}
        for frontend, generation in generations.items():
            path = ResourcePath.parse(frontend)
            if projects is not None and path.project not in projects:
                continue
            fr = resources.get(path)
            bs = fr.ref("backend_service") if isinstance(fr, ForwardingRule) else None
            if bs is None or not isinstance(resources.get(bs), BackendService):
                continue
            if clusters and f"{bs.project}/{bs.name}" not in clusters:
                continue
            held[frontend] = generation
        self.tracker.holds("envoy", instance, held, self.health.clock())

    def agent_answered(self, instance: str, neg: str) -> None:
        self.tracker.answered(instance, neg, self.health.clock())

    def dns_served(self, frontend: str) -> None:
        self.tracker.served("dns", self.own, frontend, self.health.clock())

    # ------------------------------------------------------------------ reading

    def status(self, frontend: str) -> dict[str, object] | None:
        return self.tracker.status(frontend, self.health.clock())

    # ------------------------------------------------------------------ the loop

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="convergence")

    async def _run(self, period: float = 1.0) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                records = self.tracker.check(self.health.clock())
                if records:
                    for r in records:
                        log.warning("%s: %s", r.frontend, r.reason)
                    self.write(list(records))
            except Exception:
                log.exception("convergence: the check failed; trying again in %g s", period)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def collect(self) -> Iterator[Metric]:
        hist = HistogramMetricFamily(
            "healthgate_convergence_seconds",
            "From a route decision to a data plane having applied it (SPEC §11)",
            labels=["data_plane"],
        )
        for data_plane, h in sorted(self.tracker.histograms.items()):
            cumulative, buckets = 0, []
            for bound, n in zip((*BUCKETS, float("inf")), h.counts, strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            hist.add_metric([data_plane], buckets, h.total)
        yield hist
        gauge = GaugeMetricFamily(
            "healthgate_convergence_lagging",
            "Data-plane instances that have not applied a route decision within "
            "--convergence-alert-sec",
            labels=["data_plane"],
        )
        for data_plane, n in sorted(self.tracker.lagging_now().items()):
            gauge.add_metric([data_plane], n)
        yield gauge
