"""Traffic dials (SPEC §6), measured: how exactly each data plane follows the
shares, and what a split costs the L7 front end.

    python bench/steering.py                  # ~1 minute
    python bench/steering.py --requests 20000 --duration 10 --repeats 5

Two regions, each one nginx server answering ``region=NAME`` (one nginx,
core 0, with wrk and the clients), published through healthgate's own
producer rules; a consumer project with an L7 (HTTP) and an L4 (TCP) front
end over both regions; serve on core 1. The first region's backend is
dialled to 70 (``trafficDial``):

* **accuracy**: N requests on kept-alive connections through the L7 front
  end, and N new TCP connections through the L4 one: the share each region
  got, against the route's shares (goal: within ±2 points);
* **cost**: wrk -c50 through the L7 front end with the route unsplit (dial
  100) and split 70/30, alternately, ``--repeats`` times: the median
  requests/s of each and their ratio (goal: split >= 0.97x unsplit).

* **a ramped failback** (``failbackRampSec``, ``--ramp`` seconds): the
  first region shifted away, then the shift ended - its share grows from 0;
  requests on a kept-alive connection through the L7 front end all along,
  the first region's measured share in a window (±2.5 % of the ramp) around
  25, 50 and 75 % of the ramp against the straight line (goal: within ±5
  points).

Envoy, HAProxy and DNS are tested with the shares in tests/integration.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Proc, cpu_seconds, free_port, pinned, wait_port, wait_until
from dataplane import missing, published_region, region_backends, wrk

REGIONS = ("us-east1", "europe-west1")
CHECK = {"type": "TCP", "checkIntervalSec": 1, "timeoutSec": 1}


def world(be: dict[str, int], prod: dict[str, int], l7: int, l4: int) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for i, region in enumerate(REGIONS):
        docs += published_region(region, be[region], f"127.0.9.{100 + i}", prod[region], CHECK)
    backends = [{"group": f"regions/{r}/networkEndpointGroups/psc"} for r in REGIONS]
    for name, protocol, port in (("front", "HTTP", l7), ("front4", "TCP", l4)):
        docs += [
            {"project": "c", "kind": "BackendService", "name": name,
             "loadBalancingScheme": "EXTERNAL_MANAGED", "protocol": protocol,
             "backends": backends},
            {"project": "c", "kind": "ForwardingRule", "name": name, "IPAddress": "127.0.0.1",
             "portRange": str(port), "loadBalancingScheme": "EXTERNAL_MANAGED",
             "backendService": name, "dataPlaneRegion": REGIONS[0]},
        ]  # fmt: skip
    return docs


class Serve:
    def __init__(self, api: int) -> None:
        self.url = f"http://127.0.0.1:{api}"

    def dial(self, dial: int | None) -> None:
        for name in ("front", "front4"):
            url = f"{self.url}/v1/projects/c/global/backendServices/{name}"
            doc = httpx.get(url, timeout=10).json()
            body = {k: v for k, v in doc.items() if k != "status"}
            if dial is None:
                body["backends"][0].pop("trafficDial", None)
            else:
                body["backends"][0]["trafficDial"] = dial
            httpx.put(url, json=body, timeout=10).raise_for_status()
        want = 1 if dial is None else 2
        wait_until(lambda: all(len(self.shares(n)) == want for n in ("front", "front4")), 10,
                   "the shares")  # fmt: skip

    def listener(self, frontend: str) -> dict[str, int]:
        """The front end's own counters (requests, fast_path, ...)."""
        doc = httpx.get(f"{self.url}/v1/projects/c/global/forwardingRules/{frontend}", timeout=10)
        stats = (doc.json().get("status") or {}).get("listener") or {}
        return {k: v for k, v in stats.items() if isinstance(v, int)}

    def shares(self, frontend: str) -> dict[str, float]:
        doc = httpx.get(f"{self.url}/v1/projects/c/global/forwardingRules/{frontend}", timeout=10)
        route = (doc.json().get("status") or {}).get("route") or {}
        return {s["region"]: s["percent"] for s in route.get("shares", [])}

    def endpoints(self, ports: list[int]) -> None:
        """The first region's endpoints (nginx ports): for the baseline of two
        upstream pools without a split."""
        url = f"{self.url}/v1/projects/bench/regions/{REGIONS[0]}/networkEndpointGroups/neg"
        doc = httpx.get(url, timeout=10).json()
        body = {k: v for k, v in doc.items() if k != "status"}
        body["endpoints"] = [{"ipAddress": "127.0.0.1", "port": p} for p in ports]
        httpx.put(url, json=body, timeout=10).raise_for_status()
        health = f"{self.url}/v1/projects/bench/regions/{REGIONS[0]}/backendServices/web/health"
        wait_until(
            lambda: httpx.get(health, timeout=10).json().get("healthy") == len(ports), 20,
            "the endpoints HEALTHY",
        )  # fmt: skip

    def ramp(self, seconds: int | None) -> None:
        """Set failbackRampSec on the L7 front end's backend service."""
        url = f"{self.url}/v1/projects/c/global/backendServices/front"
        doc = httpx.get(url, timeout=10).json()
        body = {k: v for k, v in doc.items() if k != "status"}
        body["backends"][0].pop("trafficDial", None)
        policy = dict(body.get("failoverPolicy") or {})
        policy["failbackRampSec"] = seconds or 0
        body["failoverPolicy"] = policy
        httpx.put(url, json=body, timeout=10).raise_for_status()


