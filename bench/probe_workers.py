"""Probing on every core: ``serve --probe-workers N`` against one process.

    python bench/probe_workers.py                      # 50,000 HTTP kept-alive endpoints at 1 s
    python bench/probe_workers.py --endpoints 20000 --workers 0,2
    python bench/probe_workers.py --workers 3 --renice-backends 19   # backends below serve, once settled
    python bench/probe_workers.py --workers 3 --serve-cpu 0          # serve on one core, backends on the other
    python bench/probe_workers.py --endpoints 20000 --workers 2 --stop-backends   # then every backend hangs

The endpoints are split over several bench/backends.py processes (a process
here may hold at most 20,000 open files, and so may a prober: 50,000
kept-alive connections need at least three probers, and six backends of
9,000 listeners and connections each). For each worker count
(0: probing in the serving process), ``healthgate serve`` checks every
endpoint every second with kept-alive HTTP checks; printed: checks a second,
the share of probes started within 10 ms of due (goal >= 99 %), and CPU
per check of the serving process and its workers together.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Proc, backend_endpoints, cpu_seconds, free_port, pinned, rss_mb, wait_until

# endpoints per backend process: a listener and a kept connection each, under
# its 20,000 files (10,000 left ~0.1 % of them unserved), one address each
PER_BACKEND = 9_000
PER_NEG = 2_000


def backend_host(b: int) -> str:
    return f"127.0.5.{b + 1}"


def world(count: int, base: int) -> list[dict[str, Any]]:
    """``count`` endpoints: backend process b holds 127.0.5.(b+1):base..base+PER_BACKEND-1
    (below the ephemeral ports from 32768)."""
    eps = [(backend_host(i // PER_BACKEND), base + i % PER_BACKEND) for i in range(count)]
    negs = [
        {
            "kind": "NetworkEndpointGroup",
            "project": "bench",
            "region": "r1",
            "name": f"neg{n}",
            "networkEndpointType": "GCE_VM_IP_PORT",
            "endpoints": [
                {"ipAddress": ip, "port": p} for ip, p in eps[n * PER_NEG : (n + 1) * PER_NEG]
            ],
        }
        for n in range((count + PER_NEG - 1) // PER_NEG)
    ]
    return [
        {
            "kind": "HealthCheck",
            "project": "bench",
            "region": "r1",
            "name": "hc",
            "type": "HTTP",
            "requestPath": "/healthz",
            "checkIntervalSec": 1,
            "timeoutSec": 1,
        },
        *negs,
        {
            "kind": "BackendService",
            "project": "bench",
            "region": "r1",
            "name": "bs",
            "loadBalancingScheme": "INTERNAL",
            "healthChecks": ["hc"],
            "backends": [{"group": n["name"]} for n in negs],
        },
    ]


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def run(
    count: int,
    workers: int,
    base: int,
    work: Path,
    warmup: float,
    duration: float,
    backends: list[Proc],
    serve_cpu: int | None = None,
    renice: int | None = None,
    stop_backends: bool = False,
) -> dict[str, Any]:
    for old in work.glob(f"w{workers}.db*"):  # every run starts from UNKNOWN
        old.unlink()
    manifest = work / f"world-{workers}.yaml"
    manifest.write_text(yaml.safe_dump_all(world(count, base)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "healthgate", "serve", "--db", str(work / f"w{workers}.db"),
        "--listen", f"127.0.0.1:{port}", "-f", str(manifest), "--no-dataplane",
        "--keepalive-probes", "--probe-failure-log-rate", "0", "--log-level", "warning",
        "--probe-workers", str(workers),
    ]  # fmt: skip
    if serve_cpu is not None:
        cmd = pinned(cmd, serve_cpu)  # (its workers too: they inherit it)
    niced = [os.getpriority(os.PRIO_PROCESS, b.p.pid) for b in backends]
    began = time.monotonic()
    proc = Proc(cmd, work / f"serve-{workers}.log")
    try:
        wait_until(lambda: _ready(url), 120, "serve ready")
        ready = time.monotonic() - began
        wait_until(lambda: _healthy(url) == count, 120, "every endpoint HEALTHY", every=0.05)
        decided = time.monotonic() - began
        if renice is not None:  # (back as they were for the next run: below)
            for b in backends:
                os.setpriority(os.PRIO_PROCESS, b.p.pid, renice)
        time.sleep(warmup)
        c0 = cpu_seconds(proc.p.pid, children=True)
        b0 = sum(cpu_seconds(b.p.pid) for b in backends)
        s0 = metric(url, "healthgate_probes_started_total")
        l0 = metric(url, "healthgate_probes_late_total")
        k0 = metric(url, "healthgate_prober_lag_seconds_count")  # (one per tick)
        d0 = metric(url, "healthgate_prober_deferred_ticks")
        t0 = time.monotonic()
        time.sleep(duration)
        c1 = cpu_seconds(proc.p.pid, children=True)
        b1 = sum(cpu_seconds(b.p.pid) for b in backends)
        s1 = metric(url, "healthgate_probes_started_total")
        l1 = metric(url, "healthgate_probes_late_total")
        k1 = metric(url, "healthgate_prober_lag_seconds_count")
        d1 = metric(url, "healthgate_prober_deferred_ticks")
        elapsed = time.monotonic() - t0
        rss = rss_mb(proc.p.pid, children=True)
        healthy = _healthy(url)
        failed = recovered = None
        if stop_backends:
            failed, recovered = _hang(url, count, backends)
    finally:
        proc.stop()
        if renice is not None:
            for b, nice in zip(backends, niced, strict=True):
                os.setpriority(os.PRIO_PROCESS, b.p.pid, nice)
    started = s1 - s0
    return {
        "workers": workers,
        "endpoints": count,
        "checks_per_s": started / elapsed,
        "on_time": 1 - (l1 - l0) / max(started, 1),
        "us_per_check": (c1 - c0) / max(started, 1) * 1e6,
        "cores": (c1 - c0) / elapsed,
        "ticks_per_s": (k1 - k0) / elapsed,  # of every prober together
        "deferred_per_s": (d1 - d0) / elapsed,
        "backend_cores": (b1 - b0) / elapsed,
        "healthy": healthy,
        "ready_s": ready,
        "decided_s": decided,
        "rss_mb": rss,
        "failed_s": failed,
        "recovered_s": recovered,
    }


def _hang(url: str, count: int, backends: list[Proc]) -> tuple[float, float]:
    """Every backend stopped (SIGSTOP: connections still accepted by the
    kernel, never answered - a hang): seconds until every endpoint is
    UNHEALTHY; then resumed: seconds until every one is HEALTHY again."""
    began = time.monotonic()
    try:
        for b in backends:
            os.kill(b.p.pid, signal.SIGSTOP)
        wait_until(lambda: _healthy(url) == 0, 120, "every endpoint UNHEALTHY", every=0.25)
        failed = time.monotonic() - began
    finally:
        for b in backends:
            os.kill(b.p.pid, signal.SIGCONT)
    began = time.monotonic()
    wait_until(lambda: _healthy(url) == count, 120, "every endpoint HEALTHY again", every=0.25)
    return failed, time.monotonic() - began


def _healthy(url: str) -> int:
    """How many endpoints of the one backend service are HEALTHY."""
    bs = httpx.get(url + "/v1/projects/bench/regions/r1/backendServices/bs", timeout=60).json()
    return int((bs.get("status") or {}).get("healthy") or 0)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoints", type=int, default=50_000)
    ap.add_argument("--workers", default="0,3", help="worker counts to run, comma-separated")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--base-port", type=int, default=21000)
    ap.add_argument("--logs", type=Path, help="keep each serve's log in this directory")
    ap.add_argument(
        "--serve-cpu",
        type=int,
        help="pin serve and its workers to this core (the backends are on core 1: use 0)",
    )
    ap.add_argument(
        "--renice-backends",
        type=int,
        help="once every endpoint is HEALTHY, run the backends at this nice value for the "
        "measurement (started at 10 or 19, 50,000 endpoints never settle here: see "
        "docs/benchmarks.md)",
    )
    ap.add_argument(
        "--stop-backends",
        action="store_true",
        help="after the measurement, stop every backend (a hang) and time until every "
        "endpoint is UNHEALTHY, then resume them and time until every one is HEALTHY",
    )
    ap.add_argument(
        "--backend-nice",
        type=int,
        default=0,
        help="run the backends at this nice value (they stand for other machines)",
    )
    args = ap.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="hg-bench-workers-") as tmp,
        contextlib.ExitStack() as es,
    ):
        work = Path(tmp)
        backends: list[Proc] = []
        for b in range((args.endpoints + PER_BACKEND - 1) // PER_BACKEND):
            n = min(PER_BACKEND, args.endpoints - b * PER_BACKEND)
            sub = work / f"b{b}"
            sub.mkdir()
            backends.append(
                es.enter_context(
                    backend_endpoints(n, args.base_port, sub, backend_host(b), args.backend_nice)
                )
            )
        for w in (int(x) for x in args.workers.split(",")):
            try:
                row = run(
                    args.endpoints,
                    w,
                    args.base_port,
                    work,
                    args.warmup,
                    args.duration,
                    backends,
                    args.serve_cpu,
                    args.renice_backends,
                    args.stop_backends,
                )
            except (httpx.HTTPError, TimeoutError) as exc:
                tail = (work / f"serve-{w}.log").read_text(errors="replace")[-1500:]
                print(f"{args.endpoints:,} endpoints, {w} workers: failed ({exc!r})\n{tail}")
                continue
            finally:
                if args.logs is not None:
                    args.logs.mkdir(parents=True, exist_ok=True)
                    shutil.copy(work / f"serve-{w}.log", args.logs / f"serve-{w}.log")
            nice = args.backend_nice if args.renice_backends is None else args.renice_backends
            print(
                f"{row['endpoints']:,} HTTP kept-alive endpoints, {w} workers: "
                f"{row['checks_per_s']:,.0f} checks/s, {row['on_time'] * 100:.2f} % on time "
                f"(goal >= 99 %), {row['us_per_check']:.1f} us/check, {row['cores']:.2f} cores "
                f"(backends {row['backend_cores']:.2f}, nice {nice}), "
                f"{row['ticks_per_s']:,.0f} ticks/s ({row['deferred_per_s']:,.0f} deferred), "
                f"{row['healthy']:,} HEALTHY; API ready after {row['ready_s']:.1f} s, every "
                f"endpoint HEALTHY after {row['decided_s']:.1f} s; {row['rss_mb']:.0f} MB "
                "resident (with the workers)",
                flush=True,
            )
            if row["failed_s"] is not None:
                print(
                    f"  every backend stopped: every endpoint UNHEALTHY after "
                    f"{row['failed_s']:.1f} s; resumed: every endpoint HEALTHY after "
                    f"{row['recovered_s']:.1f} s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
