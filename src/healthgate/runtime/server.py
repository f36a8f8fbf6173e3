"""``healthgate serve``: store, engine, probes, API (and data plane) in one process.

Start-up order matters:

* the API's address is taken first (api/listener.py), then the agent, DNS
  and xDS servers' - before any listener a tenant's forwarding rule asks
  for, so that no rule can take serve's own addresses and keep the next
  start from answering;
* for fail static, the store is read and the engine rebuilt from it *and
  resumed from the last known states* before any probe runs or any listener
  opens, so a restart neither fails traffic over nor fails it back to a
  region that was down;
* manifests given with ``-f`` are then applied like ``healthgate apply``,
  probing starts, and the API answers.

The stop (runtime/lifecycle.py runs it, each step bounded) stops accepting,
gives open connections their grace, stops probing and the workers, leaves
the cluster, flushes the transition log and closes the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from healthgate.api.app import ApiSettings, ApiState, create_app
from healthgate.api.auth import Access, is_loopback
from healthgate.api.listener import ApiListener
from healthgate.api.metrics import ClusterCollector, WebhookCollector
from healthgate.cluster.affinity_key import shared_affinity_keys
from healthgate.cluster.node import ClusterNode
from healthgate.cluster.probing import ClusterProbing, ClusterSettings
from healthgate.controlplane.convergence import ConvergenceMonitor
from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.controlplane.evidence import EvidenceSampler
from healthgate.controlplane.health_service import HealthListener, HealthService, SourceFactory
from healthgate.controlplane.metric_sources import MetricSources
from healthgate.controlplane.practice import PracticeRunner
from healthgate.controlplane.probe_workers import WorkerProbing, default_workers
from healthgate.controlplane.probing import Feed, InProcessProbing, ProbeSource
from healthgate.controlplane.recorder import TransitionRecorder
from healthgate.controlplane.resources import ControlPlane
from healthgate.controlplane.traffic_history import TrafficHistory
from healthgate.controlplane.webhooks import WebhookDispatcher, WebhookSettings
from healthgate.dataplane.affinity import load_keys
from healthgate.dataplane.manager import (
    DataPlane,
    DataPlaneCollector,
    DataPlaneService,
    DataPlaneSettings,
)
from healthgate.dataplane.workers import WorkerPool
from healthgate.health.states import Record, RecordKind, RouteChange
from healthgate.health.storms import StormSettings
from healthgate.integrations.agent import AgentServer
from healthgate.integrations.dns import DnsDirectory, DnsServer, parse_zone
from healthgate.integrations.verdicts import agent_answer
from healthgate.model.addresses import Reserved
from healthgate.model.change import WorldChange
from healthgate.model.manifest import parse_manifest
from healthgate.model.resources import HealthCheck, Resource
from healthgate.model.validation import InvalidResources
from healthgate.probes.prober import ProbeSettings
from healthgate.probes.scheduler import SchedulerSettings
from healthgate.probes.stats import FailureLogLimiter
from healthgate.process.limits import raise_open_file_limit
from healthgate.runtime.lifecycle import Stopper, StopStep, run_steps
from healthgate.runtime.systemd import Notifier, install_debug_block
from healthgate.store.base import Guard, Store
from healthgate.store.etcd import EtcdStore
from healthgate.store.etcd_client import EtcdAuth, EtcdSettings, EtcdTls, parse_endpoints
from healthgate.store.sqlite import SqliteStore

if TYPE_CHECKING:
    from healthgate.integrations.xds import XdsServer, XdsSnapshots, XdsTls

log = logging.getLogger("healthgate.serve")


@dataclass(slots=True)
class ServeSettings:
    db: str = "./healthgate.db"
    listen: str = "127.0.0.1:7400"
    manifests: list[str] = field(default_factory=list)
    tokens_file: str | None = None
    log_retention: int = 100_000
    failure_log_rate: float = 1.0  # probe-failure log lines per second (0: none)
    # How long a thread holding the GIL may keep it while another waits (the
    # interpreter's default is 5 ms). Planning a large manifest runs in a
    # thread; every wake-up of the event loop (a probe tick, a request) then
    # waits up to this long for the GIL. 1 ms keeps front-end requests and
    # probe starts on time during a 5 MB apply (bench/apply_stall.py).
    switch_interval: float = 0.001
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    api: ApiSettings = field(default_factory=ApiSettings)
    dataplane: DataPlaneSettings = field(default_factory=DataPlaneSettings)
    agent: str | None = None  # HOST:PORT for HAProxy's agent-check
    public_healthz: bool = False
    dns: str | None = None  # HOST:PORT of the authoritative DNS server for rules' dnsName
    dns_zones: list[str] = field(default_factory=list)  # default: each dnsName's parent
    xds: str | None = None  # HOST:PORT of the Envoy ADS server (CDS, EDS)
    xds_tls: XdsTls | None = None  # (and its clients' certificates: names -> projects)
    xds_clients: dict[str, frozenset[str]] = field(default_factory=dict)
    # the agent, DNS and xDS servers bind beyond loopback without TLS only when told so
    insecure_bind: bool = False
    # cluster mode (SPEC §4): etcd://HOST:PORT[,...] (None: the SQLite store at db)
    store: str | None = None
    node: str | None = None
    region: str | None = None
    lease_ttl: int = 5
    opinion_sweep: float = 300.0  # seconds between the leader's looks for stale opinions
    # where the other nodes reach this node's API (default: http://--listen)
    advertise_url: str | None = None
    etcd_tls: EtcdTls | None = None  # TLS to etcd's members (SPEC §7)
    etcd_auth: EtcdAuth | None = None  # an etcd user (its role limited to the namespace)
    # probe in N worker processes (0: in the serving process; None: one per
    # core embedded, on more than one core - controlplane/probe_workers.py)
    probe_workers: int | None = None
    # on stop: seconds open front-end connections get to finish before they are closed
    stop_grace: float = 2.0
    webhooks: WebhookSettings = field(default_factory=WebhookSettings)
    # failover storms held (SPEC §8; health/storms.py): off at 0 %
    storms: StormSettings = field(default_factory=StormSettings)
    # SPEC §11: a data plane this late to apply a route decision is LAGGING;
    # each probed endpoint's outcome history is kept this long (0: none)
    convergence_alert_sec: float = 30.0
    history_hours: float = 24.0

    @property
    def clustered(self) -> bool:
        return self.store is not None and self.store.startswith("etcd://")

    def store_name(self) -> str:
        return self.store if self.clustered and self.store else self.db


def parse_listen(text: str, option: str = "--listen") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{option} expects HOST:PORT, got {text!r}")
    return (host.strip("[]") or "127.0.0.1"), int(port)


class Server:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        host, port = parse_listen(settings.listen)
        self.api = ApiListener(host, port, settings.api)
        self.access = Access.for_listen(host, settings.tokens_file)
        self.store: Store | None = None
        self.node: ClusterNode | None = None
        self.health: HealthService | None = None
        self.control: ControlPlane | None = None
        self.recorder: TransitionRecorder | None = None
        self.webhooks: WebhookDispatcher | None = None
        self.metric_sources: MetricSources | None = None
        self.practice: PracticeRunner | None = None
        self.convergence: ConvergenceMonitor | None = None
        self.traffic: TrafficHistory | None = None
        self.api_state: ApiState | None = None
        self.dataplane: DataPlaneService | None = None
        self.evidence: EvidenceSampler | None = None
        self.agent: AgentServer | None = None
        self.dns: DnsServer | None = None
        self.xds: XdsServer | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._settle: asyncio.TimerHandle | None = None  # the second freeze (see start)
        self.on_started: list[Callable[[], Any]] = []
        self.configure_app: list[Callable[[FastAPI], None]] = []  # extra routes (the demo's)
        self.notifier = Notifier.from_env()  # systemd's Type=notify (a no-op without it)

    @property
    def host(self) -> str:
        return self.api.host

    @property
    def port(self) -> int:
        return self.api.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """In this order (see the module doc): the API's address taken; the
        store read and the engine resumed; the cluster joined; the agent,
        DNS and xDS servers; the listeners; the store's watch and the
        manifests; probing; the API answering."""
        s = self.settings
        sys.setswitchinterval(s.switch_interval)
        raise_open_file_limit()  # (once, for this process; its workers inherit it)
        if s.probe.source is not None:
            _check_local(s.probe.source)
        endpoints = parse_endpoints(s.store) if s.clustered and s.store else None
        self._check_binds()
        self.api.bind()  # before the database is touched, and before any listener
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.reload_tokens)
        await self._load(endpoints)
        await self._join_cluster()
        self._start_webhooks()
        self._start_metric_sources()
        await self._start_integrations()
        await self._start_dataplane()
        assert self.control is not None and self.health is not None
        self.control.start()  # from here on, every change reaches the mirror through the watch
        for manifest in s.manifests:
            await self._apply_file(manifest)
        await self.health.start()
        await self._serve_api()
        # Everything built so far lives as long as the process: move it out of
        # the collector's sight, so that collections stay short and never delay
        # probes (the probe path allocates, and full collections would rescan
        # every resource model each time).
        _collect_and_freeze()
        # ... and once more when the first probes have decided every endpoint:
        # that first round builds the probe state, the first transitions and
        # their records, all long-lived too; left in the collector's sight they
        # made full collections of 35-50 ms at 10,000 endpoints (and probes due
        # meanwhile late), 2-10 ms once frozen.
        self._settle = asyncio.get_running_loop().call_later(
            first_round_seconds(self.control.resources.values()), _collect_and_freeze
        )
        log.info("healthgate serving on %s (store %s)", self.url, s.store_name())

    def reload_tokens(self) -> None:
        """SIGHUP: the tokens file read again (api/auth.py)."""
        self.notifier.reloading()
        outcome = self.access.reload()
        log.warning("received SIGHUP: %s", outcome)
        self.notifier.reloaded(f"serving on {self.url}; {outcome}")

    def reserved_addresses(self) -> tuple[Reserved, ...]:
        """The addresses serve itself uses: no forwarding rule may take one."""
        s = self.settings
        tcp, both = frozenset({"TCP"}), frozenset({"TCP", "UDP"})
        out = [Reserved(_ip(self.api.host), self.api.port, tcp, "--listen")]
        for option, value, protocols in (
            ("--agent", s.agent, tcp),
            ("--dns", s.dns, both),
            ("--xds", s.xds, tcp),
        ):
            if value:
                host, port = parse_listen(value, option)
                out.append(Reserved(_ip(host), port, protocols, option))
        if s.clustered and s.store:
            for member in parse_endpoints(s.store):
                etcd_host, _, etcd_port = member.rpartition(":")
                out.append(Reserved(_ip(etcd_host.strip("[]")), int(etcd_port), tcp, "etcd"))
        return tuple(out)

    def _source(self) -> SourceFactory:
        """How probing runs: this node's share of a cluster, probe workers or
        this process (controlplane/probing.py)."""
        s = self.settings
        workers = s.probe_workers if s.probe_workers is not None else default_workers(s.clustered)
        if s.clustered:
            assert s.node and s.region, "checked by the CLI"
            cluster = ClusterSettings(
                s.node,
                s.region,
                s.lease_ttl,
                workers,
                api_url=s.advertise_url or self.url,
                sweep_every=s.opinion_sweep,
            )

            def in_cluster(feed: Feed, failure_log: FailureLogLimiter) -> ProbeSource:
                return ClusterProbing(feed, cluster, s.probe, s.scheduler, failure_log)

            return in_cluster

        def embedded(feed: Feed, failure_log: FailureLogLimiter) -> ProbeSource:
            if workers > 0:
                return WorkerProbing(feed, workers, s.probe, s.scheduler, failure_log)
            return InProcessProbing(feed, s.probe, s.scheduler, failure_log)

        return embedded

    async def _load(self, etcd: list[str] | None) -> None:
        """The store, the engine resumed from it, and the transition log."""
        s = self.settings
        store: Store
        if etcd is not None:
            self.store = store = EtcdStore(
                etcd, settings=EtcdSettings.for_lease(s.lease_ttl), tls=s.etcd_tls, auth=s.etcd_auth
            )
            await asyncio.to_thread(store.open_schema)  # (a newer layout: refused before any write)
        else:
            Path(s.db).parent.mkdir(parents=True, exist_ok=True)
            self.store = store = SqliteStore(s.db)
        self.health = health = HealthService(
            failure_log_rate=s.failure_log_rate, source=self._source()
        )
        health.engine.set_storm_settings(s.storms)
        log.info("starting: store %s, API on %s", s.store_name(), s.listen)
        self.recorder = recorder = TransitionRecorder(store, retention=s.log_retention)
        recorder.last_id = store.last_log_id()
        health.listen(recorder)
        self.convergence = ConvergenceMonitor(
            health, self._write_own_records, s.convergence_alert_sec, s.node or ""
        )
        self.control = ControlPlane(store, health)
        self.control.reserved = self.reserved_addresses()
        self._tasks.append(asyncio.create_task(recorder.run(), name="recorder"))
        count = await self.control.load()
        log.info("loaded %d resources from %s", count, s.store_name())

    async def _join_cluster(self) -> None:
        assert self.health is not None and self.recorder is not None
        source = self.health.source
        if isinstance(source, ClusterProbing):
            assert isinstance(self.store, EtcdStore)
            self.node = ClusterNode(self.store, source.cluster, source, self.recorder)
            await self.node.start()  # members and opinions known before probing starts

    def _start_webhooks(self) -> None:
        """Deliveries of the webhooks: here, or in a cluster on the elected writer."""
        assert self.control is not None and self.recorder is not None and self.store is not None
        control, recorder, node = self.control, self.recorder, self.node

        def permit() -> tuple[bool, Guard | None]:
            if node is None:
                return True, None
            return node.leading and recorder.guard is not None, recorder.guard

        self.webhooks = dispatcher = WebhookDispatcher(
            self.store, self.settings.api.address_policy, self.settings.webhooks, permit
        )
        recorder.wakers.append(dispatcher.wake)
        watch = dispatcher.watch(lambda: control.stored)
        control.on_change.append(watch)
        first = WorldChange(control.revision, 0.0, control.resources, {}, whole=True)
        self._tasks.append(asyncio.create_task(watch(first), name="webhooks (first look)"))
        self._tasks.append(asyncio.create_task(dispatcher.run(), name="webhook deliveries"))

    def _start_metric_sources(self) -> None:
        """METRIC health sources' queries (SPEC §10), on every node."""
        assert self.control is not None and self.health is not None
        control, health = self.control, self.health
        self.metric_sources = metrics = MetricSources(
            health.engine.set_traffic, health.emit, self.settings.api.address_policy
        )
        control.on_change.append(metrics.changed)
        first = WorldChange(control.revision, 0.0, control.resources, {}, whole=True)
        self._tasks.append(asyncio.create_task(metrics.changed(first), name="metric sources"))

    def _write_own_records(self, records: list[Record]) -> None:
        """Records of this node's own data planes (Convergence): with the
        engine's in one process; in a cluster appended by this node itself,
        leader or not (controlplane/recorder.py)."""
        assert self.recorder is not None and self.health is not None
        if self.node is None:
            self.health.emit(records)
        else:
            self._tasks.append(
                asyncio.create_task(self.recorder.append_own(records), name="own records")
            )
            self._tasks = [t for t in self._tasks if not t.done()]

    def _start_practice(self) -> None:
        """Practice runs (SPEC §11): here, or in a cluster by the elected writer."""
        assert self.control and self.health and self.store and self.evidence and self.recorder
        node, recorder = self.node, self.recorder

        def permit() -> bool:
            return node is None or (node.leading and recorder.guard is not None)

        self.practice = practice = PracticeRunner(
            self.control, self.health, self.store, self.settings.api.address_policy, permit
        )
        self.evidence.listeners.append(practice.observe)
        practice.start()

    def _check_binds(self) -> None:
        """The agent, DNS and xDS servers answer whoever reaches them: beyond
        loopback only with TLS (xDS) or when told so (--insecure-bind)."""
        s = self.settings
        for option, value, tls in (
            ("--agent", s.agent, False),
            ("--dns", s.dns, False),
            ("--xds", s.xds, s.xds_tls is not None),
        ):
            if not value or tls or s.insecure_bind:
                continue
            host, _ = parse_listen(value, option)
            if not is_loopback(host):
                remedy = (
                    "give --xds-tls-cert/--xds-tls-key/--xds-client-ca, or "
                    if option == "--xds"
                    else ""
                )
                raise ValueError(
                    f"{option} {value} is not a loopback address: whoever reaches it reads every "
                    f"project's routes; {remedy}--insecure-bind to bind it anyway"
                )
        if s.dns and not self.access.open:
            for zone in s.dns_zones or ["(none given)"]:
                if "=" not in zone:
                    raise ValueError(
                        "--dns with --tokens: every --dns-zone names the project it belongs to, "
                        f"ZONE=PROJECT (got {zone})"
                    )

    async def _start_integrations(self) -> None:
        """HAProxy's agent, the DNS server and Envoy's ADS, each if asked for."""
        s = self.settings
        assert self.health is not None and self.control is not None
        engine, control = self.health.engine, self.control
        if s.agent:
            agent_host, agent_port = parse_listen(s.agent, "--agent")
            self.agent = AgentServer(lambda neg: agent_answer(engine, neg), agent_host, agent_port)
            if self.convergence is not None:
                self.agent.observer = self.convergence.agent_answered
            await self.agent.start()
        if s.dns:
            dns_host, dns_port = parse_listen(s.dns, "--dns")
            directory = DnsDirectory(engine, s.dns_zones)
            directory.update(control.resources)
            if self.convergence is not None:
                directory.observer = self.convergence.dns_served

            async def update_directory(change: WorldChange) -> None:
                # (names and addresses come from rules and attachments alone)
                if change.touches("forwardingRules", "serviceAttachments"):
                    directory.update(change.world)

            control.on_change.append(update_directory)
            self.dns = DnsServer(directory, dns_host, dns_port)
            await self.dns.start()
        if s.xds:
            await self._start_xds(s.xds, self.health, control)

    def _affinity_keys(self) -> list[bytes]:
        """The session-affinity cookie's keys (SPEC §9): in a cluster one
        pair in the store, so that every node honours every node's cookie;
        else in a file beside the database (0600, rotated weekly)."""
        if isinstance(self.store, EtcdStore):
            return shared_affinity_keys(self.store.client)
        db = Path(self.settings.db)
        return load_keys(db.with_name(db.name + ".affinity-key"))

    async def _start_dataplane(self) -> None:
        """The listeners, in this process or in worker processes, following
        the routes (already resumed: fail static) and the resources."""
        s = self.settings
        health, control = self.health, self.control
        assert health is not None and control is not None
        keys = await asyncio.to_thread(self._affinity_keys)
        settings = replace(s.dataplane, reserved=control.reserved, affinity_keys=tuple(keys))
        if s.clustered:  # the nodes of one region share its front ends' addresses
            settings = replace(settings, region=s.region, reuse_port=True)
        dataplane: DataPlaneService
        if settings.workers and settings.enabled:
            # listeners in worker processes (SO_REUSEPORT), fed from here
            pool = WorkerPool(health.engine, replace(settings, reuse_port=True), s.stop_grace)
            await pool.start()
            self.dataplane = dataplane = pool
            health.listen(_SentToWorkers(pool))
        else:
            self.dataplane = dataplane = DataPlane(health.engine, settings)
        if self.convergence is not None:
            dataplane.on_applied = self.convergence.holds
        await dataplane.apply_change(
            WorldChange(control.revision, 0.0, control.resources, control.resources, whole=True)
        )
        control.on_change.append(dataplane.apply_change)
        # real traffic as evidence (SPEC §8), and failbackMaxErrorPercent's
        # gate: once a second, the listeners' counts to the engine
        self.evidence = EvidenceSampler(health, dataplane)
        if self.node is not None:  # (cluster mode: verdicts are opinions, the quorum decides)
            self.evidence.on_verdicts = self.node.traffic.local
        self._tasks.append(asyncio.create_task(self.evidence.run(), name="traffic evidence"))
        self.traffic = TrafficHistory(health.engine)  # (the dashboard's charts)
        self.evidence.listeners.append(self.traffic.observe)
        self._start_practice()
        health.listen(_RoutesFollowed(dataplane))

    async def _serve_api(self) -> None:
        assert self.control and self.health and self.recorder and self.store and self.dataplane
        s = self.settings
        dataplane = self.dataplane
        owned = tuple(
            (zone, project) for zone, project in map(parse_zone, s.dns_zones) if project is not None
        )
        api_settings = replace(s.api, dns_zones=owned) if owned else s.api
        state = ApiState(
            self.control, self.health, self.recorder, self.store, self.access, api_settings
        )
        self.api_state = state
        state.public_healthz = s.public_healthz
        if self.agent is not None:
            state.agent_address = (self.agent.host, self.agent.port)
        if self.node is not None:
            state.cluster_status = self.node.status
            state.peers = self.node.peers
            state.traffic_status = self.node.traffic.status
            state.collectors.append(ClusterCollector(self.node.status))
        state.collectors.append(DataPlaneCollector(dataplane))
        if isinstance(dataplane, WorkerPool):
            state.collectors.append(dataplane)
        state.dataplane_status = dataplane.status
        state.webhooks = self.webhooks
        state.practice = self.practice
        state.convergence = self.convergence
        state.traffic = self.traffic
        if self.convergence is not None:
            state.collectors.append(self.convergence)
            self.convergence.start()
        if self.webhooks is not None:
            state.collectors.append(WebhookCollector(self.webhooks))
        app = create_app(state)
        for configure in self.configure_app:
            configure(app)
        await self.api.serve(app)
        for callback in self.on_started:
            result = callback()
            if asyncio.iscoroutine(result):
                await result
        state.ready = True

    async def _start_xds(self, address: str, health: HealthService, control: ControlPlane) -> None:
        """Envoy's ADS: a new snapshot whenever the resources change or a
        transition reaches a PSC NEG or a route (the only states it carries)."""
        from healthgate.integrations.xds import XdsServer, XdsSnapshots

        host, port = parse_listen(address, "--xds")
        s = self.settings
        self.xds = xds = XdsServer(host, port, s.xds_tls, s.xds_clients)
        if self.convergence is not None:
            xds.on_version = self.convergence.xds_version
            xds.on_ack = self.convergence.xds_ack
        snapshots = XdsSnapshots(health.engine)
        snapshots.take(WorldChange(control.revision, 0.0, control.resources, {}, whole=True))
        xds.update(snapshots.build())

        async def resources_changed(change: WorldChange) -> None:
            if snapshots.take(change):
                xds.update(snapshots.build())

        control.on_change.append(resources_changed)
        health.listen(_PushedToEnvoy(xds, snapshots))
        await xds.start()

    async def _apply_file(self, manifest: str) -> None:
        assert self.control is not None
        try:
            docs = parse_manifest(Path(manifest).read_text(encoding="utf-8"))
            outcome = await self.control.apply(docs)
        except InvalidResources as exc:
            raise ControlError(
                Refusal.INVALID, f"{manifest}: invalid manifest", exc.issues
            ) from None
        plan = outcome.plan
        log.info(
            "%s: %d created, %d updated, %d unchanged",
            manifest,
            len(plan.create),
            len(plan.update),
            len(plan.unchanged),
        )

    def stop_steps(self) -> list[StopStep]:
        """The stop, in order (runtime/lifecycle.py runs each with its
        deadline): nothing new comes in (event streams end, the API and the
        listeners stop accepting), open front-end connections get
        ``--stop-grace`` seconds and are then closed, the integrations stop,
        the cluster node leaves, probing and the workers stop, the log is
        flushed, the store closes. Only what was started is stopped."""
        grace = self.settings.stop_grace
        steps = [
            (self.recorder is not None, "the API and event streams", self._close_api, 5.0),
            (
                self.dataplane is not None,
                f"the listeners (open connections get {grace:g} s)",
                self._close_dataplane,
                grace + 5.0,
            ),
            (
                any((self.agent, self.dns, self.xds)),
                "the agent, DNS and xDS servers",
                self._close_integrations,
                5.0,
            ),
            (self.node is not None, "cluster membership and elections", self._leave, 10.0),
            (self.control is not None, "the store's watch", self._close_control, 5.0),
            (self.health is not None, "the probes and probe workers", self._close_health, 10.0),
            (self.recorder is not None, "the transition log (the last writes)", self._flush, 5.0),
            (bool(self._tasks), "background tasks", self._stop_tasks, 5.0),
            (self.store is not None, "the store", self._close_store, 5.0),
        ]
        return [StopStep(name, run, timeout) for wanted, name, run, timeout in steps if wanted]

    async def _close_api(self) -> None:
        if self._settle is not None:
            self._settle.cancel()
        if self.recorder is not None:
            self.recorder.close_subscribers()  # live event streams end first
        await self.api.close()

    async def _close_dataplane(self) -> None:
        if self.dataplane is not None:
            await self.dataplane.close(self.settings.stop_grace)

    async def _close_integrations(self) -> None:
        for integration in (self.agent, self.dns, self.xds):
            if integration is not None:
                await integration.close()

    async def _leave(self) -> None:
        if self.node is not None:
            await self.node.close()

    async def _close_control(self) -> None:
        if self.control is not None:
            await self.control.close()

    async def _close_health(self) -> None:
        if self.metric_sources is not None:
            await self.metric_sources.close()
        if self.practice is not None:
            await self.practice.close()
        if self.convergence is not None:
            await self.convergence.close()
        if self.health is not None:
            await self.health.close()

    async def _flush(self) -> None:
        if self.recorder is not None:
            await self.recorder.flush()

    async def _stop_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _close_store(self) -> None:
        if self.store is not None:
            self.store.close()

    async def stop(self) -> None:
        await run_steps(self.stop_steps(), log)
        await self.api.close()  # (the address was taken first: released whatever happened)