def ramp_accuracy(serve: Serve, port: int, seconds: int) -> dict[str, Any]:
    """Shift the first region away, end the shift, and measure its share of
    requests while its ramp runs (see the module doc)."""
    serve.ramp(seconds)
    shifts = f"{serve.url}/v1/projects/c/shifts"
    body = {"awayFrom": REGIONS[0], "expiresInSec": 600, "comment": "bench: ramp"}
    made = httpx.post(shifts, json=body, timeout=10)
    made.raise_for_status()
    wait_until(lambda: serve.shares("front") == {REGIONS[1]: 100.0}, 10, "the shift")
    httpx.delete(f"{shifts}/{made.json()['name']}", timeout=10).raise_for_status()

    def started() -> float | None:
        doc = httpx.get(f"{serve.url}/v1/projects/c/global/forwardingRules/front", timeout=10)
        ramps = doc.json()["status"]["route"].get("ramps") or []
        return datetime.fromisoformat(ramps[0]["start"]).timestamp() if ramps else None

    wait_until(lambda: started() is not None, 10, "the ramp's start")
    start = started()
    assert start is not None
    seen: list[tuple[float, str]] = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    while time.time() < start + seconds * 0.8:
        conn.request("GET", "/")
        region = conn.getresponse().read().decode().split()[0].removeprefix("region=")
        seen.append((time.time(), region))
    conn.close()
    out: dict[str, Any] = {"rampSec": seconds, "requests": len(seen), "points": {}}
    half = seconds * 0.025
    for at in (0.25, 0.50, 0.75):
        mid = start + at * seconds
        window = [r for t, r in seen if mid - half <= t <= mid + half]
        got = 100 * sum(r == REGIONS[0] for r in window) / max(1, len(window))
        out["points"][f"{at:.0%}"] = {"line": at * 100, "measured": got, "requests": len(window)}
    out["worst_points_off"] = max(abs(p["measured"] - p["line"]) for p in out["points"].values())
    serve.ramp(None)
    return out


def l7_split(port: int, n: int) -> Counter[str]:
    seen: Counter[str] = Counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    for _ in range(n):
        conn.request("GET", "/")
        seen[conn.getresponse().read().decode().split()[0].removeprefix("region=")] += 1
    conn.close()
    return seen


