"""The partition test ground (SPEC §4, "Partitions"): three regions as real
networks on one machine, a cluster across them, and what the tests and
bench/partitions.py observe.

Per region (us-east1, europe-west1, asia-east1; short names us, eu, asia):

* ``<r>-node`` (198.18.0.1x): the region's etcd member and its healthgate
  node (API on :7400, the region's front end on :8088);
* ``<r>-ep`` (198.18.0.1x1, 1x2): the region's two endpoints (:8080);

and ``client`` (198.18.0.200). The world: in project ``shop`` one service
per region (HTTP checks every second, thresholds 2), published through a
service attachment; in project ``web`` a global backend service over the
three PSC NEGs (failover order us, eu, asia) and one front end per region.

The observer (this process, 198.18.0.1) reads every node's API with an
admin token; nodes listen beyond loopback, so they run with ``--tokens``
as production does. :class:`RouteWatch` polls every node's route every 50
ms and keeps each change with its time.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from tests.integration.serve_proc import wait_for, wait_ready
from tests.partitions.netns import SUBNET, Lab

from healthgate.client import KEEPALIVE
from healthgate.fixtures.etcd_local import EtcdCluster

REGIONS = (("us", "us-east1"), ("eu", "europe-west1"), ("asia", "asia-east1"))
SHORT = {region: short for short, region in REGIONS}
TOKEN = "partition-ground-admin-token"
API_PORT, FRONT_PORT, ENDPOINT_PORT = 7400, 8088, 8080
ETCD_WRITE_WAIT = 15.0  # a write through a cut-off node: refused within this
BACKEND = Path(__file__).with_name("backend.py")
# one HTTP request from the client's namespace (argv: address, port): the body's first line
CLIENT = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3)
    s.settimeout(3)
    s.sendall(b"GET / HTTP/1.1\\r\\nHost: front\\r\\nConnection: close\\r\\n\\r\\n")
    data = b""
    while len(data) < 65536 and (chunk := s.recv(4096)):
        data += chunk
    print(data.split(b"\\r\\n\\r\\n", 1)[-1].decode(errors="replace").splitlines()[0])
except (OSError, IndexError):
    pass
"""


# requests from the client's namespace through every front end for argv[1]
# seconds, in argv[2] threads per front end (argv[3:]: the front ends'
# addresses; port FRONT_PORT): at the end, one line of JSON - per front end
# the answers by status ("0": no answer)
LOAD = """
import json, socket, sys, threading, time
seconds, threads, fronts = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
counts = {f: {} for f in fronts}
lock = threading.Lock()
def one(front):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        status = "0"
        try:
            s = socket.create_connection((front, PORT), timeout=3)
            s.settimeout(3)
            s.sendall(b"GET / HTTP/1.1\\r\\nHost: front\\r\\nConnection: close\\r\\n\\r\\n")
            data = s.recv(64)
            status = data.split(b" ")[1].decode() if data.startswith(b"HTTP/") else "0"
            s.close()
        except OSError:
            pass
        with lock:
            counts[front][status] = counts[front].get(status, 0) + 1
workers = [threading.Thread(target=one, args=(f,)) for f in fronts for _ in range(threads)]
for w in workers: w.start()
for w in workers: w.join()
print(json.dumps(counts))
""".replace("PORT", str(FRONT_PORT))


def node_address(i: int) -> str:
    return f"{SUBNET}.{10 + i}"


def endpoint_addresses(i: int) -> tuple[str, str]:
    return f"{SUBNET}.{100 + 10 * i + 1}", f"{SUBNET}.{100 + 10 * i + 2}"


