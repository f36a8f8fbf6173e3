"""Does a large apply stall traffic? Front-end latency and late probe starts
while ``serve`` plans a multi-megabyte ``apply --dry-run``.

One ``healthgate serve`` holds a small two-region world (real backends on
loopback, probed every second) whose consumer front end a client keeps
requesting; meanwhile a manifest of ``--mb`` megabytes is posted as a dry run,
``--applies`` times. Printed: the dry run's duration, the front end's request
latency (p50 / p99 / max) during the applies and before them, and how many
probes started late (more than 10 ms after due) in each window.

    python bench/apply_stall.py --mb 5 --applies 2
    python bench/apply_stall.py --src /path/to/other/checkout/src   # another version

``--src`` runs ``serve`` from another checkout (to compare before / after).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from common import free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent


def big_manifest(target_bytes: int, project: str = "bulk") -> str:
    """Producer stacks (check, NEG of 60 endpoints, backend service, policy,
    source, composite, forwarding rule, attachment) until ``target_bytes``."""
    docs: list[str] = []
    size = 0
    i = 0
    while size < target_bytes:
        region = f"region-{i % 50}"
        n = f"svc-{i}"
        a, b = divmod(i, 250)
        stack: list[dict[str, Any]] = [
            {
                "kind": "HealthCheck",
                "name": n,
                "project": project,
                "region": region,
                "type": "HTTP",
                "port": 8080,
                "requestPath": "/healthz",
            },
            {
                "kind": "NetworkEndpointGroup",
                "name": n,
                "project": project,
                "region": region,
                "networkEndpointType": "GCE_VM_IP_PORT",
                "endpoints": [
                    {"ipAddress": f"10.{a}.{b}.{k + 1}", "port": 8080} for k in range(60)
                ],
            },
            {
                "kind": "BackendService",
                "name": n,
                "project": project,
                "region": region,
                "loadBalancingScheme": "INTERNAL_MANAGED",
                "healthChecks": [n],
                "backends": [{"group": f"networkEndpointGroups/{n}"}],
            },
            {"kind": "HealthAggregationPolicy", "name": n, "project": project, "region": region},
            {
                "kind": "HealthSource",
                "name": n,
                "project": project,
                "region": region,
                "sources": [f"backendServices/{n}"],
                "healthAggregationPolicy": n,
            },
            {
                "kind": "ForwardingRule",
                "name": n,
                "project": project,
                "region": region,
                "IPAddress": f"10.{a}.{b}.200",
                "ports": [80],
                "loadBalancingScheme": "INTERNAL_MANAGED",
                "backendService": n,
            },
            {
                "kind": "CompositeHealthCheck",
                "name": n,
                "project": project,
                "region": region,
                "healthSources": [n],
                "healthDestination": n,
            },
        ]
        text = yaml.safe_dump_all(stack, sort_keys=False)
        docs.append(text)
        size += len(text) + 4
        i += 1
    return "---\n".join(docs)


class FrontEndClient(threading.Thread):
    """Plain keep-alive GETs to the front end, one at a time; latencies kept
    with the time each was sent."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.samples: list[tuple[float, float]] = []  # (sent at, seconds)
        self.errors = 0
        self.stop = threading.Event()

    def run(self) -> None:
        request = b"GET / HTTP/1.1\r\nHost: front\r\n\r\n"
        sock: socket.socket | None = None
        while not self.stop.is_set():
            try:
                if sock is None:
                    sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
                t0 = time.perf_counter()
                sock.sendall(request)
                data = b""
                while b"\r\n\r\n" not in data or not _complete(data):
                    chunk = sock.recv(65536)
                    if not chunk:
                        raise ConnectionError("closed")
                    data += chunk
                self.samples.append((t0, time.perf_counter() - t0))
            except OSError:
                self.errors += 1
                if sock is not None:
                    sock.close()
                sock = None
                time.sleep(0.01)
            time.sleep(0.002)
        if sock is not None:
            sock.close()


