"""Cluster mode, measured (issue: cluster mode on etcd; docs/cluster.md).

    python bench/cluster.py                           # the issue's sizes
    python bench/cluster.py --endpoints 20000 --single 5000 --duration 10   # quicker
    python bench/cluster.py --endpoints 1000000 --interval 50 --single 0 --flips 0 \
        --lease-ttl 30 --first-round 3600                # a million endpoints, four nodes

Three figures, each printed with its goal:

1. **Probing shared over nodes**: one node probing ``--single`` endpoints
   (20,000) against ``--nodes`` nodes (4) sharing ``--endpoints`` (100,000),
   every endpoint checked every 5 s, all over one 3-member etcd on this
   machine. CPU per check (utime+stime of every node over the window, per
   probe started) of the cluster over that of the single node: goal within
   1.2x. Checks are TCP with the full handshake (the default): the endpoints
   are loopback addresses 127.1x.y.z on one listening socket, whose accept
   queue a thread of this process keeps empty (accept, close; at 20,000
   checks a second a full queue would drop SYNs and every check would time
   out - the first attempt of this bench did just that, with half-open
   checks, whose connections also reach the queue on loopback).
2. **etcd writes per second at steady state** (all endpoints HEALTHY): the
   etcd revision's growth over the window (lease refreshes make no revision):
   goal 0 - only transitions and the slow resync are written.
   And the **memory** (VmRSS) of each node.
3. **Composite transition -> route change on every node**: the 3-node
   two-region stack of the cluster tests; us-east1 broken and healed
   ``--flips`` times; each node reports, per route change, the time from the
   prober's flip to its own new route (etcd write + watch + engine). p50 and
   p99 over every node and flip: goal p99 <= 20 ms on loopback.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tests.cluster.stack import ClusterStack
from tests.integration.serve_proc import wait_for

from common import Proc, cpu_seconds, free_port, rss_mb, wait_until
from healthgate.fixtures.etcd_local import EtcdCluster
from healthgate.store.etcd import EtcdStore

NEG_SIZE = 2000  # endpoints per NEG (one NEG is one etcd key: ~100 KB)
APPLY_NEGS = 5  # NEGs per apply (an apply is one etcd request: under its 1.5 MiB)


def world(count: int, port: int, interval: int = 5) -> list[list[dict[str, Any]]]:
    """``count`` TCP endpoints on 127.1x.y.z:port, checked every ``interval``
    seconds, in applies etcd takes."""
    negs = []
    for n in range((count + NEG_SIZE - 1) // NEG_SIZE):
        first = n * NEG_SIZE
        eps = [
            {"ipAddress": f"127.{10 + i // 62500}.{i // 250 % 250}.{i % 250 + 1}", "port": port}
            for i in range(first, min(count, first + NEG_SIZE))
        ]
        negs.append(
            {
                "kind": "NetworkEndpointGroup",
                "project": "bench",
                "region": "r1",
                "name": f"neg{n}",
                "networkEndpointType": "GCE_VM_IP_PORT",
                "endpoints": eps,
            }
        )
    check = {
        "kind": "HealthCheck",
        "project": "bench",
        "region": "r1",
        "name": "hc",
        "type": "TCP",
        "port": port,
        "checkIntervalSec": interval,
        "timeoutSec": 1,
    }
    service = {
        "kind": "BackendService",
        "project": "bench",
        "region": "r1",
        "name": "bs",
        "loadBalancingScheme": "INTERNAL",
        "healthChecks": ["hc"],
        "backends": [{"group": n["name"]} for n in negs],
    }
    batches = [negs[i : i + APPLY_NEGS] for i in range(0, len(negs), APPLY_NEGS)]
    return [*batches, [check, service]]


LEASE_TTL = [5]  # (--lease-ttl)
INTERVAL = [5]  # (--interval)
FIRST_ROUND = [600.0]  # (--first-round)
LOGS: list[Path | None] = [None]  # (--logs)


def start_node(name: str, etcd: EtcdCluster, work: Path) -> tuple[Proc, str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "healthgate", "serve",
        "--store", etcd.url, "--node", name, "--region", "r1",
        "--listen", f"127.0.0.1:{port}", "--no-dataplane",
        "--probe-failure-log-rate", "0", "--log-level", "warning",
        "--lease-ttl", str(LEASE_TTL[0]),
    ]  # fmt: skip
    return Proc(cmd, work / f"node-{name}.log"), f"http://127.0.0.1:{port}"


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def probing_run(
    count: int, nodes: int, work: Path, duration: float, settle: float
) -> dict[str, Any]:
    """``nodes`` nodes over a fresh 3-member etcd probing ``count`` endpoints."""
    etcd = EtcdCluster(work, 3, ("--quota-backend-bytes", str(4 << 30)))
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # every 127.x.y.z of the port, and only from loopback: the wildcard
    # address, tied to the loopback device (nothing from outside reaches it)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")
    listener.bind(("0.0.0.0", 0))
    listener.listen(4096)
    port = listener.getsockname()[1]
    threading.Thread(target=_accept_forever, args=(listener,), daemon=True).start()
    procs: list[tuple[Proc, str]] = []
    store = EtcdStore(etcd.endpoints)
    try:
        procs = [start_node(f"n{i}", etcd, work) for i in range(nodes)]
        for _proc, url in procs:
            wait_until(_ready_check(url), 60, f"{url} ready")
        api = procs[0][1]
        applying = time.monotonic()
        for docs in world(count, port, INTERVAL[0]):
            r = httpx.post(
                api + "/v1/apply", json={"manifest": yaml.safe_dump_all(docs)}, timeout=120
            )
            if r.status_code != 200:
                raise RuntimeError(f"apply refused: {r.text[:500]}")
        applied = time.monotonic() - applying
        # the first round: every endpoint UNKNOWN -> HEALTHY, written and logged
        began = time.monotonic()
        wait_until(
            lambda: _all_healthy(api, count), FIRST_ROUND[0], "every endpoint HEALTHY", every=1.0
        )
        first_round = time.monotonic() - began
        _wait_quiet(store, settle)
        rev0 = store.revision()
        c0 = [cpu_seconds(p.p.pid) for p, _ in procs]
        n0 = [metric(u, "healthgate_probes_started_total") for _, u in procs]
        t0 = time.monotonic()
        time.sleep(duration)
        c1 = [cpu_seconds(p.p.pid) for p, _ in procs]
        n1 = [metric(u, "healthgate_probes_started_total") for _, u in procs]
        elapsed = time.monotonic() - t0
        rev1 = store.revision()
        cpu = sum(c1) - sum(c0)
        checks = sum(n1) - sum(n0)
        return {
            "nodes": nodes,
            "endpoints": count,
            "checks_per_s": checks / elapsed,
            "us_per_check": cpu / max(checks, 1) * 1e6,
            "cpu_per_node": [round((b - a) / elapsed, 3) for a, b in zip(c0, c1, strict=True)],
            "probing": [
                httpx.get(u + "/v1/cluster", timeout=10).json()["probing"] for _, u in procs
            ],
            "etcd_writes_per_s": (rev1 - rev0) / elapsed,
            "rss_mb": [round(rss_mb(p.p.pid), 1) for p, _ in procs],
            "applied_s": round(applied, 1),  # the world's applies, one after another
            "first_round_s": round(first_round, 1),  # applied -> every endpoint HEALTHY
            "slowest_poll_s": round(SLOWEST[0], 1),  # the API's slowest answer meanwhile
        }
    finally:
        for proc, _ in procs:
            proc.stop()
        if LOGS[0] is not None:  # (--logs: the nodes' logs kept)
            LOGS[0].mkdir(parents=True, exist_ok=True)
            for log_file in work.glob("node-*.log"):
                shutil.copy(log_file, LOGS[0] / f"{work.name}-{log_file.name}")
        store.close()
        listener.close()
        etcd.close()


def _accept_forever(listener: socket.socket) -> None:
    """Every connection a check makes, accepted and closed (the endpoint's side)."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # the listener was closed: the run is over
        conn.close()


def _ready_check(url: str) -> Callable[[], bool]:
    return lambda: _ready(url)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


SLOWEST = [0.0]  # the slowest answer of the polls below (seconds)
PROGRESS = [0.0]  # when progress was last printed


def _all_healthy(url: str, count: int) -> bool:
    """From the backend service's counts (its health list of every endpoint
    would be a 10 MB answer at 100,000, and polling it loads the node). A
    poll that times out is "not yet" (and the slowest answer is kept): a
    million endpoints' first round keeps two shared cores busy."""
    began = time.monotonic()
    try:
        body = httpx.get(url + "/v1/projects/bench/regions/r1/backendServices/bs", timeout=120)
    except httpx.TimeoutException:
        SLOWEST[0] = max(SLOWEST[0], time.monotonic() - began)
        print(f"  (no answer from {url} within 120 s)", file=sys.stderr, flush=True)
        return False
    SLOWEST[0] = max(SLOWEST[0], time.monotonic() - began)
    status = body.json().get("status") or {}
    if time.monotonic() - PROGRESS[0] >= 30:
        PROGRESS[0] = time.monotonic()
        print(
            f"  {time.strftime('%H:%M:%S')} {status.get('healthy')} of {status.get('endpoints')} "
            f"HEALTHY (slowest answer so far {SLOWEST[0]:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    return bool(status.get("endpoints") == count and status.get("healthy") == count)


def _wait_quiet(store: EtcdStore, settle: float) -> None:
    """Until etcd's revision has not moved for ``settle`` seconds (the first
    round's writes are done), at most 5 minutes."""
    deadline = time.monotonic() + 300
    last, since = store.revision(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = store.revision()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= settle:
            return


def route_lags(work: Path, flips: int) -> list[float]:
    stack = ClusterStack(work, lease_ttl=2)
    try:
        stack.start()
        stack.heal_all()
        for _ in range(flips):
            for mode, region in (("refuse", "europe-west1"), ("ok", "us-east1")):
                stack.backends.set_mode("us-east1", mode)
                wait_for(
                    lambda r=region: all(stack.route_target(n) == r for n in stack.live()),
                    20,
                    what=f"route to {region}",
                )
        lags: list[float] = []
        for node in stack.live():
            lags += node.cluster()["routeLags"]
        return lags
    finally:
        stack.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoints", type=int, default=100_000)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument(
        "--single", type=int, default=20_000, help="endpoints of the one-node run (0: none)"
    )
    ap.add_argument(
        "--interval",
        type=int,
        default=5,
        help="checkIntervalSec of every endpoint, 1-50 (5; a million endpoints need 50 on "
        "two cores)",
    )
    ap.add_argument(
        "--first-round",
        type=float,
        default=600.0,
        help="seconds the world may take to become HEALTHY after its applies (600)",
    )
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--flips", type=int, default=10)
    ap.add_argument("--skip-probing", action="store_true")
    ap.add_argument(
        "--lease-ttl",
        type=int,
        default=5,
        help="the nodes' (serve's default 5; four nodes and three etcd members on two "
        "cores may starve a node's loop past it while the world loads)",
    )
    ap.add_argument("--logs", type=Path, help="keep the nodes' logs in this directory")
    args = ap.parse_args()
    LOGS[0] = args.logs
    LEASE_TTL[0] = args.lease_ttl
    if not 1 <= args.interval <= 50:
        ap.error(f"--interval: checkIntervalSec is 1 to 50 (got {args.interval})")
    INTERVAL[0] = args.interval
    FIRST_ROUND[0] = args.first_round
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hg-bench-cluster-") as tmp:
        work = Path(tmp)
        if not args.skip_probing:
            many = probing_run(
                args.endpoints, args.nodes, work / "many", args.duration, args.settle
            )
            out["cluster"] = many
            print(json.dumps(many))
            print(
                f"\n{args.nodes} nodes x {args.endpoints:,} endpoints (every {args.interval} s): "
                f"applied in {many['applied_s']:.0f} s, HEALTHY {many['first_round_s']:.0f} s later "
                f"(the API's slowest answer meanwhile {many['slowest_poll_s']:.1f} s), "
                f"{many['checks_per_s']:,.0f} checks/s, {many['us_per_check']:.1f} us/check, "
                f"etcd writes at steady state {many['etcd_writes_per_s']:.2f}/s (goal: 0), "
                f"memory per node (MB) {many['rss_mb']}"
            )
            if args.single:
                one = probing_run(args.single, 1, work / "one", args.duration, args.settle)
                out["single"] = one
                ratio = many["us_per_check"] / one["us_per_check"]
                print(json.dumps(one))
                print(
                    f"probing, CPU per check: 1 node x {args.single:,} endpoints "
                    f"{one['us_per_check']:.1f} us; {args.nodes} nodes x {args.endpoints:,} "
                    f"{many['us_per_check']:.1f} us -> {ratio:.2f}x (goal <= 1.2x); "
                    f"etcd writes at steady state {one['etcd_writes_per_s']:.2f}/s (1 node); "
                    f"memory (MB) 1 node {one['rss_mb']}"
                )
        lags = sorted(route_lags(work / "lags", args.flips)) if args.flips else []
        if lags:
            p50 = statistics.median(lags) * 1000
            p99 = lags[min(len(lags) - 1, int(len(lags) * 0.99))] * 1000
            print(
                f"prober flip -> route change on every node: {len(lags)} changes, "
                f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, worst {lags[-1] * 1000:.1f} ms "
                f"(goal p99 <= 20 ms)"
            )


if __name__ == "__main__":
    main()
