"""The engine's hot paths in instructions, not seconds: a deterministic A/B.

These machines drift by 30 % and more within minutes, far more than the
differences worth measuring in the engine's per-result path. Under
``valgrind --tool=callgrind`` the instruction count of the same code and
input is the same on every run, whatever else the machine does. This script
counts, for each ``--src`` tree given, the instructions of

* ``steady``: 20,000 results that change nothing, through ``on_result``;
* ``batch``:  the same 20,000 through ``on_results`` (what serve does);
* ``flip``:   100 cycles of an endpoint failing (a cascade to the route)
  and healing,

each as (run with the work) - (run without it), over a 2,000-endpoint world,
and prints the ratio of every tree to the first.

    python bench/engine_instructions.py --src /path/to/before/src --src src

Needs valgrind (Debian's ``valgrind``); ~1 minute per tree.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

MODES = ("steady", "batch", "flip")
HERE = Path(__file__).resolve()


def workload(src: str, mode: str, work: bool) -> None:
    sys.path.insert(0, src)
    sys.path.insert(0, str(HERE.parent))
    import engine as bench_engine  # bench/engine.py: the same worlds
    from healthgate.health.engine import HealthEngine
    from healthgate.health.states import Outcome, ProbeResult

    eng = HealthEngine()
    added = eng.apply(bench_engine.parse(bench_engine.world(2000, 100)), 0.0).added
    slots = [t.slot for t in added]
    ok, bad = ProbeResult(Outcome.OK, 0.002, 200), ProbeResult(Outcome.TIMEOUT, 3.0)
    for _ in range(3):
        for s in slots:
            eng.on_result(1.0, s, ok)
    rnd = random.Random(1)
    order = [slots[rnd.randrange(len(slots))] for _ in range(20_000)]
    pairs = [(s, ok) for s in order]
    if not work:
        return
    if mode == "steady":
        on_result = eng.on_result
        for s in order:
            on_result(2.0, s, ok)
    elif mode == "batch":
        eng.on_results(2.0, pairs)
    else:
        now = 3.0
        for i in range(100):
            s = slots[i * 31 % len(slots)]
            for _ in range(3):
                eng.on_result(now, s, bad)
            for _ in range(3):
                eng.on_result(now, s, ok)
            now += 1


def count(src: str, mode: str, work: bool) -> int:
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        str(HERE),
        "--run",
        src,
        mode,
        "1" if work else "0",
    ]
    # the same hash seed in every run: dict and set layouts, hence the
    # instruction counts, then repeat exactly
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stderr
    m = re.search(r"Collected : (\d+)", out)
    if not m:
        raise RuntimeError(f"no instruction count from valgrind:\n{out[-2000:]}")
    return int(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--src", action="append", help="a src/ directory (repeat; the first is the base)"
    )
    ap.add_argument("--run", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        workload(args.run[0], args.run[1], args.run[2] == "1")
        return
    if not shutil.which("valgrind"):
        sys.exit("valgrind is not installed (Debian: apt-get install valgrind)")
    srcs = args.src or [str(HERE.parent.parent / "src")]
    base: dict[str, int] = {}
    for src in srcs:
        row = []
        for mode in MODES:
            n = count(src, mode, True) - count(src, mode, False)
            base.setdefault(mode, n)
            per = n / (20_000 if mode != "flip" else 100)
            row.append(
                f"{mode} {per:,.0f}/{'result' if mode != 'flip' else 'cycle'} "
                f"({n / base[mode]:.3f}x)"
            )
        print(f"{src}: " + "   ".join(row))


if __name__ == "__main__":
    main()
