"""Data-plane throughput, side by side: HAProxy, nginx and healthgate, same backend.

    python bench/dataplane.py                  # ~2 minutes
    python bench/dataplane.py --duration 10 --repeats 3

One nginx backend (`return 200`, and a 256 MB file for bulk transfers) runs
with wrk on core 0; the proxy under test runs alone on core 1:

* HAProxy (nbthread 1): `mode http` for requests, `mode tcp` for the bulk transfer;
* nginx (1 worker, upstream keepalive 64);
* healthgate serve: the producer forwarding rule (one L4 hop over the backend
  service's healthy endpoints); and the consumer front end (L7 HTTP with
  retries), whose route reaches the same backend through the published rule
  (done in-process: the front end balances over that rule's healthy endpoints).

HTTP: wrk -t1 -c50 keep-alive, requests/s and p99 latency.
TCP bulk: one client downloads the 256 MB file through each L4 proxy, MB/s.
Ratios are to HAProxy. Goals (issue 6): one healthgate hop >= 0.75x HAProxy's
requests/s, TCP bulk >= 0.9x HAProxy's throughput.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def pinned(cmd: list[str], cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu), *cmd] if shutil.which("taskset") else cmd


def wait_port(port: int, host: str = "127.0.0.1", timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{host}:{port} not listening")


class Proc:
    def __init__(self, cmd: list[str], log: Path) -> None:
        self.log = open(log, "wb")  # noqa: SIM115
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(15)
        self.log.close()


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


def wrk(url: str, duration: float, conns: int) -> tuple[float, float]:
    out = subprocess.run(
        pinned(["wrk", "-t1", f"-c{conns}", f"-d{int(duration)}s", "--latency", url], 0),
        capture_output=True,
        text=True,
        timeout=duration + 60,
        check=True,
    ).stdout
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
    ap.add_argument("--json")
    args = ap.parse_args()
    for tool in ("haproxy", "nginx", "wrk"):
        if not shutil.which(tool):
            print(f"{tool} is not installed: apt-get install -y haproxy nginx wrk", file=sys.stderr)
            return 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        big = work / "big.bin"
        size = 256 * 1024 * 1024
        with open(big, "wb") as f:
            f.truncate(size)
        be_port = free_port()
        backend = Proc(
            pinned(
                [
                    "nginx",
                    "-c",
                    str(
                        nginx_conf(
                            work,
                            "backend",
                            f"""
  server {{ listen 127.0.0.1:{be_port}; location / {{ return 200 "ok"; }} location /big {{ alias {big}; }} }}""",
                        )
                    ),
                ],
                0,
            ),
            work / "backend.log",
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
            procs.append(
                Proc(pinned(["haproxy", "-db", "-f", str(ha_cfg)], 1), work / "haproxy.log")
            )
            procs.append(
                Proc(
                    pinned(
                        [
                            "nginx",
                            "-c",
                            str(
                                nginx_conf(
                                    work,
                                    "proxy",
                                    f"""
  upstream be {{ server 127.0.0.1:{be_port}; keepalive 64; }}
  server {{ listen 127.0.0.1:{ng_port}; location / {{ proxy_pass http://be; proxy_http_version 1.1;
    proxy_set_header Connection ""; }} }}""",
                                )
                            ),
                        ],
                        1,
                    ),
                    work / "nginx.log",
                )
            )
            hg_front, hg_prod, hg_api = free_port(), free_port("127.0.9.100"), free_port()
            manifest = work / "hg.yaml"
            base = {"project": "bench", "region": "r1"}
            manifest.write_text(
                yaml.safe_dump_all(
                    [
                        {
                            **base,
                            "kind": "HealthCheck",
                            "name": "hc",
                            "type": "TCP",
                            "port": be_port,
                            "checkIntervalSec": 5,
                        },
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
                        },
                        {
                            **base,
                            "kind": "ForwardingRule",
                            "name": "fr",
                            "IPAddress": "127.0.9.100",
                            "ports": [hg_prod],
                            "loadBalancingScheme": "INTERNAL_MANAGED",
                            "backendService": "web",
                        },
                        {**base, "kind": "ServiceAttachment", "name": "sa", "targetService": "fr"},
                        {
                            "project": "c",
                            "region": "r1",
                            "kind": "NetworkEndpointGroup",
                            "name": "psc",
                            "networkEndpointType": "PRIVATE_SERVICE_CONNECT",
                            "pscTargetService": "projects/bench/regions/r1/serviceAttachments/sa",
                        },
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
                            "portRange": str(hg_front),
                            "loadBalancingScheme": "EXTERNAL_MANAGED",
                            "backendService": "front",
                        },
                    ]
                )
            )
            procs.append(
                Proc(
                    pinned(
                        [
                            sys.executable,
                            "-m",
                            "healthgate",
                            "serve",
                            "--db",
                            str(work / "hg.db"),
                            "--listen",
                            f"127.0.0.1:{hg_api}",
                            "-f",
                            str(manifest),
                            "--log-level",
                            "warning",
                        ],
                        1,
                    ),
                    work / "hg.log",
                )
            )
            for port in (ha_http, ng_port, hg_front, hg_api):
                wait_port(port)
            wait_port(hg_prod, "127.0.9.100")
            time.sleep(6)  # the backend's first health checks
            targets = [
                ("haproxy", f"http://127.0.0.1:{ha_http}/"),
                ("nginx", f"http://127.0.0.1:{ng_port}/"),
                ("healthgate L4 hop", f"http://127.0.9.100:{hg_prod}/"),
                ("healthgate front end (L7)", f"http://127.0.0.1:{hg_front}/"),
            ]
            for _ in range(args.repeats):
                for name, url in targets:
                    rps, p99 = wrk(url, args.duration, args.conns)
                    rows.append({"test": "http", "proxy": name, "rps": rps, "p99_ms": p99})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                for name, host, port in (
                    ("haproxy", "127.0.0.1", ha_tcp),
                    ("healthgate L4 hop", "127.0.9.100", hg_prod),
                ):
                    mbps = bulk(host, port, "/big", size)
                    rows.append({"test": "tcp-bulk", "proxy": name, "MBps": mbps})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            for p in reversed(procs):
                p.stop()
    print(f"{'test':<9} {'proxy':<32} {'req/s':>9} {'p99 ms':>7} {'MB/s':>8} {'x HAProxy':>9}")
    for test in ("http", "tcp-bulk"):
        group = [r for r in rows if r["test"] == test]
        key = "rps" if test == "http" else "MBps"
        reference = _median([r[key] for r in group if r["proxy"] == "haproxy"])
        for proxy in dict.fromkeys(r["proxy"] for r in group):
            vals = [r for r in group if r["proxy"] == proxy]
            v = _median([r[key] for r in vals])
            p99 = _median([r.get("p99_ms", 0.0) for r in vals])
            print(
                f"{test:<9} {proxy:<32} {v if test == 'http' else 0:>9.0f} {p99:>7.2f} {v if test != 'http' else 0:>8.0f} {v / reference:>9.2f}"
            )
    print(
        "\ngoals: one healthgate hop >= 0.75x HAProxy's requests/s on one core; TCP bulk >= 0.9x HAProxy's throughput"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else 0.0


if __name__ == "__main__":
    sys.exit(main())