# ------------------------------------------------------------------ who follows health


class _RoutesFollowed(HealthListener):
    """The data plane: front ends whose route changed (it drains, and notes who joined)."""

    def __init__(self, dataplane: DataPlaneService) -> None:
        self.dataplane = dataplane

    def records(self, records: list[Record]) -> None:
        self.dataplane.routes_changed([r.frontend for r in records if isinstance(r, RouteChange)])


class _SentToWorkers(HealthListener):
    """Data-plane workers: the health they read, after every batch of records
    and every step of a ramp."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def records(self, records: list[Record]) -> None:
        self.pool.publish_health()

    def routes_moved(self) -> None:
        self.pool.publish_health()


class _PushedToEnvoy(HealthListener):
    """Envoy's ADS: a new snapshot when a PSC NEG, a route or a ramp moved."""

    def __init__(self, xds: XdsServer, snapshots: XdsSnapshots) -> None:
        self.xds = xds
        self.snapshots = snapshots

    def records(self, records: list[Record]) -> None:
        if any(r.kind in (RecordKind.NEG, RecordKind.ROUTE, RecordKind.RAMP) for r in records):
            self.routes_moved()

    def routes_moved(self) -> None:
        self.xds.update(self.snapshots.build())


def _ip(host: str) -> str:
    return "127.0.0.1" if host == "localhost" else host


