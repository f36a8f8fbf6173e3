"""``healthgate serve``: store, engine, probes, API (and data plane) in one process.

Start-up order matters for fail static: the store is read, the engine is
rebuilt from it *and resumed from the last known states* before any probe
runs or any listener opens, so a restart neither fails traffic over nor fails
it back to a region that was down. Manifests given with ``-f`` are then
applied like ``healthgate apply``. Shutdown stops accepting, stops probing,
flushes the transition log and closes the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from healthgate.api.app import ApiSettings, ApiState, create_app
from healthgate.api.auth import Access
from healthgate.cluster.node import ClusterNode
from healthgate.cluster.probing import ClusterProbing, ClusterSettings
from healthgate.controlplane.errors import ControlError, Refusal
from healthgate.controlplane.health_service import HealthService, SourceFactory
from healthgate.controlplane.probe_workers import WorkerProbing, default_workers
from healthgate.controlplane.probing import Feed, InProcessProbing, ProbeSource
from healthgate.controlplane.recorder import TransitionRecorder
from healthgate.controlplane.resources import ControlPlane
from healthgate.dataplane.manager import (
    DataPlane,
    DataPlaneCollector,
    DataPlaneService,
    DataPlaneSettings,
)
from healthgate.dataplane.workers import WorkerPool
from healthgate.health.states import Record, RouteChange
from healthgate.integrations.agent import AgentServer
from healthgate.integrations.dns import DnsDirectory, DnsServer
from healthgate.integrations.verdicts import agent_answer
from healthgate.model.manifest import parse_manifest
from healthgate.model.names import ResourcePath
from healthgate.model.resources import HealthCheck, Resource
from healthgate.model.validation import InvalidResources
from healthgate.probes.prober import ProbeSettings
from healthgate.probes.scheduler import SchedulerSettings
from healthgate.probes.stats import FailureLogLimiter
from healthgate.process.limits import raise_open_file_limit
from healthgate.runtime.lifecycle import Stopper, StopStep, run_steps
from healthgate.store.base import Store
from healthgate.store.etcd import EtcdStore
from healthgate.store.etcd_client import parse_endpoints
from healthgate.store.sqlite import SqliteStore

if TYPE_CHECKING:
    from healthgate.integrations.xds import XdsServer

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
    # cluster mode (SPEC §4): etcd://HOST:PORT[,...] (None: the SQLite store at db)
    store: str | None = None
    node: str | None = None
    region: str | None = None
    lease_ttl: int = 5
    # probe in N worker processes (0: in the serving process; None: one per
    # core embedded, on more than one core - controlplane/probe_workers.py)
    probe_workers: int | None = None
    # on stop: seconds open front-end connections get to finish before they are closed
    stop_grace: float = 2.0

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


class _H11WithHeadTimeout(H11Protocol):
    """uvicorn's h11 protocol with a header timeout, which uvicorn lacks: a
    request head must be whole within ``HEAD_TIMEOUT`` of the connection
    opening or of its first byte after a response, or the connection is
    closed (a slowloris would otherwise hold one of the API's connections -
    and there are ``limit_concurrency`` of them - for ever)."""

    HEAD_TIMEOUT = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.HEAD_TIMEOUT, self._head_expired)

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self._waiting_for_head():
            self._arm_head_timer()
        super().data_received(data)
        if not self._waiting_for_head() and self._head_timer is not None:
            self._head_timer.cancel()  # a head arrived whole: its request is being served
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


class _QuietUvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the runtime owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:
        return None


class Server:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.host, self.port = parse_listen(settings.listen)
        self.access = Access.for_listen(self.host, settings.tokens_file)
        self.store: Store | None = None
        self.node: ClusterNode | None = None
        self.health: HealthService | None = None
        self.control: ControlPlane | None = None
        self.recorder: TransitionRecorder | None = None
        self.api_state: ApiState | None = None
        self.dataplane: DataPlaneService | None = None
        self.agent: AgentServer | None = None
        self.dns: DnsServer | None = None
        self.xds: XdsServer | None = None
        self._uvicorn: _QuietUvicorn | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._settle: asyncio.TimerHandle | None = None  # the second freeze (see start)
        self.on_started: list[Callable[[], Any]] = []
        self.configure_app: list[Callable[[FastAPI], None]] = []  # extra routes (the demo's)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        s = self.settings
        sys.setswitchinterval(s.switch_interval)
        raise_open_file_limit()  # (once, for this process; its workers inherit it)
        _check_free(self.host, self.port, "--listen")  # before the database is touched
        if s.probe.source is not None:
            _check_local(s.probe.source)
        store: Store
        dataplane_settings = s.dataplane
        workers = s.probe_workers
        if workers is None:
            workers = default_workers(s.clustered)
        source: SourceFactory
        cluster: ClusterSettings | None = None
        if s.clustered:
            assert s.store is not None and s.node and s.region, "checked by the CLI"
            cluster = ClusterSettings(s.node, s.region, s.lease_ttl, workers)
            self.store = store = EtcdStore(parse_endpoints(s.store))

            def source(feed: Feed, failure_log: FailureLogLimiter) -> ProbeSource:
                assert cluster is not None
                return ClusterProbing(feed, cluster, s.probe, s.scheduler, failure_log)

            # the nodes of one region share its front ends' addresses
            dataplane_settings = replace(s.dataplane, region=s.region, reuse_port=True)
        else:
            Path(s.db).parent.mkdir(parents=True, exist_ok=True)
            self.store = store = SqliteStore(s.db)

            def source(feed: Feed, failure_log: FailureLogLimiter) -> ProbeSource:
                if workers > 0:
                    return WorkerProbing(feed, workers, s.probe, s.scheduler, failure_log)
                return InProcessProbing(feed, s.probe, s.scheduler, failure_log)

        health = HealthService(failure_log_rate=s.failure_log_rate, source=source)
        log.info("starting: store %s, API on %s", s.store_name(), s.listen)
        self.health = health
        self.recorder = recorder = TransitionRecorder(store, retention=s.log_retention)
        recorder.last_id = store.last_log_id()
        health.subscribe(recorder.on_records)
        health.on_forget(recorder.on_forget)
        self.control = control = ControlPlane(store, health)
        self._tasks.append(asyncio.create_task(recorder.run(), name="recorder"))

        count = await control.load()
        log.info("loaded %d resources from %s", count, s.store_name())
        if isinstance(health.source, ClusterProbing):
            assert isinstance(store, EtcdStore) and cluster is not None
            self.node = ClusterNode(store, cluster, health.source, recorder)
            await self.node.start()  # members and opinions known before probing starts
        dataplane: DataPlaneService
        if s.dataplane.workers and s.dataplane.enabled:
            # listeners in worker processes (SO_REUSEPORT), fed from here
            pool = WorkerPool(
                health.engine, replace(dataplane_settings, reuse_port=True), s.stop_grace
            )
            await pool.start()
            self.dataplane = dataplane = pool
            health.subscribe(lambda records: pool.publish_health())
        else:
            self.dataplane = dataplane = DataPlane(health.engine, dataplane_settings)
        await dataplane.sync(control.resources)  # routes are already resumed: fail static
        control.on_change.append(dataplane.sync)
        control.start()  # from here on, every change reaches the mirror through the watch
        health.subscribe(
            lambda records: dataplane.routes_changed(
                [r.frontend for r in records if isinstance(r, RouteChange)]
            )
        )
        for manifest in s.manifests:
            await self._apply_file(manifest)

        if s.agent:
            agent_host, agent_port = parse_listen(s.agent, "--agent")
            self.agent = AgentServer(
                lambda neg: agent_answer(health.engine, neg), agent_host, agent_port
            )
            await self.agent.start()
        if s.dns:
            dns_host, dns_port = parse_listen(s.dns, "--dns")
            directory = DnsDirectory(health.engine, s.dns_zones)
            directory.update(control.resources)

            async def update_directory(resources: Mapping[ResourcePath, Resource]) -> None:
                directory.update(resources)

            control.on_change.append(update_directory)
            self.dns = DnsServer(directory, dns_host, dns_port)
            await self.dns.start()
        if s.xds:
            await self._start_xds(s.xds, health, control)
        await health.start()
        self.api_state = ApiState(control, health, recorder, store, self.access, s.api)
        self.api_state.public_healthz = s.public_healthz
        if self.agent is not None:
            self.api_state.agent_address = (self.agent.host, self.agent.port)
        if self.node is not None:
            self.api_state.cluster_status = self.node.status
        self.api_state.collectors.append(DataPlaneCollector(dataplane))
        if isinstance(dataplane, WorkerPool):
            self.api_state.collectors.append(dataplane)
        self.api_state.dataplane_status = dataplane.status
        app = create_app(self.api_state)
        for configure in self.configure_app:
            configure(app)
        config = uvicorn.Config(
            app,
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            loop="none",
            timeout_graceful_shutdown=2,
            # the API's own bounds (docs/operations.md, "Limits and protections"):
            # h11 bounds a request head as it arrives (and must complete it
            # within 10 s), idle keep-alive connections close after 5 s, and
            # past the cap new connections get 503 instead of descriptors
            http=type("H11Protocol", (_H11WithHeadTimeout,), {"HEAD_TIMEOUT": s.api.head_timeout}),
            h11_max_incomplete_event_size=s.api.max_head_bytes,
            timeout_keep_alive=5,
            limit_concurrency=s.api.max_connections,
        )
        self._uvicorn = _QuietUvicorn(config)
        self._tasks.append(asyncio.create_task(self._uvicorn.serve(), name="api"))
        while not self._uvicorn.started:
            if self._tasks[-1].done():
                self._tasks[-1].result()  # raises why the API could not start
                raise RuntimeError(f"the API could not listen on {self.settings.listen}")
            await asyncio.sleep(0.01)
        if self.port == 0:  # an ephemeral port was asked for: report the real one
            servers = getattr(self._uvicorn, "servers", [])
            if servers:
                self.port = servers[0].sockets[0].getsockname()[1]
        for callback in self.on_started:
            result = callback()
            if asyncio.iscoroutine(result):
                await result
        self.api_state.ready = True
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
            first_round_seconds(control.resources.values()), _collect_and_freeze
        )
        log.info("healthgate serving on %s (store %s)", self.url, s.store_name())

    async def _start_xds(self, address: str, health: HealthService, control: ControlPlane) -> None:
        """Envoy's ADS: a new snapshot whenever the resources change or a
        transition reaches a PSC NEG or a route (the only states it carries)."""
        from healthgate.integrations.xds import XdsServer, build_snapshot

        host, port = parse_listen(address, "--xds")
        self.xds = xds = XdsServer(host, port)
        world: list[Mapping[ResourcePath, Resource]] = [control.resources]
        xds.update(build_snapshot(health.engine, world[0]))

        async def resources_changed(resources: Mapping[ResourcePath, Resource]) -> None:
            world[0] = resources
            xds.update(build_snapshot(health.engine, resources))

        def transitions(records: list[Record]) -> None:
            if any(r.kind in ("NetworkEndpointGroup", "Route") for r in records):
                xds.update(build_snapshot(health.engine, world[0]))

        control.on_change.append(resources_changed)
        health.subscribe(transitions)
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
        ``grace`` seconds and are then closed, probing and the workers
        stop, the cluster node leaves, the log is flushed, the store closes."""
        grace = self.settings.stop_grace

        async def close_api() -> None:
            if self._settle is not None:
                self._settle.cancel()
            if self.recorder is not None:
                self.recorder.close_subscribers()  # live event streams end first
            if self._uvicorn is not None:
                self._uvicorn.should_exit = True
            for task in self._tasks:
                if task.get_name() == "api":
                    await asyncio.gather(task, return_exceptions=True)

        async def close_integrations() -> None:
            for integration in (self.agent, self.dns, self.xds):
                if integration is not None:
                    await integration.close()

        async def stop_tasks() -> None:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        async def flush_log() -> None:
            if self.recorder is not None:
                await self.recorder.flush()

        async def close_store() -> None:
            if self.store is not None:
                self.store.close()

        steps = []
        if self._uvicorn is not None or self.recorder is not None:
            steps.append(StopStep("the API and event streams", close_api, 5.0))
        if self.dataplane is not None:
            steps.append(
                StopStep(
                    f"the listeners (open connections get {grace:g} s)",
                    lambda: self.dataplane.close(grace) if self.dataplane else _nothing(),
                    grace + 5.0,
                )
            )
        if self.agent or self.dns or self.xds:
            steps.append(StopStep("the agent, DNS and xDS servers", close_integrations, 5.0))
        if self.node is not None:
            steps.append(StopStep("cluster membership and elections", self.node.close, 10.0))
        if self.control is not None:
            steps.append(StopStep("the store's watch", self.control.close, 5.0))
        if self.health is not None:
            steps.append(StopStep("the probes and probe workers", self.health.close, 10.0))
        if self.recorder is not None:
            steps.append(StopStep("the transition log (the last writes)", flush_log, 5.0))
        if self._tasks:
            steps.append(StopStep("background tasks", stop_tasks, 5.0))
        if self.store is not None:
            steps.append(StopStep("the store", close_store, 5.0))
        return steps

    async def stop(self) -> None:
        await run_steps(self.stop_steps(), log)


async def _nothing() -> None:
    return None


def _check_free(host: str, port: int, option: str) -> None:
    """Refuse at once, with the option named, when an address is taken."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(
                f"{option} {host}:{port}: {exc.strerror or exc} (another healthgate?)"
            ) from None


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
    await Stopper("serve").run(server.start, server.stop)
