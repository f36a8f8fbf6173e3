"""Data-plane throughput, side by side: HAProxy, nginx and healthgate, same backend.

    python bench/dataplane.py                  # ~2 minutes
    python bench/dataplane.py --duration 10 --repeats 3

One nginx backend (`return 200`, and a 256 MB file for bulk transfers) runs
with wrk on core 0; the proxy under test runs alone on core 1:

* HAProxy (nbthread 1): `mode http` for requests, `mode tcp` for requests
  through a TCP proxy (the L4 hop's peer) and for the bulk transfer;
* nginx (1 worker, upstream keepalive 64);
* healthgate serve: the producer forwarding rule (one L4 hop over the backend
  service's healthy endpoints); and the consumer front end (L7 HTTP with
  retries), whose route reaches the same backend through the published rule
  (done in-process: the front end balances over that rule's healthy endpoints).

HTTP: wrk -t1 -c50 keep-alive, requests/s, p99 latency, and the proxy's CPU
time per request (utime + stime of its processes over the run: a second
view of the same ratio; both vary by 10-30 % between runs on these VMs).
TCP bulk: one client downloads the 256 MB file through each L4 proxy, MB/s.
Ratios are to HAProxy. Goals (issue 6): one healthgate hop >= 0.75x HAProxy's
requests/s, TCP bulk >= 0.9x HAProxy's throughput; (issue 31) the L7 front
end >= 1.0x HAProxy mode http, the L4 hop >= 1.0x HAProxy mode tcp.

A second healthgate serve (``--passive``, on by default) runs the same world
with SPEC §8's real-traffic evidence on: the producer backend service has
``outlierDetection`` and its composite a TRAFFIC health source; its front
end and L4 hop are measured in the same repeats, and their ratios printed
to HAProxy and to the first serve (issue 40: >= 1.0x HAProxy, >= 0.97x of
itself with them off).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Proc, cpu_seconds, free_port, pinned, wait_port, wait_until

HERE = Path(__file__).resolve().parent


FAST = {"checkIntervalSec": 1, "timeoutSec": 1, "healthyThreshold": 2, "unhealthyThreshold": 2}


def published_region(
    region: str,
    be_port: int,
    fr_ip: str,
    fr_port: int,
    check: dict[str, Any],
    passive: bool = False,
) -> list[dict[str, Any]]:
    """One region of project "bench" serving the nginx backend, published
    through a composite and an attachment, and project "c"'s PSC NEG for it;
    with ``passive``, outlier detection and a TRAFFIC source too (SPEC §8)."""
    base = {"project": "bench", "region": region}
    extra: list[dict[str, Any]] = []
    if passive:
        extra.append(
            {
                **base,
                "kind": "HealthSource",
                "name": "traffic",
                "sourceType": "TRAFFIC",
                "sources": ["web"],
                "trafficPolicy": {"windowSec": 10},
            }
        )
    return [
        *extra,
        {**base, "kind": "HealthCheck", "name": "hc", **check},
        {
            **base,
            "kind": "NetworkEndpointGroup",
            "name": "neg",
            "networkEndpointType": "GCE_VM_IP_PORT",
            "endpoints": [{"ipAddress": "127.0.0.1", "port": be_port}],
        },
        {
            **base,
            "kind": "BackendService",
            "name": "web",
            "loadBalancingScheme": "INTERNAL_MANAGED",
            "protocol": "HTTP",
            "healthChecks": ["hc"],
            "backends": [{"group": "neg"}],
            **({"outlierDetection": {"failurePercentageThreshold": 50}} if passive else {}),
        },
        {**base, "kind": "HealthAggregationPolicy", "name": "pol"},
        {
            **base,
            "kind": "HealthSource",
            "name": "src",
            "sources": ["web"],
            "healthAggregationPolicy": "pol",
        },
        {
            **base,
            "kind": "ForwardingRule",
            "name": "fr",
            "IPAddress": fr_ip,
            "ports": [fr_port],
            "loadBalancingScheme": "INTERNAL_MANAGED",
            "backendService": "web",
        },
        {
            **base,
            "kind": "CompositeHealthCheck",
            "name": "chc",
            "healthSources": ["src", "traffic"] if passive else ["src"],
            "healthDestination": "fr",
        },
        {**base, "kind": "ServiceAttachment", "name": "sa", "targetService": "fr"},
        {
            "project": "c",
            "region": region,
            "kind": "NetworkEndpointGroup",
            "name": "psc",
            "networkEndpointType": "PRIVATE_SERVICE_CONNECT",
            "pscTargetService": f"projects/bench/regions/{region}/serviceAttachments/sa",
        },
    ]


def bench_world(
    be_port: int, prod_port: int, front_port: int, prod_ip: str = "127.0.9.100",
    passive: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    """Region r1 publishing the nginx backend at ``prod_ip:prod_port``, and
    project "c"'s front end on ``front_port`` over it."""
    check = {"type": "TCP", "port": be_port, "checkIntervalSec": 5}
    return [
        *published_region("r1", be_port, prod_ip, prod_port, check, passive),
        {
            "project": "c",
            "kind": "BackendService",
            "name": "front",
            "loadBalancingScheme": "EXTERNAL_MANAGED",
            "protocol": "HTTP",
            "backends": [{"group": "regions/r1/networkEndpointGroups/psc"}],
        },
        {
            "project": "c",
            "kind": "ForwardingRule",
            "name": "front",
            "IPAddress": "127.0.0.1",
            "portRange": str(front_port),
            "loadBalancingScheme": "EXTERNAL_MANAGED",
            "backendService": "front",
            "dataPlaneRegion": "r1",
        },
    ]


