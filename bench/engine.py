"""Engine benchmark: build time, memory per endpoint, ingest rate and flip cost.

Builds worlds of N endpoints spread over regions and backend services (each
service published in every region, with policy, source, composite, forwarding
rule and attachment, and consumed through PSC NEGs and a global front end),
then feeds probe results into the pure engine. Nothing here touches a socket.

    python bench/engine.py                      # 10k, 100k, 1M endpoints
    python bench/engine.py --sizes 10000 --json bench/results/engine.json

Prints, per size:
* build: seconds to validate the resources (pydantic and the cross-resource
  rules) and to load the engine, and the two together ("apply": issue 31's
  goal, <= 10 s at 1,000,000 endpoints); the memory figures come from a
  second load under tracemalloc, which is slower (``engineLoadTracedSec``);
* memory: engine bytes per endpoint (tracemalloc: what the engine allocated,
  not the resource specs) and the whole process's RSS growth per endpoint;
* ingest: probe results per second in steady state (no flips), one core;
* flip: the cost of one endpoint flip, alone and when it cascades through
  source, composite, PSC NEG and route (median and p99, microseconds).

Goals (issue 2): >= 200k results/s, <= 500 bytes per endpoint, and a flip
cost that stays flat as the world grows.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

from healthgate.gcpause import gc_paused
from healthgate.health.engine import HealthEngine
from healthgate.health.states import Outcome, ProbeResult
from healthgate.model.resources import Resource
from healthgate.model.rules import validate_documents
from healthgate.model.validation import Document, parse_resource

GOAL_RESULTS_PER_SEC = 200_000
GOAL_BYTES_PER_ENDPOINT = 500
GOAL_APPLY_SEC = 10.0  # issue 31: a 1,000,000-endpoint world validated and loaded
REGIONS = 10


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def world(endpoints: int, per_service: int) -> list[dict[str, Any]]:
    """Dicts for a world of `endpoints` endpoints, `per_service` per backend service."""
    services = max(1, endpoints // (per_service * REGIONS))
    docs: list[dict[str, Any]] = []
    n = 0
    for s in range(services):
        svc = f"svc-{s}"
        negs = []
        for r in range(REGIONS):
            region = f"region-{r}"
            base = {"project": "prod", "region": region}
            k = s * REGIONS + r  # this rule's number
            eps = []
            for _ in range(per_service):
                # loopback-shaped addresses; nothing is ever sent to them
                eps.append(
                    {
                        "ipAddress": f"127.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}",
                        "port": 8000 + (n >> 24),
                    }
                )
                n += 1
            docs += [
                {**base, "kind": "HealthCheck", "name": f"{svc}-hc", "type": "HTTP", "port": 8080},
                {
                    **base,
                    "kind": "NetworkEndpointGroup",
                    "name": f"{svc}-neg",
                    "networkEndpointType": "GCE_VM_IP_PORT",
                    "endpoints": eps,
                },
                {
                    **base,
                    "kind": "BackendService",
                    "name": svc,
                    "loadBalancingScheme": "INTERNAL_MANAGED",
                    "healthChecks": [f"{svc}-hc"],
                    "backends": [{"group": f"{svc}-neg"}],
                },
                # 100 %: any endpoint failure turns the source UNHEALTHY (the cascading case)
                {
                    **base,
                    "kind": "HealthAggregationPolicy",
                    "name": f"{svc}-pol",
                    "healthyPercentThreshold": 100,
                },
                {
                    **base,
                    "kind": "HealthSource",
                    "name": f"{svc}-src",
                    "sources": [svc],
                    "healthAggregationPolicy": f"{svc}-pol",
                },
                {
                    **base,
                    "kind": "ForwardingRule",
                    "name": f"{svc}-fr",
                    # one address per rule: two rules may not share one
                    "IPAddress": f"127.200.{(k >> 8) & 255}.{k & 255}",
                    "ports": [8080 + (k >> 16)],
                    "loadBalancingScheme": "INTERNAL_MANAGED",
                    "backendService": svc,
                },
                {
                    **base,
                    "kind": "CompositeHealthCheck",
                    "name": f"{svc}-chc",
                    "healthSources": [f"{svc}-src"],
                    "healthDestination": f"{svc}-fr",
                },
                {
                    **base,
                    "kind": "ServiceAttachment",
                    "name": f"{svc}-sa",
                    "targetService": f"{svc}-fr",
                },
                {
                    "project": "consumer",
                    "region": region,
                    "kind": "NetworkEndpointGroup",
                    "name": f"{svc}-psc",
                    "networkEndpointType": "PRIVATE_SERVICE_CONNECT",
                    "pscTargetService": f"projects/prod/regions/{region}/serviceAttachments/{svc}-sa",
                },
            ]
            negs.append({"group": f"regions/{region}/networkEndpointGroups/{svc}-psc"})
        docs += [
            {
                "project": "consumer",
                "kind": "BackendService",
                "name": svc,
                "loadBalancingScheme": "EXTERNAL_MANAGED",
                "backends": negs,
            },
            {
                "project": "consumer",
                "kind": "ForwardingRule",
                "name": f"{svc}-front",
                "IPAddress": f"127.201.{(s >> 8) & 255}.{s & 255}",
                "portRange": str(80 + (s >> 16)),
                "loadBalancingScheme": "EXTERNAL_MANAGED",
                "backendService": svc,
                "dataPlaneRegion": "region-0",
            },
        ]
    return docs


def parse(dicts: list[dict[str, Any]]) -> list[Resource]:
    docs = []
    with gc_paused():  # (as parse_manifest and the API's parse_documents do)
        for i, d in enumerate(dicts):
            res, issues = parse_resource(d, i)
            assert res is not None, issues
            docs.append(Document(res, i))
    problems = validate_documents(docs)
    assert not problems, problems[:3]
    return [d.resource for d in docs]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(size: int, per_service: int, results: int, flips: int, seed: int) -> dict[str, Any]:
    rnd = random.Random(seed)
    dicts = world(size, per_service)
    t0 = time.perf_counter()
    resources = parse(dicts)
    del dicts
    t_parse = time.perf_counter() - t0
    # the load alone, untraced (issue 31: validated and loaded in <= 10 s at 1M)
    gc.collect()
    t_load0 = time.perf_counter()
    HealthEngine().apply(resources, 0.0)
    t_load = time.perf_counter() - t_load0

    gc.collect()
    rss0 = rss_bytes()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    engine = HealthEngine()
    t1 = time.perf_counter()
    applied = engine.apply(resources, 0.0)
    t_apply = time.perf_counter() - t1
    slots = [t.slot for t in applied.added]
    del applied
    gc.collect()
    engine_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    n = engine.endpoint_count()
    # the slot list is the benchmark's, not the engine's
    engine_bytes -= sys.getsizeof(slots)

    ok = ProbeResult(Outcome.OK, 0.002, 200)
    bad = ProbeResult(Outcome.TIMEOUT, 3.0)
    # settle: every endpoint HEALTHY (3 successes each)
    t2 = time.perf_counter()
    for _ in range(3):
        for slot in slots:
            engine.on_result(1.0, slot, ok)
    t_settle = time.perf_counter() - t2
    rss_per_endpoint = (rss_bytes() - rss0) / n

    # steady state: results that change nothing, in random order, one core
    order = [slots[rnd.randrange(n)] for _ in range(results)]
    on_result = engine.on_result
    c0 = time.process_time()
    w0 = time.perf_counter()
    for slot in order:
        on_result(2.0, slot, ok)
    wall = time.perf_counter() - w0
    cpu = time.process_time() - c0
    rate = results / cpu if cpu > 0 else float("inf")

    # flips: pick random endpoints; the first failure of a service cascades
    # (source, composite, PSC NEG, route); a second endpoint of the same service
    # flips alone (its source is already UNHEALTHY).
    cascade_us: list[float] = []
    alone_us: list[float] = []
    cascades = 0
    now = 3.0
    for _ in range(flips):
        slot = slots[rnd.randrange(n)]
        for _ in range(2):
            engine.on_result(now, slot, bad)
        t = time.perf_counter()
        recs = engine.on_result(now, slot, bad)
        dt = (time.perf_counter() - t) * 1e6
        (cascade_us if len(recs) > 1 else alone_us).append(dt)
        cascades += len(recs) > 1
        for _ in range(3):
            engine.on_result(now, slot, ok)
        now += 1.0
    # alone flips: fail two endpoints of one service, time the second
    for _ in range(flips):
        a, b = rnd.sample(range(per_service), 2)
        start = rnd.randrange(0, n - per_service, per_service)
        sa, sb = slots[start + a], slots[start + b]
        for _ in range(3):
            engine.on_result(now, sa, bad)
        for _ in range(2):
            engine.on_result(now, sb, bad)
        t = time.perf_counter()
        recs = engine.on_result(now, sb, bad)
        alone_us.append((time.perf_counter() - t) * 1e6)
        assert len(recs) == 1, recs
        for s in (sa, sb):
            for _ in range(3):
                engine.on_result(now, s, ok)
        now += 1.0

    return {
        "endpoints": n,
        "backendServices": size // per_service,
        "resources": len(resources),
        "parseSec": round(t_parse, 3),
        "engineLoadSec": round(t_load, 3),
        "engineLoadTracedSec": round(t_apply, 3),
        "applySec": round(t_parse + t_load, 3),
        "settleResultsPerSec": round(3 * n / t_settle),
        "engineBytesPerEndpoint": round(engine_bytes / n, 1),
        "rssBytesPerEndpoint": round(rss_per_endpoint, 1),
        "resultsPerSecCpu": round(rate),
        "resultsPerSecWall": round(results / wall),
        "flipAloneUsMedian": round(statistics.median(alone_us), 2),
        "flipAloneUsP99": round(percentile(alone_us, 0.99), 2),
        "flipCascadeUsMedian": round(statistics.median(cascade_us), 2) if cascade_us else None,
        "flipCascadeUsP99": round(percentile(cascade_us, 0.99), 2) if cascade_us else None,
        "cascades": cascades,
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument(
        "--per-service", type=int, default=100, help="endpoints per regional backend service"
    )
    ap.add_argument(
        "--results", type=int, default=2_000_000, help="steady-state results fed per size"
    )
    ap.add_argument("--flips", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()

    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        print(f"building {size:,} endpoints ...", file=sys.stderr, flush=True)
        row = run(size, args.per_service, args.results, args.flips, args.seed)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    head = f"{'endpoints':>10} {'parse s':>8} {'load s':>7} {'apply s':>8} {'B/ep eng':>9} {'B/ep rss':>9} {'results/s':>10} {'flip us':>8} {'p99':>7} {'cascade us':>11} {'p99':>7}"
    print(head)
    for r in rows:
        print(
            f"{r['endpoints']:>10,} {r['parseSec']:>8} {r['engineLoadSec']:>7} {r['applySec']:>8} {r['engineBytesPerEndpoint']:>9} "
            f"{r['rssBytesPerEndpoint']:>9} {r['resultsPerSecCpu']:>10,} {r['flipAloneUsMedian']:>8} "
            f"{r['flipAloneUsP99']:>7} {r['flipCascadeUsMedian']!s:>11} {r['flipCascadeUsP99']!s:>7}"
        )
    largest = max(rows, key=lambda r: r["endpoints"])
    print(
        f"\napply (validate + load) at {largest['endpoints']:,} endpoints: "
        f"{largest['applySec']} s vs goal {GOAL_APPLY_SEC:g} s at 1,000,000"
    )
    worst_rate = min(r["resultsPerSecCpu"] for r in rows)
    worst_mem = max(r["engineBytesPerEndpoint"] for r in rows)
    print(
        f"\nresults/s vs goal {GOAL_RESULTS_PER_SEC:,}: {worst_rate / GOAL_RESULTS_PER_SEC:.2f}x (worst size)"
    )
    print(
        f"engine bytes/endpoint vs goal {GOAL_BYTES_PER_ENDPOINT}: {worst_mem / GOAL_BYTES_PER_ENDPOINT:.2f}x of budget (worst size)"
    )
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        growth = last["endpoints"] / first["endpoints"]
        print(
            f"flip cost from {first['endpoints']:,} to {last['endpoints']:,} endpoints ({growth:.0f}x): "
            f"alone {last['flipAloneUsMedian'] / first['flipAloneUsMedian']:.2f}x, "
            f"cascading {(last['flipCascadeUsMedian'] or 0) / (first['flipCascadeUsMedian'] or 1):.2f}x"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