def _check_local(source: str) -> None:
    """--probe-source must be an address of this machine."""
    family = socket.AF_INET6 if ":" in source else socket.AF_INET
    with socket.socket(family) as probe:
        try:
            probe.bind((source, 0))
        except OSError as exc:
            raise OSError(
                f"--probe-source {source}: {exc.strerror or exc} (not an address of this machine?)"
            ) from None


def first_round_seconds(resources: Iterable[Resource]) -> float:
    """When the first probes have decided every endpoint (HEALTHY needs
    ``healthyThreshold`` probes, UNHEALTHY ``unhealthyThreshold`` timeouts,
    the first one up to an interval in): at most 120 s."""
    longest = 0.0
    for res in resources:
        if isinstance(res, HealthCheck):
            rounds = max(res.healthy_threshold, res.unhealthy_threshold)
            longest = max(longest, res.check_interval_sec * (rounds + 1) + res.timeout_sec)
    return min(120.0, longest + 1.0)


def _collect_and_freeze() -> None:
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.debug("heap settled in %.0f ms", (time.perf_counter() - started) * 1000)


async def run_server(settings: ServeSettings) -> None:
    """``healthgate serve``: start, serve until SIGINT / SIGTERM, stop."""
    server = Server(settings)
    notifier = server.notifier

    async def start() -> None:
        await server.start()
        install_debug_block()
        notifier.ready(f"serving on {server.url} (store {settings.store_name()})")

    async def stop() -> None:
        notifier.stopping()
        try:
            await server.stop()
        finally:
            notifier.close()

    await Stopper("serve").run(start, stop)
