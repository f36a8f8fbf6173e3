"""Partitions, measured (SPEC §4, "Partitions"; docs/cluster.md).

    sudo python bench/partitions.py                 # every scenario, 5 runs each
    sudo python bench/partitions.py --runs 2 --only "region cut off"

The test ground of tests/partitions (three regions as network namespaces on
this machine, links cut with nftables, a real etcd member and healthgate
node per region; needs root) runs each scenario ``--runs`` times and prints,
per scenario:

* **cut -> route**: seconds from the cut to each node's route change, where
  the scenario moves one (p50 / max over runs and nodes);
* **heal -> converged**: seconds from the heal until every node is a member
  again, every endpoint HEALTHY on every node, the routes back and the log
  holding every node's decisions (p50 / max);
* **flaps**: route changes beyond the scenario's expected ones, all nodes;
* **false**: records that should not exist - written late, written twice,
  or impossible in the scenario;
* **other**: the scenario's own times (p50 / max): when the cut-off node
  said it was no member (``cut_off_knew_after``, ``knew_after``), when
  another node led and the cut one said it did not (``new_leader_after``,
  ``old_leader_knew_after``).

No netem on these kernels: links are up or cut, never slow. The nodes'
lease TTL is 2 s (``--lease-ttl``), checks every second with thresholds of 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.partitions import scenarios
from tests.partitions.ground import Ground
from tests.partitions.netns import unavailable
from tests.partitions.scenarios import Outcome

SCENARIOS: dict[str, Callable[[Ground], Outcome]] = {
    "region cut off": lambda g: scenarios.region_cut_off(g, "us"),
    "region cut off, etcd leader inside": lambda g: scenarios.region_cut_off(
        g, "us", etcd_leader_inside=True
    ),
    "node cut longer than its lease": lambda g: scenarios.cut_longer_than_the_lease(g, "us"),
    "node cut from etcd only": lambda g: scenarios.cut_from_etcd_only(g, "eu"),
    "asymmetric cut": lambda g: scenarios.asymmetric(g, vantages=False),
    "asymmetric cut, vantageRegions": lambda g: scenarios.asymmetric(g, vantages=True),
    "elected writer cut": scenarios.writer_cut,
    "flapping link (2 s / 2 s, 30 s)": scenarios.flapping_link,
}


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"p50 {statistics.median(values):5.2f} s  max {max(values):5.2f} s"


def timings(outcomes: list[Outcome]) -> str:
    """The scenarios' other times (``*_after`` notes: the cut-off node knew
    it was no member, a new leader, ...), p50 / max each."""
    keys = sorted({k for o in outcomes for k in o.notes if k.endswith("_after")})
    parts = []
    for key in keys:
        values = [float(o.notes[key]) for o in outcomes if o.notes.get(key) is not None]
        if values:
            parts.append(f"{key} {statistics.median(values):.2f}/{max(values):.2f} s")
    return "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", action="append", help="a scenario's name (repeatable)")
    parser.add_argument("--lease-ttl", type=int, default=2)
    args = parser.parse_args()
    why = unavailable()
    if why:
        print(why, file=sys.stderr)
        return 2
    chosen = {k: v for k, v in SCENARIOS.items() if not args.only or k in args.only}
    if not chosen:
        print(f"no such scenario; one of: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="hg-partitions-"))
    started = time.monotonic()
    ground = Ground(tmp, lease_ttl=args.lease_ttl)
    print(f"ground up in {time.monotonic() - started:.1f} s (logs in {tmp})", flush=True)
    rows = []
    try:
        for name, scenario in chosen.items():
            outcomes = []
            for run in range(args.runs):
                out = scenario(ground)
                outcomes.append(out)
                print(f"  [{name} {run + 1}/{args.runs}] {out.line()}", flush=True)
                for line in out.false:
                    print(f"      false: {line}", flush=True)
            cut = [t for o in outcomes for t in o.cut_to_route.values()]
            heal = [o.heal_to_converged for o in outcomes]
            flaps = sum(sum(o.flaps.values()) for o in outcomes)
            false = sum(len(o.false) for o in outcomes)
            rows.append((name, spread(cut), spread(heal), flaps, false, timings(outcomes)))
    finally:
        ground.close()
    print(f"\n{'scenario':36} {'cut -> route':24} {'heal -> converged':24} flaps false  other")
    for name, cut_s, heal_s, flaps, false, other in rows:
        print(f"{name:36} {cut_s:24} {heal_s:24} {flaps:5} {false:5}  {other}")
    print(f"\n{args.runs} runs each, lease TTL {args.lease_ttl} s, checks 1 s / thresholds 2")
    return 1 if any(r[3] or r[4] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