def start_serve(work: Path, name: str, manifest: Path, api: int, workers: int) -> Proc:
    """healthgate serve on the proxy core, its listeners from ``manifest``."""
    return Proc(
        pinned(
            [sys.executable, "-m", "healthgate", "serve", "--db", str(work / f"{name}.db"),
             "--listen", f"127.0.0.1:{api}", "-f", str(manifest), "--log-level", "warning",
             "--dataplane-workers", str(workers)],
            1,
        ),
        work / f"{name}.log",
    )  # fmt: skip


def nginx_conf(work: Path, name: str, body: str) -> Path:
    conf = work / f"{name}.conf"
    conf.write_text(f"""daemon off; worker_processes 1; pid {work}/{name}.pid; error_log {work}/{name}.err warn;
events {{ worker_connections 4096; }}
http {{ access_log off; client_body_temp_path {work}; proxy_temp_path {work}; fastcgi_temp_path {work};
  uwsgi_temp_path {work}; scgi_temp_path {work}; keepalive_requests 1000000;
{body}
}}
""")
    return conf


def start_nginx(work: Path, name: str, body: str, cpu: int) -> Proc:
    """nginx with ``body`` in its http block, pinned to ``cpu``, logging to NAME.log."""
    return Proc(
        pinned(["nginx", "-c", str(nginx_conf(work, name, body))], cpu), work / f"{name}.log"
    )


def missing(*tools: str) -> bool:
    """Say which of ``tools`` is not installed (and how to install it)."""
    for tool in tools:
        if not shutil.which(tool):
            print(f"{tool} is not installed: apt-get install -y {' '.join(tools)}", file=sys.stderr)
            return True
    return False


def region_backends(work: Path, regions: Sequence[str]) -> tuple[dict[str, int], Proc]:
    """One nginx on core 0 answering ``region=R`` on a free port per region,
    once every port listens: the ports, and the process to stop."""
    be = {r: free_port() for r in regions}
    servers = "".join(
        f'\n  server {{ listen 127.0.0.1:{be[r]}; location / {{ return 200 "region={r}\\n"; }} }}'
        for r in regions
    )
    proc = start_nginx(work, "backends", servers, 0)
    try:
        for port in be.values():
            wait_port(port)
    except BaseException:
        proc.stop()
        raise
    return be, proc


def wait_healthy(api: int, backend_service: str, timeout: float = 30) -> None:
    """Until the backend service's endpoint is HEALTHY (its first health
    checks), so that the proxies balance over healthy endpoints, as in use."""
    import httpx

    def healthy() -> bool:
        doc = httpx.get(f"http://127.0.0.1:{api}/v1/{backend_service}", timeout=5).json()
        return bool(doc.get("status", {}).get("healthy"))

    wait_until(healthy, timeout, f"{backend_service} not HEALTHY within {timeout:g} s", every=0.2)


def wrk(
    url: str, duration: float, conns: int, headers: tuple[str, ...] = ()
) -> tuple[float, float]:
    extra = [a for h in headers for a in ("-H", h)]
    out = subprocess.run(
        pinned(["wrk", "-t1", f"-c{conns}", f"-d{int(duration)}s", "--latency", *extra, url], 0),
        capture_output=True,
        text=True,
        timeout=duration + 60,
        check=True,
    ).stdout
    # a fast wrong answer is no answer: every response a 2xx, no socket errors
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors:.*", out)
    if bad or errors:
        raise SystemExit(f"{url}: not every request was answered well:\n{out}")
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    m = re.search(r"99%\s+([\d.]+)(us|ms|s)", out)
    assert m, out
    p99 = float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]
    return rps, p99