def _complete(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return True


def late_and_started(api: httpx.Client) -> tuple[float, float]:
    text = api.get("/metrics").text
    late = started = 0.0
    for line in text.splitlines():
        if line.startswith("healthgate_probes_late_total "):
            late = float(line.split()[1])
        elif line.startswith("healthgate_probes_started_total "):
            started = float(line.split()[1])
    return late, started


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"n": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return {
        "n": len(values),
        "p50_ms": round(statistics.median(values) * 1000, 2),
        "p99_ms": round(p99 * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


def world(backend_port: int, front_port: int, prod_ports: tuple[int, int]) -> str:
    from tests.e2e.harness import e2e_world

    return yaml.safe_dump_all(e2e_world(backend_port, front_port, prod_ports), sort_keys=False)


def measure(mb: float, applies: int, src: str | None, quiet_s: float = 8.0) -> dict[str, Any]:
    """(``quiet_s``: past serve's start-up, whose second heap freeze comes
    once the first probes have decided every endpoint - 5 s here.)"""
    from tests.e2e.harness import Backends

    work = Path(tempfile.mkdtemp(prefix="apply-stall-"))
    backend_port, front_port = free_port(), free_port()
    prod = (free_port("127.0.1.100"), free_port("127.0.2.100"))
    manifest_path = work / "world.yaml"
    manifest_path.write_text(world(backend_port, front_port, prod))
    big = big_manifest(int(mb * 1024 * 1024))
    api_port = free_port()
    env = {**os.environ, "PYTHONPATH": src or str(ROOT / "src")}
    cmd = [
        sys.executable,
        "-m",
        "healthgate",
        "serve",
        "--db",
        str(work / "hg.db"),
        "--listen",
        f"127.0.0.1:{api_port}",
        "-f",
        str(manifest_path),
        "--probe-failure-log-rate",
        "0",
    ]
    out: dict[str, Any] = {"manifest_bytes": len(big.encode())}
    with Backends(backend_port), open(work / "serve.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            api = httpx.Client(base_url=f"http://127.0.0.1:{api_port}", timeout=120)

            def ready() -> bool:
                try:
                    r = api.get("/v1/projects/web/global/forwardingRules/shop-frontend")
                    return r.status_code == 200 and "shop-" in r.text and "target" in r.text
                except httpx.HTTPError:
                    return False

            wait_until(ready, 60, "serve ready with a route")
            # one small dry run first: the first request of an endpoint imports
            # and inspects code once (~100 ms), which is not what is measured
            api.post(
                "/v1/apply?dryRun=true",
                content=big_manifest(10_000),
                headers={"Content-Type": "application/yaml"},
            )
            client = FrontEndClient(front_port)
            client.start()
            time.sleep(quiet_s)
            quiet_end = time.perf_counter()
            late0, started0 = late_and_started(api)
            durations = []
            windows = []
            for _ in range(applies):
                t0 = time.perf_counter()
                resp = api.post(
                    "/v1/apply?dryRun=true",
                    content=big,
                    headers={"Content-Type": "application/yaml"},
                )
                t1 = time.perf_counter()
                if resp.status_code != 200:
                    raise RuntimeError(f"dry run answered {resp.status_code}: {resp.text[:500]}")
                durations.append(round(t1 - t0, 3))
                windows.append((t0, t1))
            late1, started1 = late_and_started(api)
            time.sleep(0.5)
            client.stop.set()
            client.join(10)
            during = [s for t, s in client.samples if any(a <= t <= b for a, b in windows)]
            before = [s for t, s in client.samples if t < quiet_end]
            out.update(
                dry_run_seconds=durations,
                latency_during=percentiles(during),
                latency_before=percentiles(before),
                client_errors=client.errors,
                probes_started_during=started1 - started0,
                probes_late_during=late1 - late0,
            )
        finally:
            proc.terminate()
            proc.wait(15)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=5.0)
    parser.add_argument("--applies", type=int, default=2)
    parser.add_argument("--src", help="run serve from this src/ directory instead")
    parser.add_argument("--json", help="write the result here too")
    args = parser.parse_args()
    result = measure(args.mb, args.applies, args.src)
    d, b = result["latency_during"], result["latency_before"]
    print(
        f"manifest: {result['manifest_bytes'] / 1e6:.1f} MB, dry runs took {result['dry_run_seconds']} s"
    )
    print(
        f"front end before:  p50 {b['p50_ms']} ms  p99 {b['p99_ms']} ms  max {b['max_ms']} ms  ({b['n']} requests)"
    )
    print(
        f"front end during:  p50 {d['p50_ms']} ms  p99 {d['p99_ms']} ms  max {d['max_ms']} ms  ({d['n']} requests)"
    )
    print(
        f"probes during the dry runs: {result['probes_started_during']:.0f} started, "
        f"{result['probes_late_during']:.0f} late (> 10 ms); client errors: {result['client_errors']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
