"""Session affinity (SPEC §9), measured: do clients keep their region, does
a change move only the clients it must, and what does it cost the L7 front
end.

    python bench/sessions.py                   # ~1 minute
    python bench/sessions.py --clients 1000 --duration 6 --repeats 3

Three regions, each one nginx server answering ``region=NAME`` (one nginx on
core 0 with wrk and the clients), published through healthgate's own
producer rules; a consumer L7 front end over them with
``sessionAffinity: GENERATED_COOKIE``; serve on core 1.

* **stay**: at a 70/30 dial (the third region a fallback), ``--clients``
  cookie clients, each its first request without a cookie and then nine
  with the one it got: the share of clients that saw one region only
  (goal 100 %) and the share in the first region (goal 70 ± 3);
* **move**: the dial to 60/40: the share of clients that moved (goal ≤ 1.2×
  the ideal 10 %); then 50/30/20 over three regions, the second region
  broken (its endpoint moved to a closed port) until it fails over: the
  clients of the other two that moved (goal 0) and, after it is repaired,
  the share of every client back where it was (goal 100 %);
* **cost**: wrk -c50 through the front end at 70/30, alternately with
  affinity off, with a valid cookie on every request (a returning client)
  and with none (each request a new client: rendezvous, a new signed
  cookie), and - for scale - affinity off on the general path (a
  ``Connection`` header keeps a request off the fast path), ``--repeats``
  times: median requests/s of each and the ratios (goal: with a cookie ≥
  0.97× off).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Proc, cpu_seconds, free_port, pinned, wait_port, wait_until
from dataplane import missing, published_region, region_backends, wrk

REGIONS = ("us-east1", "europe-west1", "asia-east1")
CHECK = {"type": "TCP", "checkIntervalSec": 1, "timeoutSec": 1, "healthyThreshold": 2,
         "unhealthyThreshold": 2}  # fmt: skip
FRONT = "/v1/projects/c/global/backendServices/front"


def world(be: dict[str, int], prod: dict[str, int], l7: int) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for i, region in enumerate(REGIONS):
        docs += published_region(region, be[region], f"127.0.9.{100 + i}", prod[region], CHECK)
    backends = [{"group": f"regions/{r}/networkEndpointGroups/psc"} for r in REGIONS]
    docs += [
        {"project": "c", "kind": "BackendService", "name": "front",
         "loadBalancingScheme": "EXTERNAL_MANAGED", "protocol": "HTTP", "backends": backends},
        {"project": "c", "kind": "ForwardingRule", "name": "front", "IPAddress": "127.0.0.1",
         "portRange": str(l7), "loadBalancingScheme": "EXTERNAL_MANAGED",
         "backendService": "front", "dataPlaneRegion": REGIONS[0]},
    ]  # fmt: skip
    return docs


class Serve:
    def __init__(self, api: int) -> None:
        self.url = f"http://127.0.0.1:{api}"

    def doc(self, path: str) -> dict[str, Any]:
        doc = httpx.get(self.url + path, timeout=10).json()
        return {k: v for k, v in doc.items() if k != "status"}

    def front(self, dials: tuple[int | None, ...], affinity: str = "GENERATED_COOKIE") -> None:
        body = self.doc(FRONT)
        body["sessionAffinity"] = affinity
        for b, dial in zip(body["backends"], dials, strict=True):
            if dial is None:
                b.pop("trafficDial", None)
            else:
                b["trafficDial"] = dial
        httpx.put(self.url + FRONT, json=body, timeout=10).raise_for_status()

    def shares(self) -> dict[str, float]:
        doc = httpx.get(f"{self.url}/v1/projects/c/global/forwardingRules/front", timeout=10)
        route = (doc.json().get("status") or {}).get("route") or {}
        return {s["region"]: s["percent"] for s in route.get("shares", [])}

    def backend_port(self, region: str, port: int) -> None:
        path = f"/v1/projects/bench/regions/{region}/networkEndpointGroups/neg"
        body = self.doc(path)
        body["endpoints"] = [{"ipAddress": "127.0.0.1", "port": port}]
        httpx.put(self.url + path, json=body, timeout=10).raise_for_status()

    def healthy(self, region: str) -> bool:
        doc = httpx.get(f"{self.url}/v1/projects/c/regions/{region}/networkEndpointGroups/psc",
                        timeout=5).json()  # fmt: skip
        return bool(doc["status"]["healthState"] == "HEALTHY")


class Client:
    """One browser: its cookie, and a kept-alive connection for each visit
    (closed after it: a thousand idle connections from one address would
    meet the front end's per-source cap)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.cookie = ""

    def visit(self, times: int) -> set[str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            return {self._get(conn) for _ in range(times)}
        finally:
            conn.close()

    def _get(self, conn: http.client.HTTPConnection) -> str:
        headers = {"Cookie": f"HG_AFFINITY={self.cookie}"} if self.cookie else {}
        conn.request("GET", "/", headers=headers)
        resp = conn.getresponse()
        body = resp.read().decode()
        if resp.status != 200:
            raise SystemExit(f"a client got {resp.status}: {body}")
        for value in resp.headers.get_all("Set-Cookie") or ():
            if value.startswith("HG_AFFINITY="):
                self.cookie = value.split(";")[0].removeprefix("HG_AFFINITY=")
        return body.split()[0].removeprefix("region=")


def regions_of(clients: list[Client], times: int) -> list[set[str]]:
    return [c.visit(times) for c in clients]


def the_region(seen: list[set[str]]) -> list[str]:
    return [sorted(s)[0] if len(s) == 1 else "(several)" for s in seen]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--conns", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()
    if missing("nginx", "wrk"):
        return 2
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        be, backends = region_backends(work, REGIONS)
        closed = free_port()  # (nobody listens there: a broken region)
        procs = [backends]
        try:
            prod = {r: free_port(f"127.0.9.{100 + i}") for i, r in enumerate(REGIONS)}
            l7, api = free_port(), free_port()
            manifest = work / "world.yaml"
            manifest.write_text(yaml.safe_dump_all(world(be, prod, l7)))
            cmd = [sys.executable, "-m", "healthgate", "serve", "--db", str(work / "hg.db"),
                   "--listen", f"127.0.0.1:{api}", "-f", str(manifest), "--log-level", "warning"]  # fmt: skip
            procs.append(Proc(pinned(cmd, 1), work / "hg.log"))
            serve_pid = procs[-1].p.pid
            for port in (l7, api):
                wait_port(port)
            serve = Serve(api)
            wait_until(lambda: all(serve.healthy(r) for r in REGIONS), 30, "every region HEALTHY")
            us, eu, asia = REGIONS

            def at(shares: dict[str, float]) -> None:
                wait_until(lambda: serve.shares() == shares, 20, f"the shares {shares}")

            # ---- stay
            serve.front((70, None, 0))
            at({us: 70.0, eu: 30.0})
            clients = [Client(l7) for _ in range(args.clients)]
            seen = regions_of(clients, 10)
            one = sum(len(s) == 1 for s in seen)
            at_70 = the_region(seen)
            stay = {"clients": args.clients, "in_one_region_percent": 100 * one / args.clients,
                    "first_region_percent": 100 * at_70.count(us) / args.clients}  # fmt: skip
            print(json.dumps({"stay": stay}), file=sys.stderr, flush=True)
            # ---- move: a dial change
            serve.front((60, None, 0))
            at({us: 60.0, eu: 40.0})
            at_60 = the_region(regions_of(clients, 1))
            moved = sum(a != b for a, b in zip(at_70, at_60, strict=True))
            dial = {"moved_percent": 100 * moved / args.clients, "ideal_percent": 10.0}
            print(json.dumps({"dial 70 -> 60": dial}), file=sys.stderr, flush=True)
            # ---- move: a failover over three regions, and back
            # (failover order us-east1, asia-east1, europe-west1: 50, 40 % of the rest, the rest)
            serve.front((50, None, 40))
            at({us: 50.0, eu: 30.0, asia: 20.0})
            before = the_region(regions_of(clients, 1))
            serve.backend_port(eu, closed)
            wait_until(lambda: eu not in serve.shares(), 30, "europe-west1 failed over")
            during = the_region(regions_of(clients, 1))
            others = [i for i, r in enumerate(before) if r != eu]
            failover: dict[str, float] = {
                "failed_region_clients": before.count(eu),
                "other_clients_moved": sum(during[i] != before[i] for i in others),
                "failed_region_clients_left_on_it": sum(
                    during[i] == eu for i, r in enumerate(before) if r == eu
                ),
            }
            serve.backend_port(eu, be[eu])
            at({us: 50.0, eu: 30.0, asia: 20.0})
            after = the_region(regions_of(clients, 1))
            failover["back_where_they_were_percent"] = (
                100 * sum(a == b for a, b in zip(before, after, strict=True)) / args.clients
            )
            print(json.dumps({"failover": failover}), file=sys.stderr, flush=True)
            # ---- cost (a returning client's cookie, issued at this very split)
            serve.front((70, None, 0))
            at({us: 70.0, eu: 30.0})
            returning = Client(l7)
            returning.visit(1)
            cases: list[tuple[str, str, tuple[str, ...]]] = [
                ("off", "NONE", ()),
                ("cookie", "GENERATED_COOKIE", (f"Cookie: HG_AFFINITY={returning.cookie}",)),
                ("no cookie", "GENERATED_COOKIE", ()),
                # (what the general path costs: a header the fast path leaves to it)
                ("off, general path", "NONE", ("Connection: keep-alive",)),
            ]
            rps: dict[str, list[float]] = {label: [] for label, _, _ in cases}
            cpu_us: dict[str, list[float]] = {label: [] for label, _, _ in cases}
            for _ in range(args.repeats):
                for label, mode, headers in cases:
                    serve.front((70, None, 0), mode)
                    at({us: 70.0, eu: 30.0})
                    cpu0 = cpu_seconds(serve_pid, children=True)
                    rate = wrk(f"http://127.0.0.1:{l7}/", args.duration, args.conns, headers)[0]
                    cpu = cpu_seconds(serve_pid, children=True) - cpu0
                    rps[label].append(rate)
                    cpu_us[label].append(cpu / (rate * int(args.duration)) * 1e6)
            out = {"stay": stay, "dial": dial, "failover": failover, "rps": rps,
                   "serve_cpu_us_per_request": cpu_us}  # fmt: skip
        finally:
            for p in reversed(procs):
                p.stop()
    median = {k: statistics.median(v) for k, v in out["rps"].items()}
    cpu_med = {k: statistics.median(v) for k, v in out["serve_cpu_us_per_request"].items()}
    s, d, f = out["stay"], out["dial"], out["failover"]
    print(
        f"stay:     {s['in_one_region_percent']:.1f}% of {s['clients']} cookie clients in one "
        f"region (goal 100); {s['first_region_percent']:.1f}% in the 70% region (goal 70 ± 3)"
    )
    print(f"dial:     70 -> 60 moved {d['moved_percent']:.1f}% of clients (ideal 10, goal <= 12)")
    print(
        f"failover: {f['other_clients_moved']} of the other regions' clients moved (goal 0), "
        f"{f['failed_region_clients_left_on_it']} of {f['failed_region_clients']} left on the "
        f"failed one; after repair {f['back_where_they_were_percent']:.1f}% back (goal 100)"
    )
    print(f"{'front end at 70/30':<24} {'requests/s':>12} {'vs off':>8} {'CPU µs/req':>11}")
    for label in out["rps"]:
        print(f"{'affinity ' + label:<24} {median[label]:>12,.0f} "
              f"{median[label] / median['off']:>7.2f}x {cpu_med[label]:>11.1f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
