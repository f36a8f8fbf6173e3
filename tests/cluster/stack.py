"""A cluster on loopback for the cluster-mode tests and bench/cluster.py:
real etcd members, real region backends, real ``healthgate serve`` nodes."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from healthgate.fixtures.etcd_local import EtcdCluster
from tests.e2e.harness import Backends, e2e_world, ports
from tests.integration.serve_proc import wait_for, wait_ready
from tests.integration.servers import free_port

NODES = (("a", "us-east1"), ("b", "us-east1"), ("c", "europe-west1"))
# each node's probes leave from its own address, so that a backend can treat
# one prober differently (a broken path from one vantage)
SOURCES = {"a": "127.0.0.11", "b": "127.0.0.12", "c": "127.0.0.13"}


class Node:
    def __init__(self, stack: ClusterStack, name: str, region: str) -> None:
        self.stack, self.name, self.region = stack, name, region
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = stack.tmp / f"node-{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, *extra: str) -> Node:
        cmd = [
            sys.executable, "-m", "healthgate", "serve",
            "--store", self.stack.etcd.url,
            "--node", self.name,
            "--region", self.region,
            "--lease-ttl", str(self.stack.lease_ttl),
            "--listen", f"127.0.0.1:{self.port}",
            "--probe-failure-log-rate", "0",
            "--probe-source", SOURCES[self.name],
            *self.stack.node_args,
            *extra,
        ]  # fmt: skip
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        assert self.proc is not None
        tail = lambda: self.log.read_text()[-3000:]  # noqa: E731
        wait_ready(self.proc, self.url, f"node {self.name}", tail, timeout)

    def get(self, path: str) -> Any:
        return httpx.get(self.url + path, timeout=3).json()

    def get_text(self, path: str) -> str:
        return httpx.get(self.url + path, timeout=3).text

    def cluster(self) -> dict[str, Any]:
        result: dict[str, Any] = self.get("/v1/cluster")
        return result

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        self.proc = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class ClusterStack:
    """3 etcd members, the two-region backends and world, 3 nodes (two in
    us-east1, one in europe-west1)."""

    def __init__(self, tmp: Path, lease_ttl: int = 2, node_args: tuple[str, ...] = ()) -> None:
        self.tmp = tmp
        self.lease_ttl = lease_ttl
        self.node_args = node_args  # for every node (e.g. --probe-workers 2)
        self.etcd = EtcdCluster(tmp, 3)
        self.backend_port, self.front_port, self.producer_ports = ports()
        self.backends = Backends(self.backend_port).__enter__()
        self.world = e2e_world(self.backend_port, self.front_port, self.producer_ports)
        self.manifest = tmp / "world.yaml"
        self.manifest.write_text(yaml.safe_dump_all(self.world))
        self.nodes = {name: Node(self, name, region) for name, region in NODES}

    def start(self) -> None:
        # as docs/cluster.md asks of hosts whose nodes share an address: a
        # node killed with connections in its accept queue hands them to
        # the survivors instead of resetting them (without it, about one
        # run in five of the kill tests saw a client's retry reset too)
        self._migrate_before = set_migrate_req("1")
        first = self.nodes["a"].start("-f", str(self.manifest))
        first.wait_ready()
        for node in list(self.nodes.values())[1:]:
            node.start()
        for node in self.nodes.values():
            node.wait_ready()

    @property
    def front(self) -> str:
        return f"http://127.0.0.1:{self.front_port}/"

    def live(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.alive]

    def neg_state(self, region: str, node: Node | None = None) -> str:
        node = node or self.live()[0]
        neg = "shop-us" if region == "us-east1" else "shop-eu"
        path = f"/v1/projects/web/regions/{region}/networkEndpointGroups/{neg}"
        return str(node.get(path)["status"]["healthState"])

    def route_target(self, node: Node) -> str | None:
        rule = node.get("/v1/projects/web/global/forwardingRules/shop-frontend")
        target = rule["status"]["route"]["target"]
        if target is None:
            return None
        return "us-east1" if str(target).endswith("/shop-us") else "europe-west1"

    def events(self, node: Node, after: int = 0) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for project in ("shop", "web"):
            body = node.get(f"/v1/projects/{project}/events?after={after}&limit=10000")
            out += body["items"]
        return sorted(out, key=lambda e: int(e["id"]))

    def last_event_id(self, node: Node) -> int:
        events = self.events(node)
        return int(events[-1]["id"]) if events else 0

    def leader(self) -> Node:
        for node in self.live():
            status = node.cluster()
            if status["leading"]:
                return node
        raise LookupError("no node leads")

    def heal_all(self) -> None:
        """Back to the start: every etcd member and node running, both
        regions served, both NEGs HEALTHY on every node."""
        for member in self.etcd.members:
            if member.proc is None:
                self.etcd.restart(member)
        self.etcd.wait_ready()
        for region in ("us-east1", "europe-west1"):
            self.backends.set_mode(region, "ok")
            self.backends.backends.denied.clear()
        for node in self.nodes.values():
            if not node.alive:
                node.start()
        for node in self.nodes.values():
            node.wait_ready()
        try:
            wait_for(
                lambda: (
                    all(
                        self.neg_state(r, n) == "HEALTHY" and self.all_endpoints_healthy(r, n)
                        for n in self.live()
                        for r in ("us-east1", "europe-west1")
                    )
                    and all(len(n.cluster()["members"]) == len(self.nodes) for n in self.live())
                ),
                30,
                what="every node up, every endpoint HEALTHY everywhere",
            )
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}: {self.describe()}") from None
        # and the leader has written all of it: the log is quiet
        leader = wait_for(self._leader_or_none, 10, what="a leader")
        wait_for(lambda: self._log_quiet(leader), 10, interval=0.5, what="a quiet log")

    def post_mortem(self, lines: int = 40) -> str:
        """Each node's route, cluster status and health as it answers now,
        and the tail of its log (a failed test's report: tests/cluster/conftest.py)."""
        out = []
        for n in self.nodes.values():
            out.append(f"--- node {n.name} ({'alive' if n.alive else 'stopped'})")
            if n.alive:
                try:
                    route = n.get("/v1/projects/web/global/forwardingRules/shop-frontend")
                    out.append(f"route: {json.dumps(route['status']['route'])[:1500]}")
                    out.append(f"cluster: {json.dumps(n.cluster())[:1500]}")
                except Exception as exc:
                    out.append(f"(no answer: {exc!r})")
            try:
                tail = n.log.read_text(errors="replace").splitlines()[-lines:]
            except OSError as exc:
                tail = [f"(no log: {exc!r})"]
            out += [line[:400] for line in tail]
        out.append(f"--- health: {self.describe()}")
        return "\n".join(out)

    def describe(self) -> str:
        """Every node's view, for a failure's message."""
        out = []
        for n in self.live():
            try:
                c = n.cluster()
                states = {}
                for r in ("us-east1", "europe-west1"):
                    body = n.get(f"/v1/projects/shop/regions/{r}/backendServices/web/health")
                    states[r] = [
                        (e["ipAddress"], e["healthState"], e.get("vantages"))
                        for e in body["healthStatus"]
                    ]
                out.append(f"{n.name}: members {c['members']} leader {c['leader']} {states}")
            except Exception as exc:
                out.append(f"{n.name}: {exc!r}")
        return "; ".join(out)

    def all_endpoints_healthy(self, region: str, node: Node) -> bool:
        body = node.get(f"/v1/projects/shop/regions/{region}/backendServices/web/health")
        return bool(body["endpoints"]) and body["healthy"] == body["endpoints"]

    def _leader_or_none(self) -> Node | None:
        try:
            return self.leader()
        except (LookupError, httpx.HTTPError):
            return None

    def _log_quiet(self, node: Node) -> bool:
        last = self.last_event_id(node)
        time.sleep(0.5)
        return self.last_event_id(node) == last

    def apply(self, docs: list[dict[str, Any]], node: Node | None = None) -> None:
        node = node or self.live()[0]
        body = {"manifest": yaml.safe_dump_all(docs)}
        httpx.post(node.url + "/v1/apply", json=body, timeout=30).raise_for_status()

    def close(self) -> None:
        for node in self.nodes.values():
            node.kill(signal.SIGTERM)
        with contextlib.suppress(Exception):
            self.backends.__exit__(None, None, None)
        self.etcd.close()
        before = getattr(self, "_migrate_before", None)
        if before is not None:
            set_migrate_req(before)


MIGRATE_REQ = Path("/proc/sys/net/ipv4/tcp_migrate_req")


def set_migrate_req(value: str) -> str | None:
    """Set net.ipv4.tcp_migrate_req (this network namespace's); the value it
    had, or None when it cannot be set (not root, an older kernel)."""
    try:
        before = MIGRATE_REQ.read_text().strip()
        MIGRATE_REQ.write_text(value)
    except OSError:
        return None
    return before


class Traffic:
    """GET requests through the front end from a thread, the whole time a
    scenario runs (bounded in count). An idempotent request that fails on
    the transport (a node killed under it resets its connections) is tried
    once more on a new connection, as HTTP clients may (RFC 9110 §9.2.2);
    ``retried`` counts those, ``errors`` the requests that failed twice or
    got a 5xx."""

    def __init__(self, url: str, max_requests: int = 50_000) -> None:
        self.url = url
        self.max = max_requests
        self.done = 0
        self.retried = 0
        self.errors: list[str] = []
        self.regions: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set() and self.done < self.max:
                self.done += 1
                for attempt in (1, 2):
                    try:
                        r = client.get(self.url)
                    except httpx.TransportError as exc:
                        if attempt == 1:
                            self.retried += 1
                            continue
                        self.errors.append(f"{type(exc).__name__}: {exc}")
                        break
                    if r.status_code >= 500:
                        self.errors.append(f"HTTP {r.status_code}: {r.text[:80]}")
                    else:
                        region = r.text.split()[0].removeprefix("region=")
                        self.regions[region] = self.regions.get(region, 0) + 1
                    break
                time.sleep(0.005)


class TcpTraffic(Traffic):
    """New TCP connections to a TCP front end, one request each, no retry:
    a TCP proxy cannot know whether a byte stream may be replayed, so a
    connection a killed node held is an error, counted and reported."""

    def __init__(self, host: str, port: int, max_requests: int = 50_000) -> None:
        super().__init__(f"tcp://{host}:{port}", max_requests)
        self.address = (host, port)

    def _run(self) -> None:
        import socket

        while not self._stop.is_set() and self.done < self.max:
            self.done += 1
            try:
                with socket.create_connection(self.address, timeout=5) as s:
                    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    data = b""
                    while chunk := s.recv(4096):
                        data += chunk
                text = data.decode(errors="replace")
                if not text.startswith("HTTP/1.1 200"):
                    self.errors.append(text[:60] or "empty answer")
                else:
                    region = text.split("\r\n\r\n", 1)[1].split()[0].removeprefix("region=")
                    self.regions[region] = self.regions.get(region, 0) + 1
            except OSError as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.005)
