"""Replay benchmark (SPEC §11, issue 43): what the outcome history costs,
and how long a day of it takes to replay.

    python bench/replay.py                   # 10,000 endpoints, 24 h, 1 % flapping
    python bench/replay.py --endpoints 1000 --hours 1

Prints:

* history bytes per endpoint per day (encoded, health/history.py) for a
  steady endpoint, one that flips at every probe (bounded: 64 KiB), and one
  down for five minutes a day - checked every 2 s; and the time the
  recorder takes per result (the prober's path: a result that extends a
  run, and one that starts a new run);
* the replay of ``--hours`` of ``--endpoints`` endpoints (bench/engine.py's
  world; ``--flapping`` percent of them flip at every probe, the rest are
  steady but for one five-minute outage in one region) through the engine in
  virtual time, under the world itself: seconds, and results fed. Goals:
  <= 2 KiB steady a day, a replay of 24 h of 10,000 endpoints in <= 10 s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from healthgate.health.engine import HealthEngine
from healthgate.health.history import EndpointHistory, OutcomeHistory, runs_of
from healthgate.health.states import Outcome, ProbeResult
from healthgate.model.names import endpoint_path
from healthgate.simulation.replay import replay

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import parse, world  # (bench/engine.py's world)

OK = ProbeResult(Outcome.OK, 0.004, 200)
BAD = ProbeResult(Outcome.REFUSED, 0.0)
INTERVAL_MS = 2000
DAY_MS = 86_400_000
GOAL_STEADY_BYTES = 2048
GOAL_REPLAY_SEC = 10.0


def day(kind: str, start: int = 0, hours: float = 24.0, phase: int = 0) -> EndpointHistory:
    """One endpoint's history of ``hours``, probed every 2 s."""
    h = EndpointHistory("e")
    end = start + int(hours * 3_600_000)
    middle = start + int(hours * 1_800_000)  # (the five minutes in the middle of the window)
    outage = (middle, middle + 300_000)
    for i, t in enumerate(range(start + phase, end, INTERVAL_MS)):
        if kind == "flapping":
            result = OK if i % 2 else BAD
        elif kind == "outage":
            result = BAD if outage[0] <= t < outage[1] else OK
        else:
            result = OK
        h.add(t, result)
    return h


def recorder_cost(n: int = 200_000) -> dict[str, float]:
    """µs per result of OutcomeHistory.record: extending a run, and starting one."""
    out = {}
    for name, results in (("extend", [OK, OK]), ("new run", [OK, BAD])):
        history = OutcomeHistory(24)
        paths = {i: f"p{i}" for i in range(100)}
        ticks = [[(k, results[j % 2]) for k in range(100)] for j in range(n // 100)]
        for k in range(100):  # (past their exact part: the steady case)
            for j in range(11):
                history.record(j, [(k, OK)], paths.__getitem__)
        if name == "extend":
            ticks = [[(k, OK) for k in range(100)] for _ in range(n // 100)]
        started = time.perf_counter()
        for j, tick in enumerate(ticks):
            history.record(20 + j * 2, tick, paths.__getitem__)
        out[name] = (time.perf_counter() - started) / n * 1e6
    return out


def replay_bench(endpoints: int, hours: float, flapping: float) -> dict[str, Any]:
    docs = world(endpoints, max(1, min(50, endpoints // 20)))
    resources = parse(docs)
    engine = HealthEngine()
    engine.apply(resources, 0.0)
    start = 1_796_000_000_000
    steady = day("steady", start, hours)
    outage = day("outage", start, hours)
    flap = day("flapping", start, hours)
    histories = {}
    targets = sorted(engine.targets(), key=lambda t: t.slot)
    every = int(1 / (flapping / 100)) if flapping else 0
    for i, t in enumerate(targets):
        path = endpoint_path(t.backend_service, t.ip, t.port)
        if every and i % every == 0:
            source = flap
        elif t.backend_service.region == "region-0":
            source = outage
        else:
            source = steady
        histories[path] = runs_of([source.encode()])
    results = sum(r.count for runs in histories.values() for r in runs)
    began = time.perf_counter()
    out = replay(resources, histories, (start + int(hours * 3_600_000)) / 1000)
    took = time.perf_counter() - began
    routes = sum(1 for r in out.records if r.kind == "Route")
    return {
        "endpoints": len(targets),
        "hours": hours,
        "flappingPercent": flapping,
        "resultsRecorded": results,
        "resultsFed": out.results,
        "records": len(out.records),
        "routeChanges": routes,
        "replaySec": round(took, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--endpoints", type=int, default=10_000)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--flapping", type=float, default=1.0, help="percent of endpoints flipping")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    sizes = {kind: len(day(kind).encode()) for kind in ("steady", "outage", "flapping")}
    print("history bytes per endpoint per day (probed every 2 s, 43,200 results):")
    for kind, n in sizes.items():
        print(f"  {kind:9s} {n:>8,} B")
    print(f"  goal: steady <= {GOAL_STEADY_BYTES:,} B; flapping bounded at 64 KiB (the oldest go)")
    cost = recorder_cost()
    print(f"recorder: {cost['extend']:.2f} µs per result extending a run, "
          f"{cost['new run']:.2f} µs per result starting one")  # fmt: skip
    figures = replay_bench(args.endpoints, args.hours, args.flapping)
    print(
        f"replay of {figures['hours']:g} h of {figures['endpoints']:,} endpoints "
        f"({figures['flappingPercent']:g} % flapping; {figures['resultsRecorded']:,} results "
        f"recorded, {figures['resultsFed']:,} fed): {figures['replaySec']:.2f} s, "
        f"{figures['records']:,} records, {figures['routeChanges']} route changes "
        f"(goal <= {GOAL_REPLAY_SEC:g} s)"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"bytes": sizes, "recorder": cost, **figures}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