def bulk(host: str, port: int, path: str, size: int) -> float:
    """Download ``path`` through a proxy; MB/s."""
    start = time.monotonic()
    got = 0
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n".encode())
        while chunk := s.recv(1 << 20):
            got += len(chunk)
    assert got >= size, (got, size)
    return got / (time.monotonic() - start) / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--conns", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--flips",
        type=int,
        default=6,
        help="failovers + failbacks for the propagation test (0: skip)",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=0,
        help="healthgate serve --dataplane-workers N (pinned to the proxy core like the rest: "
        "this measures the worker path and its propagation, not two cores)",
    )
    ap.add_argument(
        "--passive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure a serve with outlier detection and a TRAFFIC source on (SPEC 8)",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    if missing("haproxy", "nginx", "wrk"):
        return 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        big = work / "big.bin"
        size = 256 * 1024 * 1024
        with open(big, "wb") as f:
            f.truncate(size)
        be_port = free_port()
        backend = start_nginx(
            work,
            "backend",
            f"""
  server {{ listen 127.0.0.1:{be_port}; location / {{ return 200 "ok"; }} location /big {{ alias {big}; }} }}""",
            0,
        )
        procs = [backend]
        try:
            wait_port(be_port)
            ha_http, ha_tcp, ng_port = free_port(), free_port(), free_port()
            ha_cfg = work / "haproxy.cfg"
            ha_cfg.write_text(f"""global
  nbthread 1
  maxconn 4000
defaults
  timeout connect 1s
  timeout client 30s
  timeout server 30s
frontend web
  mode http
  bind 127.0.0.1:{ha_http}
  default_backend be
backend be
  mode http
  http-reuse always
  server s 127.0.0.1:{be_port}
frontend bulk
  mode tcp
  bind 127.0.0.1:{ha_tcp}
  default_backend betcp
backend betcp
  mode tcp
  server s 127.0.0.1:{be_port}
""")
            haproxy = Proc(pinned(["haproxy", "-db", "-f", str(ha_cfg)], 1), work / "haproxy.log")
            procs.append(haproxy)
            procs.append(
                nginx := start_nginx(
                    work,
                    "proxy",
                    f"""
  upstream be {{ server 127.0.0.1:{be_port}; keepalive 64; }}
  server {{ listen 127.0.0.1:{ng_port}; location / {{ proxy_pass http://be; proxy_http_version 1.1;
    proxy_set_header Connection ""; }} }}""",
                    1,
                )
            )
            hg_front, hg_prod, hg_api = free_port(), free_port("127.0.9.100"), free_port()
            manifest = work / "hg.yaml"
            manifest.write_text(yaml.safe_dump_all(bench_world(be_port, hg_prod, hg_front)))
            procs.append(serve := start_serve(work, "hg", manifest, hg_api, args.workers))
            for port in (ha_http, ng_port, hg_front, hg_api):
                wait_port(port)
            wait_port(hg_prod, "127.0.9.100")
            wait_healthy(hg_api, "projects/bench/regions/r1/backendServices/web")
            passive: list[tuple[str, str, Proc]] = []
            if args.passive:  # the same world with SPEC §8's evidence on, in its own serve
                p_front, p_prod, p_api = free_port(), free_port("127.0.9.101"), free_port()
                p_manifest = work / "hg-passive.yaml"
                p_manifest.write_text(
                    yaml.safe_dump_all(
                        bench_world(be_port, p_prod, p_front, "127.0.9.101", passive=True)
                    )
                )
                procs.append(
                    p_serve := start_serve(work, "hg-passive", p_manifest, p_api, args.workers)
                )
                for port in (p_front, p_api):
                    wait_port(port)
                wait_port(p_prod, "127.0.9.101")
                wait_healthy(p_api, "projects/bench/regions/r1/backendServices/web")
                passive = [
                    ("healthgate L4 hop, passive on", f"http://127.0.9.101:{p_prod}/", p_serve),
                    ("healthgate front end (L7), passive on", f"http://127.0.0.1:{p_front}/",
                     p_serve),
                ]  # fmt: skip
            targets = [  # name, URL, the proxy's process (with its children)
                ("haproxy", f"http://127.0.0.1:{ha_http}/", haproxy),
                # (the L4 hop's peer: HAProxy in mode tcp, each client connection
                # one upstream connection, as the hop does)
                ("haproxy mode tcp", f"http://127.0.0.1:{ha_tcp}/", haproxy),
                ("nginx", f"http://127.0.0.1:{ng_port}/", nginx),
                ("healthgate L4 hop", f"http://127.0.9.100:{hg_prod}/", serve),
                ("healthgate front end (L7)", f"http://127.0.0.1:{hg_front}/", serve),
                *passive,
            ]
            for repeat in range(args.repeats):
                for name, url, proc in targets:
                    cpu0 = cpu_seconds(proc.p.pid, children=True)
                    rps, p99 = wrk(url, args.duration, args.conns)
                    cpu = cpu_seconds(proc.p.pid, children=True) - cpu0
                    rows.append(
                        {
                            "test": "http",
                            "repeat": repeat,
                            "proxy": name,
                            "rps": rps,
                            "p99_ms": p99,
                            "cpu_us_per_request": cpu / (rps * int(args.duration)) * 1e6,
                        }
                    )
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                for name, host, port in (
                    ("haproxy", "127.0.0.1", ha_tcp),
                    ("healthgate L4 hop", "127.0.9.100", hg_prod),
                ):
                    mbps = bulk(host, port, "/big", size)
                    rows.append({"test": "tcp-bulk", "repeat": repeat, "proxy": name, "MBps": mbps})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            if args.flips:
                prop = propagation(work, be_port, hg_api, hg_front, manifest, args.flips)
                rows.append({"test": "propagation", **prop})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            for p in reversed(procs):
                p.stop()
    print(
        f"{'test':<9} {'proxy':<32} {'req/s':>9} {'p99 ms':>7} {'MB/s':>8} {'x HAProxy':>9}"
        f" {'CPU us/req':>10} {'x HAProxy by CPU':>16}"
    )
    for test in ("http", "tcp-bulk"):
        group = [r for r in rows if r["test"] == test]
        key = "rps" if test == "http" else "MBps"
        # ratios are taken within each repeat (HAProxy's run a few seconds
        # before), then their median: the machine's speed drifts by more
        # than the differences measured over the minutes of a whole run
        reference = {r["repeat"]: r for r in group if r["proxy"] == "haproxy"}
        for proxy in dict.fromkeys(r["proxy"] for r in group):
            vals = [r for r in group if r["proxy"] == proxy]
            v = _median([r[key] for r in vals])
            p99 = _median([r.get("p99_ms", 0.0) for r in vals])
            ratio = _median([r[key] / reference[r["repeat"]][key] for r in vals])
            line = (
                f"{test:<9} {proxy:<32} {v if test == 'http' else 0:>9.0f} {p99:>7.2f}"
                f" {v if test != 'http' else 0:>8.0f} {ratio:>9.2f}"
            )
            if test == "http":
                us = _median([r["cpu_us_per_request"] for r in vals])
                by_cpu = _median(
                    [
                        reference[r["repeat"]]["cpu_us_per_request"] / r["cpu_us_per_request"]
                        for r in vals
                    ]
                )
                line += f" {us:>10.1f} {by_cpu:>16.2f}"
                if len(vals) > 1:
                    line += (
                        "  (per repeat: "
                        + " ".join(f"{r[key] / reference[r['repeat']][key]:.2f}" for r in vals)
                        + ")"
                    )
            print(line)
    http = [r for r in rows if r["test"] == "http"]
    by = {(r["repeat"], r["proxy"]): r for r in http}
    l4 = [
        by[(r["repeat"], "healthgate L4 hop")]["rps"] / r["rps"]
        for r in http
        if r["proxy"] == "haproxy mode tcp" and (r["repeat"], "healthgate L4 hop") in by
    ]
    if l4:
        print(
            f"L4 hop x HAProxy mode tcp (requests/s, median of {len(l4)}): {_median(l4):.2f}"
            f"  (per repeat: {' '.join(f'{x:.2f}' for x in l4)})"
        )
    for on, off, peer in (
        ("healthgate front end (L7), passive on", "healthgate front end (L7)", "haproxy"),
        ("healthgate L4 hop, passive on", "healthgate L4 hop", "haproxy mode tcp"),
    ):
        pairs = [
            (by[(r["repeat"], on)]["rps"], r["rps"], by[(r["repeat"], peer)]["rps"])
            for r in http
            if r["proxy"] == off and (r["repeat"], on) in by and (r["repeat"], peer) in by
        ]
        if pairs:
            itself = [a / b for a, b, _ in pairs]
            vs_peer = [a / c for a, _, c in pairs]
            print(
                f"{on}: x itself with them off {_median(itself):.2f} "
                f"(per repeat: {' '.join(f'{x:.2f}' for x in itself)}), x {peer} "
                f"{_median(vs_peer):.2f} (median of {len(pairs)})"
            )
    for r in rows:
        if r["test"] == "propagation":
            print(
                f"propagation (route change -> first request routed by it), {r['observations']} observations "
                f"over {r['flips']} failovers/failbacks under load: p50 <= {r['p50_le_ms']} ms, "
                f"p99 <= {r['p99_le_ms']} ms, mean {r['mean_ms']:.3f} ms"
            )
    print(
        "\n'x HAProxy' columns are medians of the ratios within each repeat; 'x HAProxy by CPU'"
        " is HAProxy's CPU per request over the proxy's: the requests/s each would reach alone"
        " on a core.\n"
        "goals: one healthgate hop >= 0.75x HAProxy's requests/s on one core; TCP bulk >= 0.9x HAProxy's throughput; "
        "propagation p99 <= 5 ms; issue 31: the L7 front end >= 1.0x HAProxy, the L4 hop >= 1.0x HAProxy mode tcp"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def propagation(
    work: Path, be_port: int, api: int, front: int, manifest: Path, flips: int
) -> dict[str, Any]:
    """Add a second region, then fail the first over and back ``flips`` times
    under wrk load by stopping and starting its health endpoint; read
    healthgate_route_propagation_seconds before and after."""
    import httpx

    health_port = free_port()
    docs = list(yaml.safe_load_all(manifest.read_text()))
    for d in docs:
        if d["kind"] == "HealthCheck":  # r1's health now depends on a server we can stop
            d.update(type="HTTP", port=health_port, requestPath="/", **FAST)
        if d["kind"] == "BackendService" and d["project"] == "c":
            d["backends"].append({"group": "regions/r2/networkEndpointGroups/psc"})
    docs += published_region(
        "r2",
        be_port,
        "127.0.9.101",
        free_port("127.0.9.101"),
        {"type": "TCP", "port": be_port, **FAST},
    )
    url = f"http://127.0.0.1:{api}"
    health = None

    def start_health() -> Proc:
        p = Proc(
            [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(health_port)],
            work / "health.log",
        )
        wait_port(health_port)
        return p

    def target() -> str:
        route = httpx.get(f"{url}/v1/projects/c/global/forwardingRules/front", timeout=5).json()[
            "status"
        ]["route"]
        return str(route["target"]).split("/")[3]

    def wait_target(region: str) -> None:
        wait_until(lambda: target() == region, 20, f"route to {region}", every=0.05)

    def histogram() -> tuple[dict[str, float], float]:
        buckets, total = {}, 0.0
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("healthgate_route_propagation_seconds_bucket"):
                buckets[line.split('le="')[1].split('"')[0]] = float(line.split()[-1])
            elif line.startswith("healthgate_route_propagation_seconds_sum"):
                total = float(line.split()[-1])
        return buckets, total

    health = start_health()
    load = subprocess.Popen(
        pinned(["wrk", "-t1", "-c10", "-d300s", f"http://127.0.0.1:{front}/"], 0),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        httpx.post(
            f"{url}/v1/apply", json={"manifest": yaml.safe_dump_all(docs)}, timeout=30
        ).raise_for_status()
        wait_target("r1")
        time.sleep(2)
        before, sum0 = histogram()
        for i in range(flips):
            if i % 2 == 0:
                health.stop()
                wait_target("r2")
            else:
                health = start_health()
                wait_target("r1")
            time.sleep(0.5)
        time.sleep(1.5)  # worker processes report their counters once a second
        after, sum1 = histogram()
    finally:
        load.terminate()
        load.wait(10)
        health.stop()
    delta = {le: after[le] - before.get(le, 0.0) for le in after}
    count = delta.get("+Inf", 0.0)

    def quantile(q: float) -> str:
        for le, n in delta.items():
            if count and n >= q * count:
                return "inf" if le == "+Inf" else f"{float(le) * 1000:g}"
        return "n/a"

    return {
        "flips": flips,
        "observations": int(count),
        "p50_le_ms": quantile(0.5),
        "p99_le_ms": quantile(0.99),
        "mean_ms": (sum1 - sum0) / count * 1000 if count else 0.0,
    }


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


if __name__ == "__main__":
    sys.exit(main())
