"""Does a change cost what it changes? One document applied through the API
in a small world and in a large one, side by side in one run (issue 39).

For each world size a fresh ``healthgate serve`` (SQLite, data plane on)
loads bench/engine.py's world (its health checks ``enabled: false``, so that
nothing probes and the machine measures applies, not checks), then one
document - a consumer backend service's ``trafficDial``, 100 and 60 in
turn - is applied ``--applies`` times through ``POST /v1/apply``. The
answer waits for the mirror, the engine and the listeners: the time printed
is the whole write. Also printed: serve's resident memory per endpoint
(its growth over an empty serve's, sampled after the world is in).

    python bench/scale.py                              # 1,000 against 100,000
    python bench/scale.py --sizes 1000,100000 --applies 20 --json out.json
    python bench/scale.py --profile 100000             # where a big world's apply goes

Goals (issue 39): the big world's apply <= 2x the small one's; <= 1,500 B
per endpoint at 100,000.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port, rss_mb, wait_until
from engine import world

ROOT = Path(__file__).resolve().parent.parent
GOAL_RATIO = 2.0
GOAL_BYTES_PER_ENDPOINT = 1500
PER_SERVICE = 100


def the_world(endpoints: int, probed: bool = False) -> list[dict[str, Any]]:
    """bench/engine.py's world; its checks off (the applies are measured,
    not checks), or ``probed``: every endpoint checked every 50 s (loopback
    addresses that refuse: the memory of a probed world, at a rate the
    machine keeps up with)."""
    docs = world(endpoints, PER_SERVICE)
    for d in docs:
        if d["kind"] == "HealthCheck":
            if probed:
                d.update(type="TCP", checkIntervalSec=50, timeoutSec=1)
            else:
                d["enabled"] = False
    return docs


class Serve:
    def __init__(self, work: Path, extra: list[str]) -> None:
        self.port = free_port()
        self.log = open(work / f"serve-{self.port}.log", "w")  # noqa: SIM115
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "healthgate", "serve", "--db", str(work / f"{self.port}.db"),
             "--listen", f"127.0.0.1:{self.port}", "--max-listening-sockets", "4096", *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        wait_until(self._ready, 60, "serve ready")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"serve exited: {self.proc.returncode}")
        try:
            return httpx.get(self.url + "/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def apply(self, docs: list[dict[str, Any]]) -> float:
        started = time.perf_counter()
        r = httpx.post(
            self.url + "/v1/apply",
            content=yaml.safe_dump_all(docs),
            headers={"Content-Type": "application/yaml"},
            timeout=600,
        )
        took = time.perf_counter() - started
        if r.status_code != 200:
            raise RuntimeError(f"apply: {r.status_code} {r.text[:300]}")
        return took

    def rss(self) -> float:
        return rss_mb(self.proc.pid)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def load(serve: Serve, docs: list[dict[str, Any]]) -> float:
    """The world, in manifests of ~20,000 documents' worth of endpoints."""
    started = time.perf_counter()
    chunk: list[dict[str, Any]] = []
    weight = 0
    for d in docs:
        chunk.append(d)
        weight += len(d.get("endpoints", ())) + 1
        if weight >= 50_000:
            serve.apply(chunk)
            chunk, weight = [], 0
    if chunk:
        serve.apply(chunk)
    return time.perf_counter() - started


def measure(
    size: int, applies: int, extra: list[str], work: Path, probed: bool = False
) -> dict[str, Any]:
    docs = the_world(size, probed)
    dialled = next(d for d in docs if d["kind"] == "BackendService" and d["project"] == "consumer")
    serve = Serve(work, extra)
    try:
        time.sleep(1.0)  # (an empty serve settles: its baseline)
        empty = serve.rss()
        loaded = load(serve, docs)
        time.sleep(2.0 if not probed else 60.0)  # (probed: every endpoint once, at least)
        full = serve.rss()
        with_workers = rss_mb(serve.proc.pid, children=True)
        times = []
        for i in range(applies):
            dialled["backends"][0]["trafficDial"] = 60 if i % 2 == 0 else 100
            times.append(serve.apply([dialled]))
        return {
            "endpoints": size,
            "resources": len(docs),
            "loadSec": round(loaded, 2),
            "applyMedianMs": round(statistics.median(times) * 1000, 1),
            "applyP90Ms": round(sorted(times)[int(0.9 * (len(times) - 1))] * 1000, 1),
            "rssMb": round(full, 1),
            "bytesPerEndpoint": round((full - empty) * 1024 * 1024 / size),
            "withWorkersMb": round(with_workers, 1),
        }
    finally:
        serve.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,100000")
    ap.add_argument("--applies", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--profile", type=int, help="py-spy a big world's applies (needs py-spy)")
    ap.add_argument("--probed", action="store_true", help="check every endpoint (every 50 s)")
    ap.add_argument("serve_args", nargs="*", help="more options for serve (after --)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.profile:
            profile(args.profile, args.applies, args.serve_args, work)
            return
        rows = [
            measure(int(n), args.applies, args.serve_args, work, args.probed)
            for n in args.sizes.split(",")
        ]
    small, big = rows[0], rows[-1]
    ratio = big["applyMedianMs"] / max(small["applyMedianMs"], 0.1)
    print(f"{'endpoints':>10} {'resources':>9} {'load s':>7} {'apply ms':>9} {'p90 ms':>7} "
          f"{'RSS MB':>7} {'B/endpoint':>10} {'+workers MB':>11}")  # fmt: skip
    for r in rows:
        print(f"{r['endpoints']:>10,} {r['resources']:>9,} {r['loadSec']:>7} "
              f"{r['applyMedianMs']:>9} {r['applyP90Ms']:>7} {r['rssMb']:>7} "
              f"{r['bytesPerEndpoint']:>10,} {r['withWorkersMb']:>11}")  # fmt: skip
    print(f"one-document apply, {big['endpoints']:,} against {small['endpoints']:,} endpoints: "
          f"{ratio:.2f}x (goal <= {GOAL_RATIO}x); memory {big['bytesPerEndpoint']:,} B per "
          f"endpoint (goal <= {GOAL_BYTES_PER_ENDPOINT:,})")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ratio": round(ratio, 2)}, indent=2))


def profile(size: int, applies: int, extra: list[str], work: Path) -> None:
    docs = the_world(size)
    dialled = next(d for d in docs if d["kind"] == "BackendService" and d["project"] == "consumer")
    serve = Serve(work, extra)
    try:
        load(serve, docs)
        out = work / "profile.txt"
        spy = subprocess.Popen(
            ["py-spy", "record", "--pid", str(serve.proc.pid), "--format", "raw",
             "--output", str(out), "--rate", "500"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(1.0)
        for i in range(applies):
            dialled["backends"][0]["trafficDial"] = 60 if i % 2 == 0 else 100
            serve.apply([dialled])
        spy.terminate()
        spy.wait(30)
        counts: dict[str, int] = {}
        for line in out.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            for frame in set(stack.split(";")):
                counts[frame] = counts.get(frame, 0) + int(n)
        total = max(counts.values(), default=1)
        for frame, hits in sorted(counts.items(), key=lambda kv: -kv[1])[:60]:
            print(f"{100 * hits / total:5.1f}%  {frame[:150]}")
    finally:
        serve.close()


if __name__ == "__main__":
    main()