def world(vantages: bool = False) -> list[dict[str, Any]]:
    """The three-region world (see the module doc); with ``vantages`` every
    check is probed from all three regions (a quorum of 2)."""
    out: list[dict[str, Any]] = []
    backends = []
    for i, (short, region) in enumerate(REGIONS):
        shop = {"project": "shop", "region": region}
        check: dict[str, Any] = {
            "kind": "HealthCheck",
            **shop,
            "name": "http",
            "type": "HTTP",
            "port": ENDPOINT_PORT,
            "requestPath": "/",
            "checkIntervalSec": 1,
            "timeoutSec": 1,
            "healthyThreshold": 2,
            "unhealthyThreshold": 2,
        }
        if vantages:
            check["vantageRegions"] = [r for _, r in REGIONS if r != region]
        eps = [{"ipAddress": ip, "port": ENDPOINT_PORT} for ip in endpoint_addresses(i)]
        out += [
            check,
            {
                "kind": "NetworkEndpointGroup",
                **shop,
                "name": "web-neg",
                "networkEndpointType": "GCE_VM_IP_PORT",
                "endpoints": eps,
            },
            {
                "kind": "BackendService",
                **shop,
                "name": "web",
                "loadBalancingScheme": "INTERNAL_MANAGED",
                "protocol": "HTTP",
                "healthChecks": ["healthChecks/http"],
                "backends": [{"group": "networkEndpointGroups/web-neg"}],
            },
            {"kind": "HealthAggregationPolicy", **shop, "name": "policy"},
            {
                "kind": "HealthSource",
                **shop,
                "name": "web-source",
                "sourceType": "BACKEND_SERVICE",
                "sources": ["backendServices/web"],
                "healthAggregationPolicy": "healthAggregationPolicies/policy",
            },
            {
                "kind": "ForwardingRule",
                **shop,
                "name": "web-fr",
                "IPAddress": node_address(i),
                "ports": [ENDPOINT_PORT],
                "IPProtocol": "TCP",
                "loadBalancingScheme": "INTERNAL_MANAGED",
                "backendService": "backendServices/web",
            },
            {
                "kind": "CompositeHealthCheck",
                **shop,
                "name": "web-composite",
                "healthSources": ["healthSources/web-source"],
                "healthDestination": "forwardingRules/web-fr",
            },
            {
                "kind": "ServiceAttachment",
                **shop,
                "name": "web-attachment",
                "targetService": "forwardingRules/web-fr",
                "connectionPreference": "ACCEPT_AUTOMATIC",
            },
            {
                "kind": "NetworkEndpointGroup",
                "project": "web",
                "region": region,
                "name": f"shop-{short}",
                "networkEndpointType": "PRIVATE_SERVICE_CONNECT",
                "pscTargetService": f"projects/shop/regions/{region}/serviceAttachments/web-attachment",
            },
        ]
        backends.append(
            {"group": f"regions/{region}/networkEndpointGroups/shop-{short}", "failoverPriority": i}
        )
    out.append(
        {
            "kind": "BackendService",
            "project": "web",
            "region": "global",
            "name": "shop",
            "loadBalancingScheme": "EXTERNAL_MANAGED",
            "protocol": "HTTP",
            "backends": backends,
            "failoverPolicy": {"failback": True},
        }
    )
    for i, (short, region) in enumerate(REGIONS):
        out.append(
            {
                "kind": "ForwardingRule",
                "project": "web",
                "region": "global",
                "name": f"front-{short}",
                "IPAddress": node_address(i),
                "portRange": str(FRONT_PORT),
                "IPProtocol": "TCP",
                "loadBalancingScheme": "EXTERNAL_MANAGED",
                "backendService": "backendServices/shop",
                "dataPlaneRegion": region,
            }
        )
    return out