def l4_split(port: int, n: int) -> Counter[str]:
    seen: Counter[str] = Counter()
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.0\r\nHost: b\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        body = data.split(b"\r\n\r\n", 1)[-1].decode()
        seen[body.split()[0].removeprefix("region=")] += 1
    return seen


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--duration", type=float, default=6.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--conns", type=int, default=50)
    ap.add_argument("--ramp", type=int, default=20, help="failbackRampSec to measure (0: skip)")
    ap.add_argument(
        "--two-pools", action="store_true",
        help="also measure an unsplit region of two endpoints (two upstream pools, no draw)",
    )  # fmt: skip
    ap.add_argument("--json")
    args = ap.parse_args()
    if missing("nginx", "wrk"):
        return 2
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        be, backends = region_backends(work, REGIONS)
        procs = [backends]
        try:
            prod = {r: free_port(f"127.0.9.{100 + i}") for i, r in enumerate(REGIONS)}
            l7, l4, api = free_port(), free_port(), free_port()
            manifest = work / "world.yaml"
            manifest.write_text(yaml.safe_dump_all(world(be, prod, l7, l4)))
            cmd = [sys.executable, "-m", "healthgate", "serve", "--db", str(work / "hg.db"),
                   "--listen", f"127.0.0.1:{api}", "-f", str(manifest), "--log-level", "warning"]  # fmt: skip
            procs.append(Proc(pinned(cmd, 1), work / "hg.log"))
            serve_pid = procs[-1].p.pid
            for port in (l7, l4, api):
                wait_port(port)
            serve = Serve(api)
            wait_until(
                lambda: (
                    serve.shares("front") == {REGIONS[0]: 100.0}
                    and all(
                        httpx.get(
                            f"{serve.url}/v1/projects/c/regions/{r}/networkEndpointGroups/psc",
                            timeout=5,
                        ).json()["status"]["healthState"]
                        == "HEALTHY"
                        for r in REGIONS
                    )
                ),
                30,
                "both regions HEALTHY",
            )
            serve.dial(70)
            shares = serve.shares("front")
            accuracy = {}
            for name, run, port in (
                ("L7 requests", l7_split, l7),
                ("L4 connections", l4_split, l4),
            ):
                seen = run(port, args.requests)
                got = {r: 100 * seen[r] / args.requests for r in REGIONS}
                off = max(abs(got[r] - shares.get(r, 0.0)) for r in REGIONS)
                accuracy[name] = {"shares": shares, "measured": got, "worst_points_off": off}
                print(json.dumps({name: accuracy[name]}), file=sys.stderr, flush=True)
            if args.ramp:
                accuracy["L7 ramp"] = ramp_accuracy(serve, l7, args.ramp)
                print(json.dumps({"L7 ramp": accuracy["L7 ramp"]}), file=sys.stderr, flush=True)
            # (and, with --two-pools, one region of two endpoints, unsplit:
            # what sending to two upstream pools costs without any split)
            cases: list[tuple[str, int | None, list[int]]] = [
                ("unsplit", None, [be[REGIONS[0]]]),
                ("split 70/30", 70, [be[REGIONS[0]]]),
            ]
            if args.two_pools:
                cases.append(("unsplit, 2 endpoints", None, list(be.values())))
            rps: dict[str, list[float]] = {label: [] for label, _, _ in cases}
            fast_share: dict[str, list[float]] = {label: [] for label, _, _ in cases}
            cpu_us: dict[str, list[float]] = {label: [] for label, _, _ in cases}
            for _ in range(args.repeats):
                for label, dial, ports in cases:
                    serve.dial(dial)
                    if args.two_pools:
                        serve.endpoints(ports)
                    before = serve.listener("front")
                    cpu0 = cpu_seconds(serve_pid, children=True)
                    rate = wrk(f"http://127.0.0.1:{l7}/", args.duration, args.conns)[0]
                    cpu = cpu_seconds(serve_pid, children=True) - cpu0
                    rps[label].append(rate)
                    cpu_us[label].append(cpu / (rate * int(args.duration)) * 1e6)
                    after = serve.listener("front")
                    done = after.get("requests", 0) - before.get("requests", 0)
                    fast = after.get("fast_path", 0) - before.get("fast_path", 0)
                    fast_share[label].append(fast / done if done else 0.0)
            out = {"accuracy": accuracy, "rps": rps, "fast_path_share": fast_share,
                   "serve_cpu_us_per_request": cpu_us}  # fmt: skip
        finally:
            for p in reversed(procs):
                p.stop()
    median = {k: statistics.median(v) for k, v in out["rps"].items()}
    print(f"{'data plane':<16} {'shares':<28} {'measured':<28} {'worst':>6}")
    for name, a in out["accuracy"].items():
        if name == "L7 ramp":
            continue
        wanted = ", ".join(f"{v:g}% {r}" for r, v in a["shares"].items())
        measured = ", ".join(f"{v:.1f}% {r}" for r, v in a["measured"].items())
        print(f"{name:<16} {wanted:<28} {measured:<28} {a['worst_points_off']:>5.1f}")
    ramp = out["accuracy"].get("L7 ramp")
    if ramp:
        points = ", ".join(
            f"at {k}: {p['measured']:.1f}% (line {p['line']:g}%, {p['requests']} requests)"
            for k, p in ramp["points"].items()
        )
        print(f"ramp over {ramp['rampSec']} s, {REGIONS[0]}'s share {points}")
    ratio = median["split 70/30"] / median["unsplit"]
    print(
        f"\nL7 requests/s, median of {args.repeats}: unsplit {median['unsplit']:,.0f}, "
        f"split 70/30 {median['split 70/30']:,.0f}: {ratio:.3f}x"
    )
    if "unsplit, 2 endpoints" in median:
        two = median["unsplit, 2 endpoints"]
        print(
            f"unsplit over 2 endpoints (two pools, no draw) {two:,.0f}: "
            f"{two / median['unsplit']:.3f}x unsplit; split / it {median['split 70/30'] / two:.3f}x"
        )
    for label, shares_ in out["fast_path_share"].items():
        cpu = statistics.median(out["serve_cpu_us_per_request"][label])
        print(
            f"{label}: fast path {statistics.median(shares_):.1%} of requests, "
            f"serve's CPU {cpu:.1f} us per request"
        )
    print(
        "goals: every data plane within ±2 points of the shares; split >= 0.97x unsplit; "
        "a ramp within ±5 points of its line"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({**out, "median": median, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