class Node:
    """A healthgate node in ``<short>-node``."""

    def __init__(self, ground: Ground, i: int, short: str, region: str) -> None:
        self.ground, self.short, self.region = ground, short, region
        self.name = short
        self.place = f"{short}-node"
        self.address = node_address(i)
        self.url = f"http://{self.address}:{API_PORT}"
        self.log = ground.tmp / f"node-{short}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=2.0,
            limits=KEEPALIVE,  # (let a connection go before serve closes it)
        )

    def start(self, *extra: str) -> None:
        assert self.ground.etcd is not None
        etcd = [m.address for m in self.ground.etcd.members]
        mine = f"{self.address}:2379"
        etcd.sort(key=lambda a: a != mine)  # its own region's member first
        argv = [
            sys.executable,
            "-m",
            "healthgate",
            "serve",
            "--store",
            "etcd://" + ",".join(etcd),
            "--node",
            self.name,
            "--region",
            self.region,
            "--lease-ttl",
            str(self.ground.lease_ttl),
            "--listen",
            f"{self.address}:{API_PORT}",
            "--tokens",
            str(self.ground.tokens),
            "--probe-failure-log-rate",
            "0",
            "--stop-grace",
            "0.2",
            *extra,
        ]
        self.proc = self.ground.lab.spawn(self.place, argv, self.log)

    def wait_ready(self, timeout: float = 30.0) -> None:
        assert self.proc is not None
        wait_ready(self.proc, "", f"node {self.name}", self.tail, timeout, get=self.http.get)

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def get(self, path: str) -> Any:
        resp = self.http.get(path)
        resp.raise_for_status()
        return resp.json()

    def cluster(self) -> dict[str, Any]:
        result: dict[str, Any] = self.get("/v1/cluster")
        return result

    def route(self) -> str | None:
        """The region front-us sends traffic to, as this node computes it."""
        rule = self.get("/v1/projects/web/global/forwardingRules/front-us")
        target = rule["status"]["route"]["target"]
        return None if target is None else str(target).rsplit("/shop-", 1)[1]

    def healthy_endpoints(self, region: str) -> tuple[int, int]:
        body = self.get(f"/v1/projects/shop/regions/{region}/backendServices/web/health")
        return int(body["healthy"]), int(body["endpoints"])

    def events(self, after: int = 0) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for project in ("shop", "web"):
            body = self.get(f"/v1/projects/{project}/events?after={after}&limit=10000")
            out += body["items"]
        return sorted(out, key=lambda e: int(e["id"]))

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


@dataclass(frozen=True, slots=True)
class Change:
    at: float  # time.monotonic()
    node: str
    route: str | None


class RouteWatch:
    """Every node's route, polled every ``interval`` from a thread; the
    changes with their times (bounded: at most ``max_polls`` rounds)."""

    def __init__(self, nodes: list[Node], interval: float = 0.05, max_polls: int = 20_000) -> None:
        self.nodes = nodes
        self.interval = interval
        self.max_polls = max_polls
        self.current: dict[str, str | None] = {}
        self.changes: list[Change] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="route-watch")
        self._lock = threading.Lock()

    def __enter__(self) -> RouteWatch:
        self._poll()  # the routes before anything happens
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _poll(self) -> None:
        for node in self.nodes:
            try:
                route = node.route()
            except (httpx.HTTPError, KeyError):
                continue  # (a node stopped or restarting: no opinion this round)
            with self._lock:
                if node.name not in self.current or self.current[node.name] != route:
                    if node.name in self.current:
                        self.changes.append(Change(time.monotonic(), node.name, route))
                    self.current[node.name] = route

    def _run(self) -> None:
        for _ in range(self.max_polls):
            if self._stop.wait(self.interval):
                return
            self._poll()

    def of(self, node: str, since: float = 0.0) -> list[Change]:
        with self._lock:
            return [c for c in self.changes if c.node == node and c.at >= since]

    def first(self, node: str, route: str | None, since: float) -> float | None:
        """When ``node`` first routed to ``route`` after ``since``."""
        for c in self.of(node, since):
            if c.route == route:
                return c.at
        return None


class Ground:
    """The lab, etcd across it, the region backends and the nodes."""

    def __init__(self, tmp: Path, lease_ttl: int = 2) -> None:
        self.tmp = tmp
        self.lease_ttl = lease_ttl
        self.lab = Lab()
        self.etcd: EtcdCluster | None = None
        self.nodes: dict[str, Node] = {}
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        lab = self.lab
        for i, (short, _) in enumerate(REGIONS):
            lab.place(f"{short}-node", node_address(i))
            lab.place(f"{short}-ep", *endpoint_addresses(i))
        lab.place("client", f"{SUBNET}.200")
        self.tokens = self.tmp / "tokens.yaml"
        self.tokens.write_text(yaml.safe_dump([{"token": TOKEN, "project": "*", "role": "admin"}]))
        self.tokens.chmod(0o600)
        for i, (short, region) in enumerate(REGIONS):
            addresses = [f"{ip}:{ENDPOINT_PORT}" for ip in endpoint_addresses(i)]
            lab.spawn(
                f"{short}-ep",
                [sys.executable, str(BACKEND), region, *addresses],
                self.tmp / f"backend-{short}.log",
            )
        placed = [
            (node_address(i), ("ip", "netns", "exec", lab.places[f"{s}-node"].ns))
            for i, (s, _) in enumerate(REGIONS)
        ]
        self.etcd = EtcdCluster(self.tmp, placed=placed)
        self.manifest = self.tmp / "world.yaml"
        self.manifest.write_text(yaml.safe_dump_all(world()))
        self.nodes = {s: Node(self, i, s, r) for i, (s, r) in enumerate(REGIONS)}
        first = self.nodes["us"]
        first.start("-f", str(self.manifest))
        first.wait_ready()
        for node in list(self.nodes.values())[1:]:
            node.start()
        for node in self.nodes.values():
            node.wait_ready()
        self.settle(60)

    # ------------------------------------------------------------------ views

    def live(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.proc is not None and n.proc.poll() is None]

    def leaders(self) -> list[str]:
        out = []
        for node in self.live():
            with contextlib.suppress(httpx.HTTPError):
                if node.cluster()["leading"]:
                    out.append(node.name)
        return out

    def describe(self) -> str:
        """Every node's view, for a failure's message."""
        lines = []
        for node in self.nodes.values():
            try:
                c = node.cluster()
                health = {s: node.healthy_endpoints(r) for s, r in REGIONS}
                lines.append(
                    f"{node.name}: leading={c['leading']} member={c['member']} "
                    f"members={sorted(c['members'])} route={node.route()} healthy={health} "
                    f"unwritten={c['unwrittenRecords']}"
                )
            except Exception as exc:
                lines.append(f"{node.name}: {exc!r}")
        return "\n".join(lines)

    def _settled(self) -> bool:
        try:
            for node in self.live():
                c = node.cluster()
                if not c["member"] or len(c["members"]) != len(self.nodes):
                    return False
                if c["unwrittenRecords"]:
                    return False  # (it decided something the log does not hold yet)
                if node.route() != "us":
                    return False
                for _, region in REGIONS:
                    healthy, total = node.healthy_endpoints(region)
                    if total == 0 or healthy != total:
                        return False
            return len(self.leaders()) == 1
        except httpx.HTTPError:
            return False

    def settle(self, timeout: float = 30.0) -> None:
        """Healed and quiet: every node a member of a cluster of all, every
        endpoint HEALTHY on every node, one leader, routes to us, and the
        log still for a second."""
        try:
            wait_for(self._settled, timeout, interval=0.2, what="a settled cluster")
            wait_for(self._log_quiet, 15, interval=0.1, what="a quiet log")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.describe()}") from None

    def _log_quiet(self) -> bool:
        node = self.live()[0]
        last = self.last_id(node)
        time.sleep(1.0)
        return self.last_id(node) == last

    def last_id(self, node: Node | None = None) -> int:
        events = (node or self.live()[0]).events()
        return int(events[-1]["id"]) if events else 0

    @contextlib.contextmanager
    def watching(self) -> Iterator[RouteWatch]:
        with RouteWatch(list(self.nodes.values())) as watch:
            yield watch

    def wait(self, check: Callable[[], bool], timeout: float, what: str) -> None:
        try:
            wait_for(check, timeout, interval=0.1, what=what)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.describe()}") from None

    def served_by(self, front: str) -> str | None:
        """From the client's namespace, one request through ``front``'s front
        end: the region that answered (None: no answer within 3 s)."""
        address = node_address([s for s, _ in REGIONS].index(front))
        try:
            done = subprocess.run(
                ["ip", "netns", "exec", self.lab.places["client"].ns, sys.executable, "-c",
                 CLIENT, address, str(FRONT_PORT)],
                capture_output=True, text=True, timeout=10, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return None
        words = done.stdout.split()
        return words[0].removeprefix("region=") if words else None

    def load(self, seconds: float, threads: int = 4) -> subprocess.Popen[str]:
        """Requests through every front end from the client's namespace for
        ``seconds`` (:data:`LOAD`); :meth:`load_result` reads what came back."""
        fronts = [node_address(i) for i in range(len(REGIONS))]
        return subprocess.Popen(
            ["ip", "netns", "exec", self.lab.places["client"].ns, sys.executable, "-c", LOAD,
             str(seconds), str(threads), *fronts],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    @staticmethod
    def load_result(proc: subprocess.Popen[str], timeout: float = 60.0) -> dict[str, Any]:
        out, err = proc.communicate(timeout=timeout)
        lines = out.strip().splitlines()
        if not lines:
            raise RuntimeError(f"the load generator said nothing: {err[-2000:]}")
        result: dict[str, Any] = json.loads(lines[-1])
        return result

    def apply(self, docs: list[dict[str, Any]], delete: bool = False) -> None:
        body = {"manifest": yaml.safe_dump_all(docs)}
        path = "/v1/delete" if delete else "/v1/apply"
        self.live()[-1].http.post(path, json=body, timeout=30).raise_for_status()

    def try_write(self, node: Node) -> int:
        """The status of a small write through ``node`` (a cut-off node must refuse)."""
        doc = {
            "kind": "HealthAggregationPolicy",
            "project": "shop",
            "region": node.region,
            "name": "probe-write",
            "healthyPercentThreshold": 50,
        }
        try:
            resp = node.http.post(
                "/v1/apply", json={"manifest": yaml.safe_dump(doc)}, timeout=ETCD_WRITE_WAIT
            )
        except httpx.HTTPError:
            return 0
        if resp.status_code == 200:  # (it should not have; undo it)
            self.live()[-1].http.post("/v1/delete", json={"manifest": yaml.safe_dump(doc)})
        return resp.status_code

    def use_vantages(self, on: bool) -> None:
        """Every check probed from all three regions (on) or its own only."""
        checks = [d for d in world(vantages=on) if d["kind"] == "HealthCheck"]
        body = {"manifest": yaml.safe_dump_all(checks)}
        self.live()[-1].http.post("/v1/apply", json=body, timeout=30).raise_for_status()
        self.settle(60)

    def vantage_state(self, short: str, vantage: str) -> str | None:
        """One vantage's opinion of ``short``'s first endpoint (on any node)."""
        region = dict(REGIONS)[short]
        body = self.live()[-1].get(f"/v1/projects/shop/regions/{region}/backendServices/web/health")
        vantages = body["healthStatus"][0].get("vantages") or {}
        state = vantages.get(vantage, {}).get("state")
        return None if state is None else str(state)

    def move_etcd_leader(self, short: str) -> None:
        """Make ``short``'s etcd member the raft leader (etcd's MoveLeader),
        then wait a lease TTL: the new leader extended every lease by an
        election timeout, and a scenario timing leases starts from refreshed ones."""
        assert self.etcd is not None
        i = [s for s, _ in REGIONS].index(short)
        if self.etcd.move_leader(self.etcd.members[i]):
            time.sleep(self.lease_ttl)

    # ------------------------------------------------------------------ cuts

    def region(self, short: str) -> list[str]:
        return [f"{short}-node", f"{short}-ep"]

    def close(self) -> None:
        for node in self.nodes.values():
            with contextlib.suppress(Exception):
                node.stop(signal.SIGKILL)
            node.http.close()
        if self.etcd is not None:
            with contextlib.suppress(Exception):
                self.etcd.close()
        self.lab.close()
